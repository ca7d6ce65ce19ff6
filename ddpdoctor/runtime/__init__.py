"""runtime: what a rank runs on: its context (rank, world, device, store, deadlines), the
out-of-band channel, liveness (heartbeat, stage watchdog), fault injection, the launcher
environment (torchrun, Slurm), and the shared DDP workload with its step timing.

May import: core, measure, judge. The probes build on this room; the drivers that run the
probes (the rank session, the launcher, the reporter) are in session/, above the probes.
"""
