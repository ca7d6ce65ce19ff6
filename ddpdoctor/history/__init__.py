"""history: every run remembered per node, in a store many nodes append to at once.

`ddpdoctor check`, `allreduce-bench`, `snapshot` and the callback append each run's nodes,
per-GPU (or per-CPU-rank) measurements and findings to a SQLite file (`--history PATH`,
`DDPDOCTOR_HISTORY`); `ddpdoctor history` reads it back to name nodes that drift or fail more
than their peers. What separates a bad node from bad luck is history, and a single run forgets.

- schema.py: the tables, versioned; migrations only ever add (a store is never rewritten in place).
- store.py: appending one run in one transaction (WAL, busy timeout, retries with a deadline)
  and `read_history`, the typed read API the verdicts build on.
- record.py: a run's report JSON (or a snapshot, or the callback's windows) -> rows.

May import: core, plus sqlite3 from the standard library; record.py also judge/busbw.py (pure
formulas: busbw from the sweep's times, computed once, not copied). No torch, no rich: the store
is read where neither is installed, and the report it records is the wire JSON
(docs/report-schema.md). The callback and the top-level commands import it.
"""
