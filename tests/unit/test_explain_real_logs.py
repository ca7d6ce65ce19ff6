"""`ddpdoctor explain` on logs recorded here by really running each failure on CPU ranks.

The expected culprit comes from tests/fixtures/explain/real/scenarios.json, written by
the generator from what it made each rank do, never from reading the logs. The expected
code per kind of fault is the diagnosis this project promises for it (docs/explain.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.explain.command import explain
from ddpdoctor.core.findings import Severity

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "explain" / "real"
SCENARIOS: dict[str, dict[str, Any]] = json.loads((REAL / "scenarios.json").read_text())

# fault -> (code, how the finding's ranks relate to the culprits)
#   "exact": the finding names exactly the culprit ranks
#   "includes": it names them among others (two ranks in a tie, or a message that cannot say whose)
#   "none": the failure is not tied to a rank (the launcher's store, the rendezvous)
EXPECTED: dict[str, tuple[str, str]] = {
    "exception": ("RUN003", "exact"),
    "sigkill": ("LOG012", "exact"),
    "hang": ("RUN004", "exact"),
    "desync": ("RUN009", "exact"),
    "dtype_mismatch": ("RUN009", "includes"),
    "shape_mismatch": ("RUN009", "includes"),
    "missing_rank": ("RUN001", "none"),
    "port_in_use": ("LOG005", "none"),
    "connect_refused": ("LOG006", "none"),
    "rdzv_timeout": ("RUN001", "none"),
    "dataloader_worker_killed": ("LOG002", "exact"),
    "unused_parameters": ("LOG003", "includes"),
    "model_mismatch": ("LOG004", "includes"),
    "exit_code": ("RUN002", "exact"),
    "silent_exit": ("RUN002", "exact"),
}
# A log whose dumps sit in a folder beside it is explained with them, as a user would pass both.
DUMPS = {"desync_flight_recorder.log": "fr_desync", "fr_missing_rank.log": "fr_missing_rank",
         "fr_healthy.log": "fr_healthy"}


def _inputs(name: str) -> list[str]:
    paths = [str(REAL / name)]
    if name in DUMPS and (REAL / DUMPS[name]).is_dir():
        paths.append(str(REAL / DUMPS[name]))
    return paths


def _failing() -> list[str]:
    return sorted(n for n, s in SCENARIOS.items() if s["fault"] in EXPECTED)


@pytest.mark.parametrize("name", _failing())
def test_each_recorded_failure_is_explained_with_its_culprit(name: str) -> None:
    truth = SCENARIOS[name]
    code, relation = EXPECTED[truth["fault"]]
    run = explain(_inputs(name))
    critical = [f for f in run.explanation.findings if f.severity == Severity.CRITICAL]
    assert critical, [f.title for f in run.explanation.findings]
    first = critical[0]
    assert first.code == code, (name, [(f.code, f.title) for f in critical])
    culprits = set(truth["culprit_ranks"])
    if relation == "exact":
        assert set(first.ranks) == culprits, (name, first.title, first.ranks)
    elif relation == "includes":
        assert culprits <= set(first.ranks), (name, first.title, first.ranks)
    assert run.exit_code == 2


@pytest.mark.parametrize("name", ["desync_detail.log", "shape_mismatch_detail.log", "dtype_mismatch_detail.log"])
def test_the_rank_that_raised_a_mismatch_is_not_blamed_again_for_its_exit(name: str) -> None:
    # The rank's RuntimeError is the mismatch; torchrun's exit code for it is not a second cause.
    run = explain(_inputs(name))
    assert [f.code for f in run.explanation.findings if f.severity == Severity.CRITICAL] == ["RUN009"], \
        [(f.code, f.title) for f in run.explanation.findings]


def test_every_recorded_scenario_has_an_expectation() -> None:
    """A new scenario in the generator must come with the diagnosis it should get."""
    unknown = {s["fault"] for s in SCENARIOS.values()} - set(EXPECTED) - {"none"}
    assert not unknown


@pytest.mark.parametrize("name", sorted(n for n, s in SCENARIOS.items() if s["fault"] == "none"))
def test_healthy_runs_give_no_alarm(name: str) -> None:
    run = explain(_inputs(name))
    assert run.exit_code == 0, [(f.code, f.title) for f in run.explanation.findings]
    assert all(f.severity <= Severity.INFO for f in run.explanation.findings)


def test_the_flight_recorder_names_the_rank_that_called_another_collective() -> None:
    run = explain(_inputs("desync_flight_recorder.log"))
    desync = [f for f in run.explanation.findings if f.code == "RUN009"]
    assert desync and desync[0].ranks == (2,)
    by_rank = desync[0].evidence["collective_by_rank"]
    assert "all_gather" in by_rank["2"] and "all_reduce" in by_rank["0"]


def test_without_its_dumps_the_same_desync_is_not_pinned_on_a_rank() -> None:
    """Every rank only timed out: the log alone cannot say who is apart, and must not guess."""
    run = explain([str(REAL / "desync_flight_recorder.log")])
    first = run.explanation.findings[0]
    assert first.code == "RUN008"
    assert set(first.ranks) == {0, 1, 2}


def test_the_flight_recorder_names_a_rank_that_stopped_issuing_collectives() -> None:
    run = explain([str(REAL / DUMPS["fr_missing_rank.log"])])
    missing = [f for f in run.explanation.findings if f.code == "RUN004"]
    assert missing and missing[0].ranks == (2,)
    assert "#5" in missing[0].title


def test_healthy_dumps_say_they_agree() -> None:
    run = explain([str(REAL / "fr_healthy")])
    (agree,) = run.explanation.findings
    assert agree.code == "LOG011" and agree.ranks == (0, 1, 2)
    assert run.notes == []  # the pickle and JSON dump of one rank are the same dump


def test_a_hang_is_pinned_on_the_silent_rank_not_on_torchruns_root_cause() -> None:
    """torchrun's 'Root Cause' names the first rank to exit, which after a hang is a waiting one."""
    run = explain([str(REAL / "hang_rank1_timeout.log")])
    first = run.explanation.findings[0]
    assert first.ranks == (1,)
    assert "torchrun_root_cause" in first.evidence
    assert "rank 0" in first.evidence["torchrun_root_cause"]


def test_gzip_and_plain_give_the_same_findings() -> None:
    plain = explain([str(REAL / "exception_rank1.log")])
    packed = explain([str(REAL / "exception_rank1.log.gz")])
    assert [(f.code, f.ranks, f.title) for f in plain.explanation.findings] == \
           [(f.code, f.ranks, f.title) for f in packed.explanation.findings]


def test_victims_are_listed_under_the_cause() -> None:
    run = explain([str(REAL / "sigkill_rank2.log")])
    first = run.explanation.findings[0]
    assert set(first.evidence["affected_ranks"]) == {"0", "1"}
    assert "SIGKILL" in first.title
