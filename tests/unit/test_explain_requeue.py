"""The requeue verdict of `ddpdoctor explain`: retry, do not retry, or unknown, and its exit codes.

Expected verdicts are written from what each failure is (the fixtures' own truth: the
scenario that was run, the published story, the collectors' `requeue` label), never from
what the rules answer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import pytest

from ddpdoctor import cli
from ddpdoctor.core.codes import CODES, finding
from ddpdoctor.core.exits import (
    EXIT_OK, INJECTED_CRASH_EXIT, ORPHANED_EXIT, REQUEUE_NO_RETRY_EXIT, REQUEUE_RETRY_EXIT, REQUEUE_UNKNOWN_EXIT,
    STAGE_TIMEOUT_EXIT)
from ddpdoctor.core.findings import Finding, Severity
from ddpdoctor.explain.command import explain
from ddpdoctor.explain.diagnosis import Explanation
from ddpdoctor.explain.requeue import NO_RETRY, RETRY, RULES, UNKNOWN, requeue_verdict
from ddpdoctor.explain.texts import CAUSES, EXIT_CRASH, SIGNAL_CRASH
from tests.unit.cli_guard import assert_usage_error, no_launch  # noqa: F401  (autouse fixture)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "explain"
REAL, PUBLISHED, PUBLIC = FIXTURES / "real", FIXTURES / "published", FIXTURES / "public"
DUMPS = {"desync_flight_recorder.log": "fr_desync", "fr_missing_rank.log": "fr_missing_rank",
         "fr_healthy.log": "fr_healthy"}

# What each recorded fault is, for a job script: None where nothing failed.
REAL_FAULT: dict[str, Optional[str]] = {
    "exception": NO_RETRY, "desync": NO_RETRY, "shape_mismatch": NO_RETRY, "dtype_mismatch": NO_RETRY,
    "model_mismatch": NO_RETRY, "unused_parameters": NO_RETRY,
    "port_in_use": RETRY, "rdzv_timeout": RETRY, "missing_rank": RETRY, "connect_refused": RETRY,
    "sigkill": UNKNOWN, "hang": UNKNOWN, "exit_code": UNKNOWN, "silent_exit": UNKNOWN,
    "dataloader_worker_killed": UNKNOWN, "none": None,
}
PUBLISHED_STORY: dict[str, str] = {
    "cuda_oom": NO_RETRY, "illegal_memory_access": NO_RETRY, "device_assert": NO_RETRY, "driver_too_old": NO_RETRY,
    "no_gpu": NO_RETRY, "invalid_device_ordinal": NO_RETRY, "duplicate_gpu": NO_RETRY, "desync": NO_RETRY,
    "dataloader_shm": NO_RETRY, "host_oom_kill": NO_RETRY, "network_interface": NO_RETRY,
    "gpu_ecc": RETRY, "network_link": RETRY, "rendezvous_unreachable": RETRY, "store_unreachable": RETRY,
    "port_in_use": RETRY,
    "sigkill": UNKNOWN, "time_limit": UNKNOWN, "straggler": UNKNOWN, "watchdog_stuck": UNKNOWN, "dataloader_timeout": UNKNOWN,
    "dataloader_worker_killed": UNKNOWN,
}
SCENARIOS: dict[str, dict[str, Any]] = json.loads((REAL / "scenarios.json").read_text())
TRUTH: dict[str, dict[str, Any]] = json.loads((PUBLISHED / "truth.json").read_text())


def _real_inputs(name: str) -> list[str]:
    paths = [str(REAL / name)]
    if name in DUMPS:
        paths.append(str(REAL / DUMPS[name]))
    return paths


def _explanation(*findings: Finding) -> Explanation:
    return Explanation(list(findings), [], [], None)


def _log(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "job.log"
    path.write_text(text)
    return [str(path)]


# -- the fixtures: recorded on CPU ranks, and composed from published messages -----------------

@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_recorded_failure_gets_the_verdict_of_its_fault(name: str) -> None:
    expected = REAL_FAULT[SCENARIOS[name]["fault"]]
    r = explain(_real_inputs(name)).requeue
    if expected is None:
        assert (r.verdict, r.code, r.exit_code) == (UNKNOWN, None, EXIT_OK), (name, r)
    else:
        assert r.verdict == expected, (name, r)


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_each_published_failure_gets_the_verdict_of_its_story(name: str) -> None:
    r = explain([str(PUBLISHED / name)]).requeue
    assert r.verdict == PUBLISHED_STORY[TRUTH[name]["story"]], (name, r)


def test_every_fixture_story_has_a_verdict() -> None:
    assert {s["fault"] for s in SCENARIOS.values()} <= set(REAL_FAULT)
    assert {t["story"] for t in TRUTH.values()} <= set(PUBLISHED_STORY)


def _public_truth() -> list[tuple[Path, str]]:
    cases = []
    for truth_file in sorted(PUBLIC.glob("*/truth.json")):
        for name, entry in json.loads(truth_file.read_text()).items():
            if isinstance(entry, dict) and entry.get("requeue") in (RETRY, NO_RETRY, UNKNOWN):
                cases.append((truth_file.parent / name, entry["requeue"]))
    return cases


def test_public_logs_agree_with_their_requeue_truth_and_never_retry_a_deterministic_failure() -> None:
    """The collectors' real logs from public issues: >= 90% agreement, and no `retry` on a no_retry truth
    (a wrong retry loops a bug on GPUs; a wrong `unknown` only asks a person)."""
    cases = _public_truth()
    if not cases:
        pytest.skip("no tests/fixtures/explain/public/*/truth.json with a `requeue` truth yet")
    mismatches = []
    for path, truth in cases:
        r = explain([str(path)]).requeue
        if r.verdict != truth:
            mismatches.append(f"{path.relative_to(PUBLIC)}: truth {truth}, said {r.verdict} ({r.code}: {r.reason})")
        assert not (truth == NO_RETRY and r.verdict == RETRY), mismatches[-1]
    agreement = 1 - len(mismatches) / len(cases)
    print(f"requeue agreement on {len(cases)} public logs: {agreement:.1%}", *mismatches, sep="\n  ")
    assert agreement >= 0.90, mismatches


# -- composed logs: one rule at a time ---------------------------------------------------------

@pytest.mark.parametrize("text, verdict, code", [
    ("[rank1]: ValueError: bad batch on rank 1\n", NO_RETRY, "RUN003"),
    ("[rank1]: FileNotFoundError: [Errno 2] No such file or directory: '/data/shard-7'\n", NO_RETRY, "RUN003"),
    ("[rank1]: ConnectionRefusedError: [Errno 111] Connection refused\n", RETRY, "RUN003"),
    ("[rank1]: KeyboardInterrupt\n", UNKNOWN, "RUN003"),
    ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n", NO_RETRY, "LOG001"),
    ("slurmstepd: error: *** JOB 77 ON node01 CANCELLED AT 2024-05-01T10:00:00 DUE TO PREEMPTION ***\n",
     RETRY, None),
    ("slurmstepd: error: *** JOB 77 ON node01 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME LIMIT ***\n",
     UNKNOWN, None),
    ("slurmstepd: error: *** STEP 608.0 ON node01 CANCELLED AT 2022-08-12T02:06:12 DUE TO JOB REQUEUE ***\n",
     RETRY, None),
    ("[rank0]: ValueError: host not found: Name or service not known\n", RETRY, "LOG006"),
    ("subprocess.CalledProcessError: Command '['python', 'train.py']' died with <Signals.SIGSEGV: 11>.\n",
     UNKNOWN, None),
    ("slurmstepd: error: *** JOB 77 ON node01 CANCELLED AT 2024-05-01T10:00:00 ***\n", UNKNOWN, None),
])
def test_composed_logs(tmp_path: Path, text: str, verdict: str, code: Optional[str]) -> None:
    r = explain(_log(tmp_path, text)).requeue
    assert r.verdict == verdict, r
    if code is not None:
        assert r.code == code, r
    assert r.exit_code == {RETRY: REQUEUE_RETRY_EXIT, NO_RETRY: REQUEUE_NO_RETRY_EXIT,
                           UNKNOWN: REQUEUE_UNKNOWN_EXIT}[verdict]


# -- composed explanations: the refinements that read a finding's title and evidence -------------

@pytest.mark.parametrize("code, title, verdict", [
    ("LOG012", "Rank 3 (node02) was killed (SIGKILL)", UNKNOWN),
    ("LOG012", "Rank 3 (node02) was killed (SIGKILL) after an oom-kill event", NO_RETRY),
    ("LOG013", "Rank 3 (node02) died of a segmentation fault (SIGSEGV)", UNKNOWN),
    ("LOG014", "Rank 3 (node02) aborted (SIGABRT)", UNKNOWN),
    ("LOG015", "The launcher received SIGHUP and stopped its workers", RETRY),
    ("LOG015", "The launcher received SIGTERM and stopped its workers", UNKNOWN),
    ("LOG015", "The launcher received SIGINT and stopped its workers", UNKNOWN),
    ("LOG008", "Kubernetes killed the container: OOMKilled", NO_RETRY),
    ("LOG008", "The pod was Evicted: the node was low on memory", RETRY),
    ("LOG008", "Slurm ended the job (NODE_FAIL)", RETRY),
    ("LOG009", "CUDA error on rank 5 (node02): uncorrectable ECC error encountered", RETRY),
    ("LOG009", "CUDA error on rank 1: an illegal memory access was encountered", NO_RETRY),
])
def test_refinements_by_title(code: str, title: str, verdict: str) -> None:
    if code not in CODES:
        pytest.skip(f"{code} is not in the catalogue yet")
    r = requeue_verdict(_explanation(finding(code, "explain", title)))
    assert (r.verdict, r.code) == (verdict, code), r


def test_the_first_failure_decides_not_an_info_before_it() -> None:
    ex = _explanation(finding("LOG011", "explain", "dumps agree"), finding("RUN009", "explain", "desync"),
                      finding("LOG005", "explain", "port in use"))
    r = requeue_verdict(ex)
    assert (r.verdict, r.code, r.exit_code) == (NO_RETRY, "RUN009", REQUEUE_NO_RETRY_EXIT)


def test_nothing_failed_exits_zero_and_says_so() -> None:
    r = requeue_verdict(_explanation(finding("LOG000", "explain", "No known failure signature")))
    assert (r.verdict, r.code, r.exit_code) == (UNKNOWN, None, EXIT_OK)
    assert "no failure found" in r.reason


def test_a_code_without_a_rule_gets_the_documented_default() -> None:
    odd = Finding("ZZZ999", Severity.CRITICAL, "a code from a newer catalogue", "explain")
    r = requeue_verdict(_explanation(odd))
    assert (r.verdict, r.code, r.exit_code) == (UNKNOWN, "ZZZ999", REQUEUE_UNKNOWN_EXIT)


# -- the table --------------------------------------------------------------------------------

def _emittable_codes() -> set[str]:
    """Every failure code explain can raise: its LOG codes, the causes' codes, the codes its modules name."""
    codes = {c for c, entry in CODES.items() if entry.family == "explain"}
    codes |= {t.code for t in CAUSES.values()} | {SIGNAL_CRASH.code, EXIT_CRASH.code}
    for source in (ROOT / "ddpdoctor" / "explain").glob("*.py"):
        codes |= set(re.findall(r'finding\(\s*"([A-Z]+\d{3})"', source.read_text()))
    return {c for c in codes if max(CODES[c].severities) >= Severity.WARN}  # INFO never headlines


