"""The history store's tables, versioned: a store is migrated forward, never rewritten in place.

Version N's statements turn a version N-1 store into a version N store; a fresh store runs them
all. A migration may only add (tables, columns, indexes): nothing already stored is dropped or
changed, so a store written by an older ddpdoctor keeps every row. A store whose version is
newer than this code knows is refused for writing (its readers might rely on columns we would
leave empty) and read only through the columns named here.

The names are an interface: `ddpdoctor history` (history/verdicts.py) reads them, and so may a
fleet's own SQL. Add, never rename.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
VERSION_KEY = "schema_version"

# version -> the statements that bring a store from the version before to it.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
        # started_at: unix seconds. command: check | allreduce-bench | snapshot | callback.
        "CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, started_at REAL, command TEXT, verdict TEXT, "
        "exit_code INTEGER, world_size INTEGER, ddpdoctor_version TEXT, label TEXT NULL)",
        # ranks as rank_ranges writes them: '0-3,8'.
        "CREATE TABLE IF NOT EXISTS run_nodes (run_id TEXT, node TEXT, ranks TEXT)",
        # gpu: the uuid, or the index where none; model: the GPU's, or 'cpu' / the CPU model on CPU ranks.
        "CREATE TABLE IF NOT EXISTS measurements (run_id TEXT, node TEXT, rank INTEGER NULL, gpu TEXT NULL, "
        "model TEXT NULL, metric TEXT, value REAL, unit TEXT)",
        # one row per (finding, rank), or per (finding, node) where the finding names nodes only.
        "CREATE TABLE IF NOT EXISTS findings (run_id TEXT, code TEXT, severity TEXT, node TEXT NULL, "
        "rank INTEGER NULL, title TEXT)",
        "CREATE INDEX IF NOT EXISTS runs_started ON runs (started_at)",
        "CREATE INDEX IF NOT EXISTS run_nodes_node ON run_nodes (node, run_id)",
        "CREATE INDEX IF NOT EXISTS measurements_node ON measurements (node, metric)",
        "CREATE INDEX IF NOT EXISTS findings_node ON findings (node, code)",
    ),
}

# The columns each table had at version 1, in order: what the read API selects (a newer store
# may have more; they are not read).
COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id", "started_at", "command", "verdict", "exit_code", "world_size", "ddpdoctor_version", "label"),
    "run_nodes": ("run_id", "node", "ranks"),
    "measurements": ("run_id", "node", "rank", "gpu", "model", "metric", "value", "unit"),
    "findings": ("run_id", "code", "severity", "node", "rank", "title"),
}
