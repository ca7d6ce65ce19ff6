"""End to end on real gloo CPU ranks: `ddpdoctor scaling`, and `--model` in `check`.

The efficiency in the report is recomputed here from the ranks' own step medians; a rank
slowed by injection (its forward and backward really take 3x) lowers it and is named.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .harness import assert_nothing_left, free_port, probe_section, run_check, run_command

pytestmark = pytest.mark.ranks
TINY = str(Path(__file__).resolve().parent / "tiny_model.py")
sys.path.insert(0, str(Path(TINY).parent))
import tiny_model  # noqa: E402


def scaling(tmp_path: Path, *args: str):
    cmd = [sys.executable, "-m", "ddpdoctor", "scaling", "--no-live", "--json", str(tmp_path / "s.json"),
           "--port", str(free_port()), *args]
    return run_command(cmd, tmp_path, report_name="s.json", timeout_s=120)


def test_scaling_of_the_users_model_is_computed_from_the_ranks_steps(tmp_path):
    run = scaling(tmp_path, "--nproc", "2", "--seconds", "0.4", "--lr", "0.1",
                  "--model", f"{TINY}:make_model", "--batch", f"{TINY}:make_batch")
    assert run.returncode in (0, 1), run.explain()
    facts = probe_section(run.report, "scaling")["facts"]
    assert {f["parameters"] for f in facts.values()} == {tiny_model.parameter_count()}  # the user's model trained
    assert sorted(facts["0"]["sizes"]) == ["1", "2"] and sorted(facts["1"]["sizes"]) == ["2"]
    # samples/s at n = n x batch / the slowest rank's median step; efficiency = speedup / n.
    one = facts["0"]["sizes"]["1"]["step_ms"]
    two = max(facts[r]["sizes"]["2"]["step_ms"] for r in ("0", "1"))
    expected = 100.0 * (2 * 32 / two) / (32 / one) / 2
    [verdict] = [f for f in run.findings() if f["code"] in ("SCL000", "SCL001")]
    assert f"{expected:.0f}%" in verdict["title"], (expected, verdict["title"])
    codes = {f["code"]: f for f in run.findings()}
    assert "defaults (bucket_cap_mb=25)" in codes["SCL002"]["evidence"]["ms_per_batch"]
    assert codes["SCL003"]["evidence"]["linear_rule_lr"] == 0.2
    assert "samples/s" in run.stdout and "efficiency" in run.stdout
    assert_nothing_left(run)


def test_a_slow_rank_lowers_the_efficiency_and_is_named(tmp_path):
    run = scaling(tmp_path, "--nproc", "2", "--seconds", "0.4", "--no-knobs", "--inject", "slow:rank=1:factor=3")
    assert run.returncode == 1, run.explain()
    [finding] = run.findings("SCL001")
    assert finding["ranks"] == [1] and "rank 1 is a straggler" in finding["title"], finding["title"]
    worst = finding["evidence"]["at_worst_size"]
    assert worst["efficiency_pct"] < 60 and worst["loss_ms"]["straggler"] > worst["loss_ms"]["comm"]
    assert_nothing_left(run)


def test_check_trains_the_users_model(tmp_path):
    run = run_check(tmp_path, "--nproc", "2", "--probes", "ddp-smoke",
                    "--model", f"{TINY}:make_model", "--batch", f"{TINY}:make_batch")
    assert run.returncode == 0, run.explain()
    facts = probe_section(run.report, "ddp-smoke")["facts"]
    assert {f["parameters"] for f in facts.values()} == {tiny_model.parameter_count()}
    assert len({f["param_sha256"] for f in facts.values()}) == 1
