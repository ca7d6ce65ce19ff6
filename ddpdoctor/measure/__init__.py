"""measure: every reading of hardware, host and network, and every timing a rank takes.

May import: core. Reading only: nothing here builds a Finding; what a reading means is the
probes' and judge's business, so the same reading can be recorded in a snapshot and judged later.
pynvml is imported only by measure/nvml.py.
"""
