"""Probe `gpu-count`: probe (collect, and the judging across nodes), facts (what one rank
publishes, typed), host_checks (pure: one node's ranks against its GPUs)."""
