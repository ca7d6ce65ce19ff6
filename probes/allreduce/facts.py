"""What the allreduce probe measured on one rank, typed (the JSON keys collect has always written).

One rank's facts: who it is and what it swept (`AllReduceFacts`), each size it timed
(`SizeTiming`), and, when the run localises, its timings of the ring pairs it belongs to
(`PairTimings`) and of its node and node-leader pairs (`NodeTimings`). Fields are declared in
the order collect writes them, so a freshly built object's JSON is the one it always wrote;
`from_json` reads reports and snapshots of any age tolerantly (ddpdoctor.core.facts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Optional

from ddpdoctor.core.facts import Facts, nested, nested_list


@dataclass
class SizeTiming(Facts):
    """One (size, placement) of the sweep: this rank's own time of every timed call."""

    size_bytes: int = 0
    count: int = 0
    in_place: bool = False
    times_s: list[float] = field(default_factory=list)
    wrong: Optional[int] = None  # elements this rank got wrong; None with --no-check


@dataclass
class PairTimings(Facts):
    """This rank's times of the ring pairs it is in, keyed "a-b"; `retimed` names the pairs
    timed a second round because the first looked slow (their times are the two rounds')."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"retimed"})

    size_bytes: int = 0
    times_s: dict[str, list[float]] = field(default_factory=dict)
    retimed: Optional[list[str]] = None


@dataclass
class NodeTimings(Facts):
    """Across nodes: the host of every rank, this rank's time inside its own node (keyed by
    host), and its times of the node-leader pairs it is in (keyed "a-b" by leader rank).
    `nic_name`/`nic_speed_mbps`: the socket interface this rank's backend was told to use
    (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) and the rate it declares, where both are known.
    `search_groups`/`search_busbw`: above 4 nodes, on rank 0, each round of the node search
    (ddpdoctor/judge/node_search.py): its groups of nodes and their busbw, GB/s."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"nic_name", "nic_speed_mbps", "search_groups", "search_busbw"})

    size_bytes: int = 0
    node_of_rank: list[str] = field(default_factory=list)
    intra_times_s: dict[str, list[float]] = field(default_factory=dict)
    leader_times_s: dict[str, list[float]] = field(default_factory=dict)
    nic_name: Optional[str] = None
    nic_speed_mbps: Optional[int] = None
    search_groups: Optional[list[list[list[str]]]] = None
    search_busbw: Optional[list[list[float]]] = None


@dataclass
class AllReduceFacts(Facts):
    """One rank's allreduce facts: the sweep, and what localising a slow link measured."""

    # Written only when known: NCCL's choices when asked for, the pairs and nodes when localising.
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"nccl_algorithms", "pairs", "nodes", "gpu_name"})

    host: str = ""
    rank: int = 0
    local_rank: int = 0
    device: str = ""
    backend: Optional[str] = None  # None where absent: BW000's evidence has always said null then, not ""
    op: str = ""
    dtype: str = ""
    world_size: int = 0
    warmup: int = 0
    iters: int = 0
    results: list[SizeTiming] = field(default_factory=list, metadata=nested_list(SizeTiming))
    nccl_algorithms: Optional[dict[str, str]] = None  # str(size) -> "Algo/proto", as NCCL logged it
    pairs: Optional[PairTimings] = field(default=None, metadata=nested(PairTimings))
    nodes: Optional[NodeTimings] = field(default=None, metadata=nested(NodeTimings))
    # The GPU's model, where only a tool's output says it (nccl-tests' rank lines): with no topology
    # read beside the sweep, it says what the GPUs' own interconnect should give (probes/allreduce/by_model.py).
    gpu_name: Optional[str] = None

    def nccl_choices(self) -> dict[int, str]:
        """size -> "Algo/proto" (empty off NCCL, when the user's NCCL_DEBUG won, or unreadable)."""
        recorded = self.nccl_algorithms
        if not isinstance(recorded, Mapping):  # a None default accepts any JSON value: check its kind here
            return {}
        return {int(k): str(v) for k, v in recorded.items() if str(k).isdigit()}
