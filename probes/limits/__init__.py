"""Probe `limits`: the limits of each rank's own container and node, against what the job needs."""
