"""Probe `topology`: probe (collect), checks (pure: from recorded facts to findings), render
(`nvidia-smi topo -m` per node)."""
