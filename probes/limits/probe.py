"""Probe `limits`: the limits of each rank's own container and node, read before the job.

Why a probe of `check`: the failures users hit most in containers and on clusters come from the
rank's environment, not its GPUs: a 64 MB /dev/shm, `ulimit -n`, a pids or memory cgroup, a
locked-memory limit under InfiniBand. Collect reads them from inside each rank
(measure/limits.py: files, getrlimit and statvfs, a few ms, no subprocess) before the shared
DDP workload, so a limit that then breaks the workload is already in the report; diagnose
(judge.py) holds them against what this job needs, per node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from ddpdoctor.core.facts import facts_by_rank
from ddpdoctor.core.findings import Finding
from ddpdoctor.measure.limits import LimitsFacts, read_limits

from ddpdoctor.probes.base import RunView
from ddpdoctor.probes.limits.judge import NAME, judge

if TYPE_CHECKING:
    from ddpdoctor.runtime.context import RankContext


class Limits:
    name = NAME
    trains = False
    summary = ("Each rank's own limits against what the job needs: /dev/shm, open files, locked memory (with "
               "RDMA), pids and threads, the cgroup's memory and CPU quota, NCCL's environment, free disk.")
    facts_type = LimitsFacts

    # -- collect (on each rank) -------------------------------------------------
    def collect(self, ctx: RankContext) -> dict[str, Any]:
        facts = read_limits(ctx.cfg.json_path)
        host_of = {r: (h.machine or h.host) for r, h in ctx.hellos.items()}
        mine = host_of.get(ctx.rank)
        facts.host, facts.rank, facts.local_rank = ctx.env.hostname, ctx.rank, ctx.env.local_rank
        facts.local_world_size, facts.world_size = ctx.env.local_world_size, ctx.world_size
        # The GPUs the job will use on this node: NCCL's transports then run, whatever backend check chose.
        facts.gpus = max((int(h.cuda_devices or 0) for r, h in ctx.hellos.items() if host_of.get(r) == mine),
                         default=0)
        facts.backend = ctx.backend or None
        return facts.to_json()

    # -- diagnose (pure) --------------------------------------------------------
    def diagnose(self, facts: Mapping[int, LimitsFacts], run: RunView) -> list[Finding]:
        return judge(facts_by_rank(LimitsFacts, facts), run)


def job_findings(rank: int, world_size: int, host: str, gpus: int, loader: Any = None) -> list[Finding]:
    """The training callback's pre-flight (ddpdoctor.Doctor, at construction): this rank's limits
    with the job's own DataLoader (its num_workers; the batch's bytes are not known before the
    first batch, so the assumed batch), judged as its node's (its ranks from LOCAL_WORLD_SIZE).
    Everything but the all-clear: a job that is fine hears nothing."""
    import os

    facts = read_limits(None)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    facts.host, facts.rank, facts.world_size, facts.gpus = host, rank, world_size, gpus
    local_rank = os.environ.get("LOCAL_RANK", "")
    facts.local_rank = int(local_rank) if local_rank.isdigit() else 0
    facts.local_world_size = int(local) if local.isdigit() else 1
    workers = getattr(loader, "num_workers", None)
    facts.loader_workers = int(workers) if isinstance(workers, int) else None
    found = judge({rank: facts}, RunView(world_size=world_size, hosts={rank: host}))
    return [f for f in found if f.code != "LIM000"]
