"""Probe `allreduce` and `ddpdoctor allreduce-bench`: probe (collect, gather, diagnose), render
(the nccl-tests-style table), outputs (CSV and plot files)."""
