"""Which algorithm and protocol NCCL chose for each collective, from its own TUNING log.

busbw means different things under different algorithms: a ring's busbw is bounded by its
slowest link, while NVLS (NVLink SHARP) and CollNet reduce in the switch and can exceed it.
NCCL says what it picked, per call, on its communicator's rank 0, when NCCL_DEBUG=INFO and
NCCL_DEBUG_SUBSYS includes TUNING. The line has changed across NCCL versions; these shapes
are from public logs and NCCL's format strings (none was recorded here: no GPU was lent):

    NCCL INFO AllReduce: 268435456 Bytes -> Algo NVLS proto Simple channel{Lo..Hi}={0..15}
    NCCL INFO Broadcast:    32768 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..0}
    NCCL INFO AllGather: 37756928 Bytes -> Algo 1 proto 2 time 2860.208008
    NCCL INFO 37756928 Bytes -> Algo 1 proto 2 time 2860.208008          (older: no op name)

The bench asks NCCL for that log in a file of its own, only where the user has not set
NCCL_DEBUG (their own logging is left alone), and reads it back after the sweep.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

# NCCL's numeric codes (nccl_common.h: NCCL_ALGO_*, NCCL_PROTO_*), used by older versions' lines.
ALGORITHMS = {0: "Tree", 1: "Ring", 2: "CollNetDirect", 3: "CollNetChain", 4: "NVLS", 5: "NVLSTree", 6: "PAT"}
PROTOCOLS = {0: "LL", 1: "LL128", 2: "Simple"}
_NAMES = {name.upper().replace("_", ""): name for name in ALGORITHMS.values()} | {
    name.upper(): name for name in PROTOCOLS.values()}
_LINE = re.compile(r"(?:\b(?P<op>[A-Za-z]+):\s+)?(?P<bytes>\d+) Bytes -> Algo (?P<algo>[\w]+) proto (?P<proto>\w+)")
# torch's op names (ours) -> NCCL's, as its log writes them.
NCCL_OPS = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter",
            "broadcast": "Broadcast", "all_to_all": "AllToAll"}
LOG_NAME = "nccl-tuning.%h.%p.log"
IN_NETWORK = ("NVLS", "NVLSTree", "CollNetDirect", "CollNetChain")
# The ops whose logged byte count is the bench's size. For AllGather and ReduceScatter NCCL has
# logged the per-rank count in some versions and the whole array in others: not matched.
SIZES_AGREE = ("all_reduce", "broadcast")


@dataclass(frozen=True)
class Choice:
    op: Optional[str]  # NCCL's name (AllReduce); None in older lines
    nbytes: int
    algorithm: str
    protocol: str


def _name(token: str, codes: Mapping[int, str]) -> str:
    if token.isdigit():
        return codes.get(int(token), f"#{token}")
    return _NAMES.get(token.upper().replace("_", ""), token)


def parse(text: str) -> list[Choice]:
    """Every choice line in a log, in order; other lines are ignored."""
    out = []
    for line in text.splitlines():
        if "Bytes -> Algo" not in line:
            continue
        m = _LINE.search(line)
        if m is None:
            continue
        op = m.group("op")
        out.append(Choice(op if op and op != "INFO" else None, int(m.group("bytes")),
                          _name(m.group("algo"), ALGORITHMS), _name(m.group("proto"), PROTOCOLS)))
    return out


def capture_env(environ: Mapping[str, str], folder: str) -> dict[str, str]:
    """The variables that make NCCL write its choices to `folder`; none if the user set NCCL_DEBUG."""
    if environ.get("NCCL_DEBUG"):
        return {}
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING", "NCCL_DEBUG_FILE": os.path.join(folder, LOG_NAME)}


def read_choices(folder: str, limit_bytes: int = 16 * 2**20) -> list[Choice]:
    """What this process's NCCL wrote (one file per host and pid); bounded, a missing file is none."""
    choices: list[Choice] = []
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("nccl-tuning."))
    except OSError:
        return choices
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                choices += parse(f.read(limit_bytes))
        except OSError:
            continue
    return choices


def by_size(choices: list[Choice], op: str) -> dict[int, str]:
    """size in bytes -> "Algo/proto" for one of our ops, the last choice NCCL made at that size."""
    wanted = NCCL_OPS.get(op)
    return {c.nbytes: f"{c.algorithm}/{c.protocol}" for c in choices if c.op in (None, wanted)}
