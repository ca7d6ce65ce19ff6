"""A crashed stage tried once more without the behaviour-changing settings the ranks ran with.

Why: a SIGSEGV in DDP's constructor under TORCH_DISTRIBUTED_DEBUG=DETAIL, an abort under a forced NCCL_ALGO,
read from the crash alone, is a segfault in torch. Running the same stage again without the settings tells
the user in seconds what an afternoon of bisecting would: if it passes, the finding leads with the variable
(judge/crash_settings.py, RUN013); if it crashes again, the settings are cleared of suspicion. Where several were
set, each is then tried alone (at most MAX_ALONE) to name the one it crashes with.

Only `check` run standalone can do this: it spawned the ranks, so it can spawn them again with another
environment. Bounded: each try has a stage deadline of at most TRY_TIMEOUT_S and all of them stop starting once
BUDGET_S has passed; the time taken is in the report. Never on a run that was interrupted or had faults injected,
never on a healthy one (it costs nothing where nothing crashed).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ddpdoctor.core.run_record import RunRecord
from ddpdoctor.judge.crash_settings import failed_alike, is_crash
from ddpdoctor.judge.run_diagnosis import rank_fates
from ddpdoctor.runtime.config import CheckConfig

TRY_TIMEOUT_S = 30.0  # a try's stage deadline (the run's own --timeout where shorter)
BUDGET_S = 60.0  # no try starts after this long
MAX_ALONE = 3  # settings tried one by one, where several were set

Launch = Callable[[CheckConfig, list[str], tuple[str, ...]], RunRecord]


@dataclass(frozen=True)
class Plan:
    stage: str  # the stage the first crash was in
    probe: str  # the probe holding it: the one run again
    names: tuple[str, ...]  # the settings to run without


def plan(record: RunRecord, cfg: CheckConfig) -> Optional[Plan]:
    """A try to make, where a rank crashed (a fault, an abort, a native error) with settings set."""
    settings = record.settings.get("env_settings") or {}
    if cfg.command != "check" or record.interrupted or record.faults or not settings or not cfg.probes:
        return None
    fates = rank_fates(record)
    crashed = [f for f in fates.values() if is_crash(f.kind, f.detail)]
    first = min(crashed, key=lambda f: f.t) if crashed else failed_alike(fates)
    if first is None:
        return None
    return Plan(first.stage, _probe_of(record, first.rank, cfg.probes), tuple(settings))


def _probe_of(record: RunRecord, rank: int, probes: tuple[str, ...]) -> str:
    """The probe the rank was in when it crashed (its timeline's last `probe:` stage); the first probe where it
    crashed before any (the rendezvous and init run before every probe, so they are tried with it)."""
    for entry in reversed(record.timelines.get(rank) or []):
        name = str(entry.get("name", ""))
        if name.startswith("probe:") and name[len("probe:"):] in probes:
            return name[len("probe:"):]
    return probes[0]


def _crashed_in(record: RunRecord, stage: str) -> bool:
    """The stage crashed again, or every rank failed in it alike again."""
    fates = rank_fates(record)
    alike = failed_alike(fates)
    return any(is_crash(f.kind, f.detail) and f.stage == stage for f in fates.values()) or (
        alike is not None and alike.stage == stage)


def _passed(record: RunRecord) -> bool:
    return not record.interrupted and all(f.kind == "ok" for f in rank_fates(record).values())


def run(p: Plan, cfg: CheckConfig, argv: list[str], launch: Launch) -> dict[str, Any]:
    """The tries, as the report keeps them (`settings.retried`): without them all, then each alone."""
    began = time.monotonic()
    timeout = min(cfg.timeout_s, TRY_TIMEOUT_S)
    try_cfg = dataclasses.replace(cfg, probes=(p.probe,), live=False, timeout_s=timeout, port=None,
                                  json_path=None, prom_path=None, trace_path=None, html_path=None)
    # The ranks read their probes and deadline from their command line; the last --probes and --timeout win.
    try_argv = [*argv, "--probes", p.probe, "--timeout", f"{timeout:g}"]
    out: dict[str, Any] = {"stage": p.stage, "probe": p.probe, "without": list(p.names)}
    first = launch(try_cfg, try_argv, p.names)
    if first.interrupted:
        return {**out, "interrupted": first.interrupted, "seconds": round(time.monotonic() - began, 1)}
    out["passed"] = _passed(first)
    culprits: list[str] = []
    if out["passed"] and len(p.names) == 1:
        culprits = list(p.names)
    elif out["passed"]:
        tried = 0
        for name in p.names[:MAX_ALONE]:
            if time.monotonic() - began > BUDGET_S:
                break
            tried += 1
            alone = launch(try_cfg, try_argv, tuple(n for n in p.names if n != name))  # only `name` kept
            if alone.interrupted:
                out["interrupted"] = alone.interrupted
                break
            if _crashed_in(alone, p.stage):
                culprits.append(name)
        if tried < len(p.names):
            out["note"] = f"{tried} of the {len(p.names)} settings tried alone (at most {MAX_ALONE}, within {BUDGET_S:g} s)"
    out["culprits"] = culprits
    out["seconds"] = round(time.monotonic() - began, 1)
    return out
