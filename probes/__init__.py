"""The probe registry. Installed as `ddpdoctor.probes` (see pyproject's package-dir)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from ddpdoctor.core.errors import UsageError

from ddpdoctor.probes.allreduce.probe import AllReduce
from ddpdoctor.probes.base import Probe, RunView
from ddpdoctor.probes.ddp_smoke import DdpSmoke
from ddpdoctor.probes.scaling.probe import Scaling
from ddpdoctor.probes.gpu_count.probe import GpuCount
from ddpdoctor.probes.homogeneity.probe import Homogeneity
from ddpdoctor.probes.init_hang import InitHang
from ddpdoctor.probes.limits.probe import Limits
from ddpdoctor.probes.stragglers.probe import Stragglers
from ddpdoctor.probes.topology.probe import Topology

_PROBES: dict[str, Probe] = {p.name: p for p in (InitHang(), DdpSmoke(), Topology(), GpuCount(), Homogeneity(),
                                                  AllReduce(), Stragglers(), Scaling(), Limits())}
# init-hang first: its facts are read before the rendezvous, and its stage only adds timings.
# limits next: reads only (a few ms), and a limit that breaks the workload (a small /dev/shm,
# ulimit -n) must be in the report when the workload fails.
# topology next: it is quick, needs no training, and a link fault it finds may be what makes
# the workload fail or crawl, so it must be in the report when the workload hangs.
# gpu-count next: it publishes its device facts before the shared DDP workload runs (in its
# collect), so a device-mapping fault that breaks the workload is still diagnosed.
DEFAULT_PROBES: tuple[str, ...] = ("init-hang", "limits", "topology", "gpu-count", "homogeneity", "ddp-smoke")


def with_context(view: RunView, facts_by_probe: Mapping[str, Mapping[Any, Any]]) -> RunView:
    """The run view, plus what one probe's facts tell another's diagnosis: the bandwidth the
    topology allows, for allreduce's efficiency. A failure here costs only that context."""
    topology = facts_by_probe.get("topology")
    if not topology or "allreduce" not in facts_by_probe:
        return view
    from ddpdoctor.probes.topology.checks import expected_busbw

    try:
        return replace(view, expected_busbw=expected_busbw(topology, view))
    except Exception as exc:  # the topology probe's own diagnosis reports bad facts
        return replace(view, expected_busbw={"gbps": None, "why": f"topology facts unreadable ({type(exc).__name__})"})


def all_probes() -> dict[str, Probe]:
    return dict(_PROBES)


def get_probe(name: str) -> Probe:
    return _PROBES[name]


def select(spec: str | None) -> tuple[str, ...]:
    """`--probes a,b` → validated names, in the order given."""
    if spec is None or spec.strip() in ("", "default"):
        return DEFAULT_PROBES
    if spec.strip() == "all":
        return tuple(_PROBES)
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in _PROBES]
    if unknown:
        raise UsageError(f"unknown probe {unknown[0]!r}: choose from {', '.join(_PROBES)} (see `ddpdoctor probes`)")
    return names


__all__ = ["Probe", "RunView", "all_probes", "get_probe", "select", "with_context", "DEFAULT_PROBES"]
