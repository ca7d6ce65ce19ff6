"""Probe `scaling` (`ddpdoctor scaling`): probe, judge (pure: speedup, efficiency, lost time),
render (the table)."""
