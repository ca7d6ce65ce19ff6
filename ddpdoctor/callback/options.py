"""`Doctor`'s arguments, checked once where they are given, as the CLI checks its flags.

A bad argument to the callback does its harm hours into a job: `every=10**9` once sized the
check's buffer by it (24 GB at the first check, the job OOM-killed), `every=0` was quietly taken
as 2, a `json_path` in a folder that does not exist wrote nothing and said nothing. Here each is
a `ValueError` at `Doctor(...)` (and at `lightning_callback(...)`/`hf_callback(...)`, which
check theirs before the fit starts), with one line saying what is wrong and what to give.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ddpdoctor.callback.step_clock import valid_ceiling

ON_HANG = ("report", "exit")


@dataclass(frozen=True)
class DoctorOptions:
    """Everything `Doctor` takes besides the job's own objects (model, optimizer, loader, sampler)."""

    every: int = 50
    """Steps between two checks at least (the first step is always checked). A whole number >= 1."""
    check_every_s: float = 2.0
    """Seconds of training between two checks at least: on 2 ms steps `every=50` alone would be ten
    gathers a second. 0 checks by `every` alone. The checks' schedule is agreed by all ranks at each
    check (docs/callback.md, "When it checks")."""
    step_deadline_s: float = 600.0
    """The ceiling of the learned step allowance (callback/step_clock.py): no step waits longer."""
    json_path: Optional[str] = None
    """Rank 0's findings as JSON (other ranks write `<json_path>.rank<N>`); its folder must exist."""
    on_finding: Optional[Callable[..., Any]] = None
    """Called with each new finding on rank 0 (and the hang's on every rank)."""
    raise_on_finding: bool = False
    """Raise `FindingRaised` into the loop at a warn or worse finding, on every rank at the same step."""
    on_hang: str = "report"
    """"report": name the hang and keep waiting; "exit": name it, then end the rank (culprit first)."""
    measure_comm: bool = True
    """Read the gradient all-reduce wait from DDP's own timers; False: judge data loading only."""
    batch_size: Optional[int] = None
    """Samples per rank and step, where the batch handed to `step()` does not show it."""
    history: Optional[str] = None
    """The fleet history store (docs/fleet.md) rank 0 appends the run to at close; its folder must exist."""
    on_metrics: Optional[Callable[..., Any]] = None
    """Called on rank 0 with each check's numbers (a dict)."""
    tensorboard: Any = None
    """A SummaryWriter, or a log folder to make one in, for each check's numbers."""
    trace_path: Optional[str] = None
    """Rank 0 writes the run's timeline here at the end (and at a hang): Chrome trace-event JSON that Perfetto and
    chrome://tracing open, the kept steps of every rank split into data, compute and waiting for peers, and the
    findings (docs/pictures.md); its folder must exist."""
    html_path: Optional[str] = None
    """Rank 0 writes its report at the end as one self-contained HTML page here: the verdict, the findings, the
    summary's chart and the timeline (charts need `pip install ddpdoctor[html]`); its folder must exist."""
    summary: bool = True
    """At the end of the run, rank 0 prints the run summary (verdict, per-rank step time and its parts) to stderr;
    False keeps it in the JSON and the log line only."""

    def __post_init__(self) -> None:
        _whole("every", self.every, minimum=1)
        _seconds("check_every_s", self.check_every_s)
        object.__setattr__(self, "step_deadline_s", valid_ceiling(self.step_deadline_s))
        object.__setattr__(self, "json_path", _file("json_path", self.json_path))
        object.__setattr__(self, "history", _file("history", self.history))
        object.__setattr__(self, "trace_path", _file("trace_path", self.trace_path))
        object.__setattr__(self, "html_path", _file("html_path", self.html_path))
        _callable("on_finding", self.on_finding)
        _callable("on_metrics", self.on_metrics)
        _flag("raise_on_finding", self.raise_on_finding)
        _flag("measure_comm", self.measure_comm)
        _flag("summary", self.summary)
        if self.on_hang not in ON_HANG:
            raise ValueError(f"on_hang must be 'report' or 'exit', not {self.on_hang!r}")
        if self.batch_size is not None:
            _whole("batch_size", self.batch_size, minimum=1)
        if self.tensorboard is not None and not ((isinstance(self.tensorboard, (str, os.PathLike))
                                                  and os.fspath(self.tensorboard))
                                                 or callable(getattr(self.tensorboard, "add_scalar", None))):
            raise ValueError(f"tensorboard must be a log folder or a SummaryWriter, not {type(self.tensorboard).__name__}")
        if isinstance(self.tensorboard, os.PathLike):
            object.__setattr__(self, "tensorboard", os.fspath(self.tensorboard))

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(cls.__dataclass_fields__)


def checked(options: dict[str, Any]) -> DoctorOptions:
    """The adapters' keyword arguments as options, or a ValueError naming one that `Doctor` does not take
    (a TypeError from deep in a framework's hook, at the start of a fit, says much less)."""
    unknown = sorted(set(options) - DoctorOptions.names() - {"optimizer", "loader", "sampler"})
    if unknown:
        raise ValueError(f"Doctor takes no argument {unknown[0]!r}; it takes: "
                         + ", ".join(sorted(DoctorOptions.names() | {"optimizer", "loader", "sampler"})))
    return DoctorOptions(**{k: v for k, v in options.items() if k in DoctorOptions.names()})


def _whole(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a whole number >= {minimum}, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value!r}")


def _seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, not {value!r}")


def _callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be a function (or None), not {type(value).__name__}")


def store_file(name: str, value: Any) -> Optional[str]:
    """`_file` for a path that did not come through the arguments (DDPDOCTOR_HISTORY)."""
    return _file(name, value)


def _file(name: str, value: Any) -> Optional[str]:
    """A file to write: its folder exists and is writable, and it is not itself a folder."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"{name} must be a file path, not {value!r}")
    path = os.fspath(value)
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"{name} {path!r} is a folder: give a file in it, e.g. {os.path.join(path, 'ddpdoctor.json')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{name} {path!r}: its folder {folder!r} does not exist; create it first (mkdir -p)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path!r}: its folder {folder!r} is not writable by this user")
    return str(path)
