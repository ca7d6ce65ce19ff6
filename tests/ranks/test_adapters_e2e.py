"""Each framework ddpdoctor adapts to, in real fits on 2 CPU ranks with faults made as the world makes them
(tests/ranks/adapter_fit.py): Lightning through `lightning_callback`, the Hugging Face Trainer through
`hf_callback`, and Accelerate used directly (`Accelerator.prepare` and a plain loop, `Doctor` given what
prepare returned). One job per framework runs the scenarios one after the other (the frameworks' imports
cost seconds): a healthy fit that must stay quiet, a rank whose dataset is slow, a busy process on a
rank's core, an unsharded loader, a rank whose loss goes NaN, and last a rank deadlocked in a step.

How often each is right over repeated runs: benchmarks/adapters_detection.py (docs/callback.md).
Skipped, with the reason, where a framework is not installed (`pip install -e ".[adapters]"`, as .ci/run does).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .adapter_fit import NAN_FROM, SCENARIOS, steps, wrong
from .harness import free_port, run_script_ranks

pytestmark = [pytest.mark.ranks, pytest.mark.adapters]
FIT = Path(__file__).with_name("adapter_fit.py")
MODULE = {"lightning": "lightning", "hf": "transformers", "accelerate": "accelerate"}
TIMED = {"lightning": "_broadcast_sigterm_tensor", "hf": "_get_num_items_in_batch", "accelerate": None}


def job(tmp_path: Path, framework: str, scenarios: tuple[str, ...], timeout_s: float) -> list[tuple[int, str]]:
    pytest.importorskip(MODULE[framework], reason=f"{MODULE[framework]} is not installed (pip install -e '.[adapters]')")
    port = free_port()
    return run_script_ranks(FIT, [framework, "--json", str(tmp_path / framework), "--scenarios", ",".join(scenarios)],
                            {0: port, 1: port}, timeout_s=timeout_s, cwd=tmp_path)


def report(tmp_path: Path, framework: str, scenario: str) -> list[dict]:
    return json.loads((tmp_path / f"{framework}.{scenario}.json").read_text())["findings"]


def assert_named(tmp_path: Path, framework: str, scenarios: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    """Each scenario right (adapter_fit.wrong: its fault first, its rank and cause, nothing else loud), both
    ranks through every step, and what each framework must not be blamed for."""
    found = {s: report(tmp_path, framework, s) for s in scenarios}
    verdicts = {s: wrong(s, found[s]) for s in scenarios}
    assert verdicts == {s: "" for s in scenarios}, explained(tmp_path, framework, verdicts, found)
    for s in scenarios:
        summaries = [json.loads((tmp_path / f"{framework}.{s}.json.summary{r}").read_text()) for r in range(2)]
        assert all(x["steps"] == steps(s) and x["comm_measured"] for x in summaries), (s, summaries)
        # The framework's collective between steps, timed as waiting (adapters.time_as_waiting), on this version.
        assert all(x["timed_between"] == TIMED[framework] for x in summaries), (s, summaries)
        # The end of the run through the framework's train end: the run summary, its verdict the fault's (issue 53).
        end = json.loads((tmp_path / f"{framework}.{s}.json").read_text())["summary"]
        loud = [f["code"] for f in found[s] if f["severity"] in ("warn", "critical")]
        assert end["steps"] == steps(s) and end["final_check"]["missing"] == [], (s, end)
        assert end["code"] == (loud[0] if loud else None) and [r["steps"] for r in end["ranks"]] == [steps(s)] * 2, end
    codes = {s: {f["code"]: f for f in found[s]} for s in scenarios}
    healthy = codes["healthy"]
    assert "DOC008" not in healthy and "DOC004" not in healthy  # each framework shards and wraps: no false alarm
    # The optimizer the framework built, and 2 ranks x 32 (Hugging Face: from its arguments).
    scaling = healthy["DOC010"]["evidence"]
    assert scaling["effective_batch"] == 64 and scaling["learning_rates"] == ([5e-5] if framework == "hf" else [0.01])
    assert "DOC008" in codes["nosampler"]  # and the loader's sampler said why
    if "hog" in codes:
        assert "ddpdoctor-hog" in codes["hog"]["STR001"]["title"], codes["hog"]["STR001"]
    if "nan" in codes:
        first = codes["nan"]["DOC018"]["evidence"]["first_nonfinite_step"]
        assert first["1"] == NAN_FROM + 1 and first["0"] > NAN_FROM + 1, first  # rank 0 only after
    return codes


def explained(tmp_path: Path, framework: str, verdicts: dict[str, str], found: dict[str, list[dict]]) -> str:
    """What a wrong scenario said, whole (a string: pytest shortens a dict given as the message, and CI shows only
    this): its findings above information with their evidence, and each rank's windows as rank 0 kept them
    (step, wait and data medians in ms; run delay and CPU share in %), so a false alarm in CI can be read."""
    out = []
    for s, why in verdicts.items():
        if not why:
            continue
        loud = [f for f in found[s] if f["severity"] in ("warn", "critical")]
        out.append(f"--- {s}: {why}\n" + json.dumps(loud, indent=1, default=str))
        summary = tmp_path / f"{framework}.{s}.json.summary0"
        if summary.exists():
            out.append("rank 0's windows: " + json.dumps(json.loads(summary.read_text()).get("seen")))
    return "\n".join(out)


def assert_hang_named(tmp_path: Path, framework: str, results: list[tuple[int, str]]) -> None:
    """Rank 1 blocks on a lock it holds inside a step's forward (`on_hang="exit"`, a 3 s deadline): one verdict
    names it, stuck in its own code at its line, and rank 0 as the rank that only waited; both leave."""
    assert [rc for rc, _ in results] == [123, 124], [err[-3000:] for _, err in results]  # the victim, the culprit
    hang = {f["code"]: f for f in report(tmp_path, framework, "hang")}["DOC007"]
    evidence = hang["evidence"]
    assert hang["ranks"] == [1] and evidence["cause_by_rank"] == {"1": "own code"}, hang
    assert list(evidence["affected_ranks"]) == ["0"], hang
    assert re.search(r"adapter_fit\.py:\d+ in misbehave", evidence["user_frame_by_rank"]["1"]), evidence
    assert "lock.acquire()" in "\n".join(evidence["python_stack_rank_1"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_each_fault_is_named_through_the_adapter_and_a_healthy_fit_stays_quiet(tmp_path, framework):
    """Hugging Face also runs `lossout`: the Trainer computes the loss outside the model, which the adapter
    cannot see, and the report says so (DOC020) instead of staying silent about NaNs it could not watch."""
    extra = ("lossout",) if framework == "hf" else ()
    results = job(tmp_path, framework, extra + SCENARIOS + ("hang",), timeout_s=240)
    assert_named(tmp_path, framework, SCENARIOS + extra)
    assert_hang_named(tmp_path, framework, results)
    if extra:
        unseen = {f["code"]: f for f in report(tmp_path, framework, "lossout")}
        assert "DOC020" in unseen and unseen["DOC020"]["severity"] == "info", unseen
        assert "DOC020" not in {f["code"] for f in report(tmp_path, framework, "healthy")}  # seen there


def test_accelerate_s_sharding_is_seen_and_a_loader_not_prepared_is_named(tmp_path):
    """Accelerate's own pieces: its DataLoaderShard counts as sharding (a healthy fit is quiet, no DOC008), and a
    loader not passed to `Accelerator.prepare` reads the same batches on every rank (DOC001). The rest of a
    Doctor under Accelerate is the plain callback's (the full set: the slow tier's twin below)."""
    results = job(tmp_path, "accelerate", ("healthy", "nosampler"), timeout_s=120)
    assert [rc for rc, _ in results] == [0, 0], [err[-3000:] for _, err in results]
    assert_named(tmp_path, "accelerate", ("healthy", "nosampler"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_fault_is_named_under_accelerate_used_directly(tmp_path):
    """Default twin: tests/ranks/test_adapters_e2e.py::test_accelerate_s_sharding_is_seen_and_a_loader_not_prepared_is_named
    (Accelerate's own sharding both ways); the other faults cross the plain Doctor's paths, each in the default
    tier under Lightning and the Trainer above."""
    results = job(tmp_path, "accelerate", SCENARIOS + ("hang",), timeout_s=240)
    assert_named(tmp_path, "accelerate", SCENARIOS)
    assert_hang_named(tmp_path, "accelerate", results)
