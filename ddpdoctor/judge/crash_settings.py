"""A crash and the settings it ran with: which behaviour-changing variables were set, and what a try without
them showed.

Why: the crash's own output (a SIGSEGV's faulthandler stack inside torch, an abort in NCCL) never names the
variable the user exported while debugging, and "rank 0 crashed in stage ddp (SIGSEGV)" leaves them with a
segfault in torch. The variables come from core/behaviour_env.py's table: the launcher's environment where
`check` spawned the ranks itself (`settings.env_settings`), else what each rank said at the rendezvous. The try
without them is the launcher's (session/crash_retry.py), recorded in `settings.retried`; under torchrun or srun
nobody can restart the ranks, so the finding says how to try it instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ddpdoctor.core.behaviour_env import said, setting_for
from ddpdoctor.core.run_record import RunRecord

# Signals a process dies of by itself (a fault, an abort), not ones something else sent it (KILL, TERM, INT).
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE", "SIGSYS", "SIGTRAP"})
# An error that is a crash in native code all the same (CUDA's and NCCL's, an illegal memory access).
_NATIVE_ERROR = re.compile(r"illegal memory access|CUDA error|cuda runtime error|device-side assert|NCCL error"
                           r"|ncclUnhandledCudaError|ncclInternalError|ncclSystemError|Aborted|core dumped")


def is_crash(kind: str, detail: Mapping[str, Any]) -> bool:
    """A crash a setting can make: a fault or an abort, or a native error, never one we injected."""
    if detail.get("injected"):
        return False
    if kind == "crash":
        return detail.get("signal") in CRASH_SIGNALS
    if kind == "error":
        return bool(_NATIVE_ERROR.search(f"{detail.get('error', '')}\n{detail.get('traceback', '')}"))
    return False


def error_shape(detail: Mapping[str, Any]) -> str:
    """A rank's error with its numbers aside: a rank's own index, port or address in the message does not make
    another cause (run_diagnosis groups by it; `failed_alike` compares by it)."""
    return re.sub(r"\d+", "N", str(detail.get("error") or ""))


def failed_alike(fates: Mapping[int, Any]) -> Optional[Any]:
    """The first of the ranks, where every rank failed with the same error (its numbers aside) in the same stage:
    what a setting read by every rank makes (GLOO_DEVICE_TRANSPORT=uv: "makeDeviceForInterface(): unsupported
    gloo device" on each, inside init_process_group), and a failure no one rank is the cause of."""
    failed = list(fates.values())
    if not failed or any(f.kind != "error" or f.detail.get("injected") for f in failed):
        return None
    if len({(f.stage, error_shape(f.detail)) for f in failed}) != 1:
        return None
    return min(failed, key=lambda f: f.t)


def env_settings(record: RunRecord) -> dict[str, str]:
    """The behaviour-changing variables the ranks ran with: the launcher's where it spawned them, else the
    union of what each rank said (a variable set on one node only is still set)."""
    if isinstance(record.settings.get("env_settings"), dict):
        return dict(record.settings["env_settings"])
    out: dict[str, str] = {}
    for hello in record.hellos.values():
        for name, value in (hello.get("env_settings") or {}).items():
            out.setdefault(str(name), str(value))
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Retry:
    """What `check` saw when it ran the failing stage again without the settings."""

    stage: str
    without: tuple[str, ...]
    passed: bool
    culprits: tuple[str, ...]  # the ones the stage crashes with, alone; () where not told apart
    seconds: float
    note: str = ""

    @classmethod
    def of(cls, record: RunRecord, stage: str) -> Optional["Retry"]:
        raw = record.settings.get("retried")
        if not isinstance(raw, dict) or raw.get("stage") != stage or raw.get("interrupted") or "passed" not in raw:
            return None  # no try, or one cut short: nothing learned
        return cls(stage, tuple(raw.get("without") or ()), bool(raw.get("passed")), tuple(raw.get("culprits") or ()),
                   float(raw.get("seconds") or 0.0), str(raw.get("note") or ""))

    @property
    def cleared(self) -> bool:
        """The stage passed without the settings and the ones it crashes with alone are known: they lead."""
        return self.passed and bool(self.culprits)

    def evidence(self) -> dict[str, Any]:
        return {"without": list(self.without), "passed": self.passed, "culprits": list(self.culprits),
                "seconds": self.seconds}


def described(settings: Mapping[str, str]) -> list[str]:
    """Each setting with what it changes, for the evidence: `TORCH_DISTRIBUTED_DEBUG=DETAIL: wraps ...`."""
    out = []
    for name, value in settings.items():
        entry = setting_for(name)
        out.append(f"{name}={value}: {entry.changes} ({entry.project})" if entry else f"{name}={value}")
    return out


_WHY_UNSET = {
    "debug": "a debugging switch, not needed to train.",
    "blocking": "a debugging switch that makes waits blocking, not needed to train.",
    "error handling": "the default handling is what the project tests.",
    "transport": "without it the library picks its transport for this machine itself.",
    "algorithm": "without it the library picks its algorithms for each size itself.",
    "allocator": "the default allocator is what the project tests.",
}


def why_unset(entries: Any) -> str:
    """Why unsetting is safe, by the kind of each setting (a debugging switch, a transport forced, ...)."""
    kinds = [e.kind for e in entries if e is not None]
    return " ".join(dict.fromkeys(_WHY_UNSET.get(k, "") for k in kinds)).strip() or "it is not needed to train."


def unset_command(names: Any) -> str:
    return "env " + " ".join(f"-u {n}" for n in names)


def crash_text(settings: Mapping[str, str], retry: Optional[Retry]) -> tuple[str, str]:
    """(why, fix) sentences for a crash finding that is not led by a setting: what the ranks ran with, and what
    the try without them showed or how to make it."""
    if not settings:
        return "", ""
    listed = said(settings)
    if retry is not None and not retry.passed:
        return (f"The ranks ran with {listed}; the stage crashed again without "
                f"{'it' if len(settings) == 1 else 'them'} ({retry.seconds:g} s), so "
                f"{'it is' if len(settings) == 1 else 'they are'} not the cause.{' ' + retry.note if retry.note else ''}",
                "")
    if retry is not None and retry.passed:  # passed without them all, but no single one crashes it alone
        return (f"The ranks ran with {listed}; without them all the stage passed ({retry.seconds:g} s), and no one "
                "of them alone made it crash again: a combination of them does."
                f"{' ' + retry.note if retry.note else ''}",
                f"Run without {listed} ({unset_command(settings)} ...).")
    return (f"The ranks ran with settings that change how torch, NCCL, gloo or CUDA behave: {listed}.",
            f"Try the job once without them ({unset_command(settings)} ...); if the crash goes away, one of them "
            "made it (docs/runtime.md lists what each changes).")
