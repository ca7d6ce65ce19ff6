"""render: the terminal. rich is imported here and in the probes' own render modules only.

May import: core, probes (each probe's detail renderer).
"""
