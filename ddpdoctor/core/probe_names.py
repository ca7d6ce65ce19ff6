"""The probes' names, in the registry's order, known below the probes.

Why here: `--inject stage=probe:NAME` is parsed (core/faults.py) where importing the probes, and
with them torch, is not wanted; tests/unit/test_layers.py checks this list is the registry's.
"""

PROBE_NAMES: tuple[str, ...] = ("init-hang", "ddp-smoke", "topology", "gpu-count", "homogeneity", "allreduce",
                                "stragglers", "scaling", "limits")
