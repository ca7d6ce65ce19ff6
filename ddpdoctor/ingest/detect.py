"""Which tool wrote a file, from its content alone: users rename files, paste them into tickets
and concatenate them, so the name says nothing.

Each kind is known by lines only that tool prints (nvidia-smi's "==============NVSMI LOG",
the `<nvidia_smi_log>` root, topo -m's legend, nccl-tests' "out-of-place" header, dcgmi's
diagnostic table); the first match in KINDS order wins. The text is cleaned first (paste.py): a
terminal's colour escapes split the header words the signs look for.
"""

from __future__ import annotations

import re
from typing import Optional

from ddpdoctor.ingest.paste import clean

_SIGNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("nvidia-smi-q-xml", re.compile(r"<nvidia_smi_log\b")),
    # The whole log, or an excerpt users paste: one of its section headings over `Key : value` lines.
    ("nvidia-smi-q", re.compile(r"=+\s*NVSMI LOG\s*=+|^\s*Attached GPUs\s*:|^\s*(Clocks (Throttle|Event) Reasons"
                                r"|ECC Errors|Remapped Rows|Retired Pages)\s*\n(\s+[^:\n]+\n){0,2}\s+\S[^:\n]*:", re.M)),
    ("topo-m", re.compile(r"^\s*GPU0(\s+GPU\d+)*(\s+(NIC|mlx)\S*)*\s+CPU Affinity|^\s*Legend:\s*$", re.M)),
    ("nvlink-status", re.compile(r"^GPU \d+: [^\n]*\n\s*Link \d+: ", re.M)),  # (UUID: ..) since ~450
    ("nccl-tests", re.compile(r"#\s+out-of-place\s+in-place|Avg bus bandwidth\s*:", re.M)),
    ("dcgmi-diag", re.compile(r"Diagnostic\s*\|\s*Result|\"DCGM GPU Diagnostic\"|\bdcgmi\b.*\bdiag\b"
                              r"|^\|[^|\n]*\|\s*(Pass|Fail|Skip|Warn)\s+-\s+GPUs?:", re.M)),
)


def detect(text: str) -> Optional[str]:
    """The kind of output `text` is (one of model.KINDS), or None."""
    text = clean(text)
    for kind, sign in _SIGNS:
        if sign.search(text):
            return kind
    return None
