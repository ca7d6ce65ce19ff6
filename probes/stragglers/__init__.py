"""Probe `stragglers`: probe (collect, gather), scores (pure: from per-step series to scores,
causes and findings), render (the per-rank table)."""
