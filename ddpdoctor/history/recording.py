"""A command's run recorded into the store: the report goes to a private file first, then to the
user's --json path and into the history.

Why a private file: under torchrun or srun every rank runs the command, and only the reporter (rank
0, or the rank that took over) writes the report. A private path per process tells this process
whether it was the reporter (its file exists), so exactly one process records the run, however the
ranks share a filesystem. The user's --json file is written from the same report before the store
is touched: a store that refuses the run (newer schema, corrupt, locked, read-only) costs the
history entry, never the report.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ddpdoctor.core.files import atomic_write_json
from ddpdoctor.core.findings import Finding
from ddpdoctor.history.record import RankTimes, from_callback, from_report
from ddpdoctor.history.store import ENV_VAR, HistoryError, append, check_path


def store_path(flag: Optional[str], environ: Mapping[str, str]) -> Optional[str]:
    """--history, else DDPDOCTOR_HISTORY, else None (an empty variable is unset)."""
    return flag if flag is not None else (environ.get(ENV_VAR) or None)


@dataclass
class Recording:
    store: str
    user_json: Optional[str]  # the user's --json, written from the private report
    force: bool
    folder: str  # private: removed when the run is recorded

    @property
    def report_path(self) -> str:
        return os.path.join(self.folder, "report.json")

    def finish(self) -> Optional[str]:
        """The report to --json, then into the store; why the store refused it (one line), or None."""
        try:
            if not os.path.exists(self.report_path):
                return None  # another rank reported (and records)
            with open(self.report_path, encoding="utf-8") as f:
                report = json.load(f)
            if self.user_json:
                atomic_write_json(report, self.user_json, overwrite=self.force)
            try:
                append(self.store, from_report(report))
            except HistoryError as exc:
                return f"{exc} (the run's report is not lost: it is above{' and in ' + self.user_json if self.user_json else ''})"
            return None
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def begin(store: str, user_json: Optional[str], force: bool) -> Recording:
    """Before the run: a store path that cannot be one is refused now (HistoryError), and the
    private folder (0700) is made; `finish` removes it, or interpreter exit if the run never ends."""
    check_path(store)
    folder = tempfile.mkdtemp(prefix="ddpdoctor-history-")
    atexit.register(shutil.rmtree, folder, True)
    return Recording(store, user_json, force, folder)


# At the end of training a lock held this long is another writer stuck: the job's exit matters more.
CALLBACK_DEADLINE_S = 10.0


def record_callback(store: str, windows: Sequence[Mapping[int, RankTimes]], findings: Sequence[Finding], *,
                    world_size: int, started_at: float) -> bool:
    """The callback's run into the store (rank 0, at close); a refusal is a warning: training goes on."""
    try:
        append(store, from_callback(windows, findings, world_size=world_size, started_at=started_at),
               deadline_s=CALLBACK_DEADLINE_S)
        return True
    except HistoryError as exc:
        logging.getLogger("ddpdoctor").warning("ddpdoctor: this run is not in the history: %s", exc)
    except Exception as exc:  # a bug of ours must not end the user's job
        logging.getLogger("ddpdoctor").warning("ddpdoctor: recording the history failed: %s: %s",
                                               type(exc).__name__, exc)
    return False
