"""judge: pure judging shared by several commands: bus bandwidth, the link model, the run
diagnosis (who never arrived, crashed, hung) and the Flight Recorder analysis.

May import: core. Never torch: every function here runs on recorded facts, in unit tests.
"""
