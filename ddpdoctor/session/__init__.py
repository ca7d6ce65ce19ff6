"""session: the drivers of a run: a rank's whole life (rank.py: rendezvous, init, the probes,
the report, each a stage with a deadline), the standalone launcher of local ranks (launcher.py),
and the diagnose step that turns what the run learned into the report (reporter.py).

May import: every room below it (core, measure, judge, runtime, probes, render). It sits above
the probes because it runs them; the probes use runtime/, never session/.
"""
