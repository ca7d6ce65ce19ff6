"""The fault-injection grammar: what `--inject` and DDPDOCTOR_INJECT say, parsed in one place.

`KIND:key=value[:key=value...][,KIND:...]`, from `--inject` or the DDPDOCTOR_INJECT variable
(for ranks started by torchrun or srun, where we do not own the command line). Pure parsing:
the CLI checks a spec before any rank starts, the ranks read it back, and the run diagnosis reads
the report's recorded faults, all without the runtime that carries faults out (runtime/inject.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.probe_names import PROBE_NAMES

ENV_VAR = "DDPDOCTOR_INJECT"

# Exit status of a rank that crashed on purpose; distinct from Python's 1 so the
# report can tell an injected crash from a real one without guessing.

STAGES = ("rendezvous", "init", "ddp", "train", "verify", "report")
# Not stages a rank publishes: `launch` is the process's first line, before torch is imported
# or the store dialled; `collective` is inside DDP's gradient all-reduce mark, before the call
# reaches the backend, so its peers wait in the collective while this rank is stuck in its own code.
FAULT_STAGES = ("launch",) + STAGES + ("collective",)
# `stage=probe:NAME` (e.g. probe:topology): at the entry of that probe's stage.
PROBE_STAGE_PREFIX = "probe:"

_KEYS = {
    "slow": {"rank": True, "factor": True},
    "hang": {"rank": True, "stage": True},
    "crash": {"rank": True, "stage": True},
    "kill": {"rank": True, "stage": True},  # SIGKILL to itself, as the kernel's OOM killer or `kill -9` would
    "oom": {"rank": True, "stage": True},  # really allocates until an allocation fails (MemoryError / CUDA OOM)
    # The rank signals ddpdoctor's own launcher (standalone only), as Ctrl-C or `kill` would.
    "sigint": {"rank": True, "stage": True},
    "sigterm": {"rank": True, "stage": True},
    "diverge": {"rank": True},
    "corrupt": {"rank": True},  # the rank's collective results come out wrong (checked by allreduce)
    # Collectives between these two ranks crawl (localised by allreduce): at mbps Mbit/s (2000 unless given),
    # as a link throttled with `tc` to that rate would.
    "slowlink": {"ranks": True, "mbps": False},
    # Their own 2-rank collective crawls the first time only: a burst of noise, not a slow link.
    "blip": {"ranks": True},
    "desync": {"rank": True},  # the rank calls another collective than its peers, once, in training
    "noshow": {"rank": True},  # the rank's process starts but never joins the rendezvous
    "badport": {"rank": True},  # the rank dials the rendezvous on a port where nothing listens
    "badaddr": {"rank": True},  # the rank's MASTER_ADDR is a name that does not resolve
    # Every rank all-reduces a 192-byte metrics tensor once; this rank's is float64[24], the others'
    # float32[48]: same bytes, so gloo reduces garbage without a word (as a rank with another
    # precision setting would), and only torch's Flight Recorder sees the difference.
    "dtype": {"rank": True},
    "slowdata": {"rank": True, "ms": True},  # the rank's data loader stalls this long for every batch
    # The rank gets `factor` times its peers' batch: more work, not slower hardware (an uneven split).
    "bigbatch": {"rank": True, "factor": True},
    # Made from outside the rank by a separate process (runtime/outside_faults.py); False: optional.
    "hog": {"rank": True, "pct": False},  # a busy process on the rank's CPUs, spinning pct% (100)
    "quota": {"rank": True, "pct": True},  # a cgroup CPU quota of pct% of one CPU on the rank
    "preempt": {"rank": True, "pct": True},  # the rank SIGSTOPped pct% of every 100 ms
    "mempressure": {"rank": True, "mb": True},  # a process holding and touching mb MiB
}
# The faults a separate process makes: they act from the rank's start to its end.
OUTSIDE = ("hog", "quota", "preempt", "mempressure")
# RFC 6761 reserves .invalid: no resolver anywhere answers for it.
BAD_ADDR = "ddpdoctor-injected-badaddr.invalid"
# A slow link carries this much: about a PCIe Gen1 x1 lane, far below any real interconnect.
SLOW_LINK_BYTES_PER_S = 0.25e9

_HELP = (
    "expected e.g. slow:rank=1:factor=2, hang:rank=0:stage=train, crash:rank=1:stage=init, "
    "hang:rank=1:stage=collective, kill:rank=1:stage=ddp, oom:rank=1:stage=probe:topology, "
    "sigint:rank=0:stage=train, sigterm:rank=1:stage=init, diverge:rank=1, corrupt:rank=1, "
    "slowlink:ranks=1,2[:mbps=500], blip:ranks=1,2, desync:rank=1, "
    "noshow:rank=1, badport:rank=1, badaddr:rank=1, dtype:rank=1, slowdata:rank=1:ms=20, bigbatch:rank=1:factor=2, "
    "hog:rank=1[:pct=100], quota:rank=1:pct=30, preempt:rank=1:pct=30 or mempressure:rank=1:mb=2048; "
    "stages: "
    + ", ".join(FAULT_STAGES) + " or probe:NAME"
)
# Faults that signal the launcher need one that ddpdoctor started.
LAUNCHER_SIGNALS = {"sigint": "SIGINT", "sigterm": "SIGTERM"}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    stage: Optional[str] = None
    factor: Optional[float] = None
    peer: Optional[int] = None  # slowlink: the other end of the link
    ms: Optional[float] = None  # slowdata: the stall per batch
    pct: Optional[float] = None  # hog, quota, preempt: the strength, in percent
    mb: Optional[float] = None  # mempressure: MiB held
    mbps: Optional[float] = None  # slowlink: the link's rate in Mbit/s (None: SLOW_LINK_BYTES_PER_S)

    def link_bytes_per_s(self) -> float:
        """slowlink: what the link carries, bytes per second."""
        return self.mbps * 1e6 / 8 if self.mbps is not None else SLOW_LINK_BYTES_PER_S

    def describe(self) -> str:
        parts = [self.kind, f"rank={self.rank}" if self.peer is None else f"ranks={self.rank},{self.peer}"]
        if self.stage is not None:
            parts.append(f"stage={self.stage}")
        if self.ms is not None:
            parts.append(f"ms={self.ms:g}")
        if self.pct is not None:
            parts.append(f"pct={self.pct:g}")
        if self.mb is not None:
            parts.append(f"mb={self.mb:g}")
        if self.mbps is not None:  # read back by the run's diagnosis: exact, as factor is
            short = f"{self.mbps:g}"
            parts.append(f"mbps={short if float(short) == self.mbps else repr(self.mbps)}")
        if self.factor is not None:
            short = f"{self.factor:g}"
            parts.append(f"factor={short if float(short) == self.factor else repr(self.factor)}")
        return ":".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_faults(spec: Optional[str]) -> tuple[Fault, ...]:
    if not spec or not spec.strip():
        return ()
    # Faults are comma-separated, and so are slowlink's two ranks: a piece that does not
    # start a new fault (no "kind:", or a rank number before its next option: "5:mbps=500") continues
    # the one before it.
    items: list[str] = []
    for piece in spec.split(","):
        piece = piece.strip()
        if items and piece and (":" not in piece or piece.split(":")[0].strip().isdigit()):
            items[-1] += "," + piece
        elif piece:
            items.append(piece)
    return tuple(_parse_one(item) for item in items)


def _parse_one(item: str) -> Fault:
    kind, *pairs = _rejoin_probe_stage(item.split(":"))
    kind = kind.strip().lower()
    if kind not in _KEYS:
        raise UsageError(f"unknown fault kind {kind!r} in --inject {item!r}: {_HELP}")
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS[kind]:
            raise UsageError(f"bad option {pair!r} for fault {kind!r} in --inject {item!r}: {_HELP}")
        if key in values:
            raise UsageError(f"{key!r} given twice for fault {kind!r} in --inject {item!r}")
        values[key] = value.strip()
    missing = [k for k, needed in _KEYS[kind].items() if needed and k not in values]
    if missing:
        raise UsageError(f"fault {kind!r} needs {', '.join(missing)} in --inject {item!r}: {_HELP}")
    peer = None
    if kind in ("slowlink", "blip"):
        ends = [e.strip() for e in values["ranks"].split(",")]
        if len(ends) != 2 or not all(e.isdigit() for e in ends) or ends[0] == ends[1]:
            raise UsageError(f"{kind} needs two different ranks, e.g. {kind}:ranks=1,2, in --inject {item!r}")
        rank, peer = int(ends[0]), int(ends[1])
    else:
        try:
            rank = int(values["rank"])
        except ValueError:
            raise UsageError(f"rank must be an integer in --inject {item!r}") from None
    if rank < 0:
        raise UsageError(f"rank must be >= 0 in --inject {item!r}")
    stage = values.get("stage")
    if stage is not None:
        stage = _valid_stage(stage.lower(), item)
    factor = None
    if "factor" in values:
        try:
            factor = float(values["factor"])
        except ValueError:
            raise UsageError(f"factor must be a number in --inject {item!r}") from None
        if not 1.0 <= factor <= 1000.0:
            raise UsageError(f"factor must be between 1 and 1000 in --inject {item!r}")
    if kind == "bigbatch" and factor is not None and factor > 16:
        raise UsageError(f"bigbatch factor must be at most 16 in --inject {item!r}")
    ms = None
    if "ms" in values:
        try:
            ms = float(values["ms"])
        except ValueError:
            raise UsageError(f"ms must be a number of milliseconds in --inject {item!r}") from None
        if not 0.0 <= ms <= 60000.0:
            raise UsageError(f"ms must be between 0 and 60000 in --inject {item!r}")
    pct = _number(values, "pct", item, 1.0, 100.0)
    mb = _number(values, "mb", item, 1.0, 1 << 20)
    mbps = _number(values, "mbps", item, 1.0, 1e6)
    return Fault(kind=kind, rank=rank, stage=stage, factor=factor, peer=peer, ms=ms, pct=pct, mb=mb, mbps=mbps)


def _number(values: dict[str, str], key: str, item: str, low: float, high: float) -> Optional[float]:
    if key not in values:
        return None
    try:
        value = float(values[key])
    except ValueError:
        raise UsageError(f"{key} must be a number in --inject {item!r}") from None
    if not low <= value <= high:
        raise UsageError(f"{key} must be between {low:g} and {high:g} in --inject {item!r}")
    return value


def _rejoin_probe_stage(parts: list[str]) -> list[str]:
    """`stage=probe:topology` was split at its own colon: put the probe's name back."""
    out: list[str] = []
    for part in parts:
        if out and "=" not in part and out[-1].replace(" ", "").lower().endswith("stage=probe"):
            out[-1] += ":" + part
        else:
            out.append(part)
    return out


