"""What a probe is: collect on each rank, gather (shared), diagnose on all ranks' facts.

`diagnose` is pure, so it is tested on recorded facts without starting a process.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from ddpdoctor.core import codes
from ddpdoctor.core.facts import Facts, facts_by_rank
from ddpdoctor.core.findings import Finding
from ddpdoctor.judge.one_per_cause import merge

if TYPE_CHECKING:
    from ddpdoctor.runtime.context import RankContext


@dataclass(frozen=True)
class RunView:
    """What a diagnosis may know about the run besides the facts."""

    world_size: int
    hosts: Mapping[int, str] = field(default_factory=dict)
    injected: tuple[str, ...] = ()
    # User-set thresholds a diagnosis honours (e.g. slow_threshold_pct); absent means the default.
    settings: Mapping[str, Any] = field(default_factory=dict)
    # What the topology probe's facts say the collectives can reach (`expected_busbw` in
    # topology_checks), for the allreduce probe's efficiency; empty when topology did not run.
    expected_busbw: Mapping[str, Any] = field(default_factory=dict)

    def nodes_of(self, ranks: Any) -> tuple[str, ...]:
        return tuple(sorted({self.hosts[r] for r in ranks if r in self.hosts}))

    def whole_nodes(self, ranks: Any) -> tuple[str, ...]:
        """The nodes these ranks are, when they are exactly every rank of some nodes (and not of
        all of them): then the finding is about a node, and says so. Else ()."""
        chosen = set(ranks)
        nodes = self.nodes_of(chosen)
        on = {r for r, h in self.hosts.items() if h in nodes}
        if not nodes or on != chosen or len(nodes) == len(set(self.hosts.values())) or len(chosen) < 2:
            return ()
        return nodes


class Probe(Protocol):
    name: str
    summary: str
    # Builds a DDP model: its rank needs torch._dynamo (seconds of import) before the first deadline.
    trains: bool
    # The dataclass (a core.facts.Facts) one rank's facts read into; its to_json() is the wire format.
    facts_type: type[Facts]

    def collect(self, ctx: "RankContext") -> Mapping[str, Any]:
        """Measure on this rank; returns JSON-able facts."""

    def diagnose(self, facts: Mapping[int, Mapping[str, Any]], run: RunView) -> list[Finding]:
        """All ranks' facts (absent ranks are missing keys) to findings."""


def diagnose_safely(probe: Probe, facts: Mapping[int, Mapping[str, Any]], run: RunView) -> list[Finding]:
    """A probe's findings, or one RUN011 saying its diagnosis failed: a judging bug (or a file with
    facts it did not expect) must never lose the measurements or the other probes' findings."""
    if not facts:
        return []
    try:
        kind = getattr(probe, "facts_type", None)
        typed = facts_by_rank(kind, facts) if kind is not None else facts
        return merge(probe.diagnose(typed, run))
    except Exception as exc:
        return [codes.finding("RUN011", probe.name, f"The {probe.name} diagnosis failed: {type(exc).__name__}: {exc}",
                              evidence={"traceback": traceback.format_exc().splitlines()[-6:]})]
