"""Unit tier: pure functions only, no processes, no files outside tmp_path.

Hypothesis keeps its caches (the unicode charmap, constants found in the code) in a
folder of its own; point it outside the checkout so a test run leaves the tree as it was.
"""

import tempfile
from pathlib import Path

from hypothesis import configuration

configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "ddpdoctor-unit-hypothesis")
