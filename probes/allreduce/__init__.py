"""Probe `allreduce` and `ddpdoctor allreduce-bench`: probe (collect, gather, diagnose), facts (the
typed facts), localise (pure: which ring pair, node or path is slow), render (the nccl-tests-style
table), outputs (CSV and plot files)."""