def test_every_code_explain_can_emit_has_a_default_row_after_its_refinements() -> None:
    for code in sorted(_emittable_codes()):
        rows = [i for i, r in enumerate(RULES) if r.code == code]
        defaults = [i for i in rows if RULES[i].sig is None and RULES[i].when is None]
        assert len(defaults) == 1, f"{code}: needs exactly one row with neither sig nor when, has {len(defaults)}"
        assert defaults[0] == max(rows), f"{code}: rows after its default row can never match"


def test_every_row_names_a_catalogued_code_and_a_known_signature() -> None:
    from ddpdoctor.explain.signatures import BY_ID

    for rule in RULES:
        assert rule.code in CODES, rule
        assert rule.sig is None or rule.sig in BY_ID, rule
        assert rule.verdict in (RETRY, NO_RETRY, UNKNOWN), rule
        if rule.when:
            re.compile(rule.when)


def test_the_exit_codes_are_what_schedulers_act_on() -> None:
    assert 128 <= REQUEUE_RETRY_EXIT <= 255 and REQUEUE_RETRY_EXIT > 128 + 64  # Kubeflow: retryable; no 128+signal
    assert REQUEUE_NO_RETRY_EXIT == 93  # nvidia-resiliency-ext's "do not restart"; Kubeflow: permanent (1-127)
    assert 1 <= REQUEUE_UNKNOWN_EXIT <= 127
    taken = {0, 1, 2, 3, INJECTED_CRASH_EXIT, STAGE_TIMEOUT_EXIT, ORPHANED_EXIT}
    mine = {REQUEUE_RETRY_EXIT, REQUEUE_NO_RETRY_EXIT, REQUEUE_UNKNOWN_EXIT}
    assert len(mine) == 3 and not mine & taken


