"""The training callback's judging, on rows as the ranks send them (no processes)."""

from __future__ import annotations

from ddpdoctor.core.findings import Severity
from ddpdoctor.callback.online_checks import History, RankWindow, data_findings, memory_growth, setup_findings


def row(rank: int, fingerprint: int = 0, loader_len: int = 8, stale: bool = False, peak: int = 2**30,
        steps: int = 20, step_ms: float = 3.0) -> RankWindow:
    return RankWindow(rank=rank, host=f"node{rank // 2}", step=40, step_ms=[step_ms] * steps, data_ms=[0.5] * steps,
                      wait_ms=[1.0] * steps, samples=[32.0] * steps, fingerprint=fingerprint or rank + 1,
                      loader_len=loader_len, stale_epoch=stale, peak_mem_bytes=peak)


def test_distinct_batches_equal_lengths_and_set_epoch_give_nothing():
    assert data_findings({r: row(r) for r in range(4)}) == []


def test_the_same_batch_on_every_rank_is_critical_and_names_them_all():
    [finding] = data_findings({r: row(r, fingerprint=0xABC) for r in range(4)})
    assert finding.code == "DOC001" and finding.severity == Severity.CRITICAL
    assert finding.ranks == (0, 1, 2, 3) and finding.nodes == ("node0", "node1")


def test_two_ranks_sharing_a_batch_out_of_four_is_not_the_missing_sampler():
    rows = {r: row(r) for r in range(4)}
    rows[1].fingerprint = rows[0].fingerprint
    assert data_findings(rows) == []


def test_uneven_loader_lengths_name_the_short_ranks():
    rows = {r: row(r, loader_len=8 if r != 3 else 6) for r in range(4)}
    [finding] = data_findings(rows)
    assert finding.code == "DOC002" and finding.ranks == (3,) and "hang" in finding.title
    assert finding.evidence["batches_per_epoch_by_rank"] == {0: 8, 1: 8, 2: 8, 3: 6}


def test_unknown_loader_lengths_are_not_compared():
    rows = {r: row(r, loader_len=-1 if r == 0 else 8) for r in range(3)}
    assert data_findings(rows) == []


def test_a_stale_epoch_is_named_per_rank():
    [finding] = data_findings({r: row(r, stale=r in (0, 1)) for r in range(3)})
    assert finding.code == "DOC003" and finding.ranks == (0, 1) and finding.severity == Severity.WARN


def test_memory_that_keeps_growing_is_named_and_a_plateau_is_not():
    history = History(keep=4)
    for i in range(4):
        history.add({0: row(0, peak=2**30 + i * 200 * 2**20), 1: row(1, peak=2**30 + (i > 0) * 100 * 2**20)})
    [finding] = memory_growth(history)
    assert finding.code == "DOC006" and finding.ranks == (0,)
    assert finding.evidence["peak_mem_bytes_per_check"][-1] > finding.evidence["peak_mem_bytes_per_check"][0]


def test_history_merges_windows_in_the_stragglers_shape_and_keeps_the_last_few():
    history = History(keep=2)
    for step_ms in (3.0, 4.0, 5.0):
        history.add({0: row(0, step_ms=step_ms, steps=10)})
    facts = history.facts()[0]
    assert len(facts["steps"]["step_ms"]) == 20  # two windows kept
    assert facts["steps"]["step_ms"][0] == 4.0 + 0.5  # step plus the data time before it
    assert facts["steps"]["forward_ms"][0] == 4.0 - 1.0  # the in-step work: the step minus the wait


def test_setup_findings():
    assert [f.code for f in setup_findings(False, 4, 0, 0, "h", "DistributedSampler")] == ["DOC004"]
    assert [f.code for f in setup_findings(True, 1, 8, 0, "h", None)] == ["DOC005"]
    assert [f.code for f in setup_findings(True, 4, 0, 0, "h", "RandomSampler")] == ["DOC008"]
    assert setup_findings(True, 4, 4, 0, "h", "DistributedSampler") == []
