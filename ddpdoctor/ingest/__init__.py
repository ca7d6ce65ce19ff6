"""ingest: the outputs users already have (`nvidia-smi -q` and `-q -x`, `nvidia-smi topo -m`,
`nvidia-smi nvlink --status`, nccl-tests, `dcgmi diag`) read into the probes' own typed facts,
so `ddpdoctor diagnose` judges a node it never ran on with the same diagnosis `check` runs.

detect (what kind of output, by content) -> one reader per kind (text in, `ToolOutput` out:
facts per GPU and per probe, and what the output cannot show) -> load (files and folders
grouped by node, each GPU's facts merged across files, rank-numbered like a snapshot).

May import: core, judge, probes (their facts types). Reading only: never builds a Finding.
"""
