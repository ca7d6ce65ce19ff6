"""runtime: how ranks come to exist and live: the launcher, the rank session with its stages and
deadlines, the out-of-band channel, liveness, fault injection, and the shared DDP workload.

May import: core, measure, judge. The probes and rendering are imported only by the rank
session and the launcher, which drive them (see docs/architecture.md, "Layers").
"""
