"""Probe `homogeneity`: probe (collect, diagnose), health (GPU health and host sizing), speed
(the slow rank from measured throughput)."""