def _valid_stage(stage: str, item: str) -> str:
    if stage.startswith(PROBE_STAGE_PREFIX):
        name = stage[len(PROBE_STAGE_PREFIX):].strip()
        if name not in PROBE_NAMES:
            raise UsageError(f"unknown probe {name!r} in stage {stage!r} of --inject {item!r}: "
                             f"choose from {', '.join(PROBE_NAMES)}")
        return PROBE_STAGE_PREFIX + name
    if stage not in FAULT_STAGES:
        raise UsageError(f"unknown stage {stage!r} in --inject {item!r}: {_HELP}")
    return stage


def check_standalone(faults: tuple[Fault, ...], standalone: bool) -> None:
    """sigint/sigterm signal ddpdoctor's own launcher; under torchrun or srun there is none to signal."""
    if standalone:
        return
    for fault in faults:
        if fault.kind in LAUNCHER_SIGNALS:
            raise UsageError(f"--inject {fault.describe()} signals ddpdoctor's own launcher: run `ddpdoctor check` "
                             "without torchrun or srun for it, or interrupt your launcher yourself")


def check_ranks(faults: tuple[Fault, ...], world_size: int) -> None:
    for fault in faults:
        for rank in (fault.rank, fault.peer):
            if rank is not None and rank >= world_size:
                raise UsageError(
                    f"--inject {fault.describe()} names rank {rank}, but there are only "
                    f"{world_size} ranks (0-{world_size - 1})"
                )
