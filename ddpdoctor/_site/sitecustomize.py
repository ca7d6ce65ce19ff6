"""`ddpdoctor run`'s door into the processes a launcher starts: Python runs this at start-up, from PYTHONPATH.

`ddpdoctor run` puts this folder first on PYTHONPATH and its settings in DDPDOCTOR_RUN; every Python process
started under it (torchrun's workers, mp.spawn's children, `accelerate launch`'s) then attaches the Doctor
(ddpdoctor/autorun.py: hooks that wait for torch's import, nothing more). A sitecustomize of the
environment's own, which this file hides by coming first, is run too, first: nothing it did is lost.
"""

import os
import sys


def _theirs() -> None:
    """The sitecustomize this one hides (a distribution's or a virtual environment's), run as Python would."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _ours() -> None:
    if not os.environ.get("DDPDOCTOR_RUN"):
        return
    try:
        from ddpdoctor import autorun

        autorun.start()
    except Exception as exc:  # a Python without ddpdoctor, or a bug of ours: the process runs on, unwatched
        sys.stderr.write(f"ddpdoctor run: not attached in process {os.getpid()}: {type(exc).__name__}: {exc}\n")


try:
    _theirs()
except Exception as exc:
    sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")
_ours()
