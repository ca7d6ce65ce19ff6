"""What the scaling probe measured on one rank, typed: its medians at each size and each DDP setting.

The field names are the JSON keys collect has always written, in the order it writes them
(the rank's identity first, then what `scaling_run.measure` fills in), so reports read back
byte for byte. A size or setting this rank did not reach is absent from `sizes` or `knobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ddpdoctor.core.facts import Facts, nested_map
from ddpdoctor.runtime.scaling_run import KnobRow, SizeRow


@dataclass
class ScalingFacts(Facts):
    """One rank's scaling measurement (it is also `scaling_run.ScalingRecord`, which fills it)."""

    rank: Optional[int] = None
    host: Optional[str] = None
    device: str = ""
    backend: str = ""
    model: str = ""  # the user's --model, or "built-in MLP"
    cpus_usable: Optional[int] = None
    sizes: dict[str, SizeRow] = field(default_factory=dict, metadata=nested_map(SizeRow))  # by "1", "2", ...
    knobs: dict[str, KnobRow] = field(default_factory=dict, metadata=nested_map(KnobRow))  # by setting's name
    batch_size: Optional[int] = None  # samples a step, the same on every rank at every size
    sizes_asked: list[int] = field(default_factory=list)  # --sizes; [] for the default 1, 2, 4, ...
    parameters: int = 0
    gradient_bytes: int = 0
