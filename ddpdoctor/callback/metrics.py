"""The callback's numbers out, at every check: to any `on_metrics(dict)` callable and to TensorBoard.

Users watch their runs in TensorBoard or W&B; a straggler is easier to believe as a curve next to
the loss than as a log line. Rank 0 publishes what it already gathered (each rank's window of
steps) and the `stragglers` probe's scores on the kept windows: no extra collective, no extra
timing. A sink that raises is logged once and dropped from nothing: training goes on, and the
sink is tried again at the next check.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable, Mapping, Optional

from ddpdoctor.callback.online_checks import History, RankWindow

log = logging.getLogger("ddpdoctor")
PREFIX = "ddpdoctor"


def window_metrics(rows: Mapping[int, RankWindow], history: Optional[History] = None) -> dict[str, float]:
    """Each rank's median step, wait and data time over the window; the straggler scores when known."""
    out: dict[str, float] = {}
    medians = {}
    for rank, row in sorted(rows.items()):
        for name, values in (("step_ms", row.step_ms), ("wait_ms", row.wait_ms), ("data_ms", row.data_ms)):
            if values:
                out[f"{PREFIX}/{name}/rank{rank}"] = float(statistics.median(values))
        if row.step_ms:
            medians[rank] = statistics.median(row.step_ms)
    if medians and statistics.median(medians.values()) > 0:
        out[f"{PREFIX}/step_ms/max_over_median"] = max(medians.values()) / statistics.median(medians.values())
    if history is not None:
        out.update(_straggler_scores(rows, history))
    return out


def _straggler_scores(rows: Mapping[int, RankWindow], history: History) -> dict[str, float]:
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import score

    facts = history.facts()
    if len(facts) < 2:
        return {}
    scores = score(facts, RunView(world_size=len(rows), hosts={r: row.host for r, row in rows.items()}))
    if scores is None:
        return {}
    return {f"{PREFIX}/straggler_pct/rank{rank}": float(s.score_pct) for rank, s in sorted(scores.ranks.items())}


class MetricsSink:
    """Where the numbers go: `on_metrics(dict)` and/or a TensorBoard writer (or a log folder for one)."""

    def __init__(self, on_metrics: Optional[Callable[[dict[str, Any]], Any]] = None, tensorboard: Any = None) -> None:
        self.on_metrics = on_metrics
        self._tensorboard = tensorboard
        self._writer: Any = None
        self._failed: set[str] = set()

    @property
    def wanted(self) -> bool:
        return self.on_metrics is not None or self._tensorboard is not None

    def writer(self) -> Any:
        """The SummaryWriter: the user's, or one made (lazily: tensorboard is an extra) for a log folder."""
        if self._writer is None and self._tensorboard is not None:
            if isinstance(self._tensorboard, str):
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=self._tensorboard)
            else:
                self._writer = self._tensorboard
        return self._writer

    def publish_window(self, step: int, rows: Mapping[int, RankWindow], history: Optional[History]) -> None:
        """One check's numbers to every sink; a failure of ours or of a sink is logged once, never raised."""
        metrics: dict[str, float] = {}
        self._safely("ddpdoctor's metrics", lambda: metrics.update(window_metrics(rows, history)))
        if metrics:
            self.publish(step, metrics)

    def publish(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.on_metrics is not None:
            self._safely("on_metrics", lambda: self.on_metrics({"step": step, **metrics}))  # type: ignore[misc]
        if self._tensorboard is not None:
            self._safely("tensorboard", lambda: self._to_tensorboard(step, metrics))

    def _to_tensorboard(self, step: int, metrics: Mapping[str, float]) -> None:
        writer = self.writer()
        for tag, value in metrics.items():
            writer.add_scalar(tag, value, global_step=step)

    def _safely(self, sink: str, send: Callable[[], Any]) -> None:
        try:
            send()
        except Exception:  # a broken sink must not break training
            if sink not in self._failed:
                self._failed.add(sink)
                log.exception("ddpdoctor: %s raised; the metrics are dropped and training goes on", sink)