def test_the_docs_print_every_row() -> None:
    text = (ROOT / "docs" / "explain.md").read_text()
    section = text.split("## Requeue verdict and exit codes", 1)[1].split("\n## ", 1)[0]
    for rule in RULES:
        assert rule.why in section, f"docs/explain.md misses the row {rule.code}: {rule.why}"
    for code in (REQUEUE_RETRY_EXIT, REQUEUE_NO_RETRY_EXIT, REQUEUE_UNKNOWN_EXIT):
        assert f"| {code} |" in section


# -- the command line ---------------------------------------------------------------------------

def test_requeue_exit_codes_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "why.json"
    no_retry = str(PUBLISHED / "cuda_oom_rank2.log")
    assert cli.main(["explain", no_retry, "--exit-code", "requeue", "--json", str(out)]) == REQUEUE_NO_RETRY_EXIT
    screen = capsys.readouterr().out
    assert "Requeue: do not retry: a CUDA out-of-memory error" in " ".join(screen.split())
    data = json.loads(out.read_text())
    assert data["requeue"] == {"verdict": NO_RETRY, "reason": data["requeue"]["reason"], "code": "LOG001",
                               "exit_code": REQUEUE_NO_RETRY_EXIT}
    assert data["exit_code"] == 2  # the default verdict's code is unchanged in the JSON
    assert cli.main(["explain", str(REAL / "port_in_use.log"), "--exit-code", "requeue"]) == REQUEUE_RETRY_EXIT
    assert cli.main(["explain", str(REAL / "sigkill_rank2.log"), "--exit-code", "requeue"]) == REQUEUE_UNKNOWN_EXIT
    assert cli.main(["explain", str(REAL / "healthy.log"), "--exit-code", "requeue"]) == EXIT_OK
    assert cli.main(["explain", no_retry]) == 2  # without the flag, the verdict as before
    capsys.readouterr()


def test_a_bad_exit_code_mode_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(capsys, ["explain", str(REAL / "healthy.log"), "--exit-code", "retry"],
                       ["--exit-code", "requeue"])
