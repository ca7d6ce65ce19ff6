"""The Lightning and Hugging Face adapters in a real short fit on 2 CPU ranks (tests/ranks/adapter_fit.py).

Rank 1 really computes slower; the adapter's Doctor must measure the job's own steps and name it.
Skipped, with the reason, where the frameworks are not installed (`pip install -e ".[adapters]"`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .harness import free_port, run_script_ranks

pytestmark = pytest.mark.ranks
FIT = Path(__file__).with_name("adapter_fit.py")


def fit(tmp_path: Path, framework: str, fault: str = "ADAPTER_SLOW") -> tuple[list, dict]:
    report = tmp_path / f"{framework}.json"
    port = free_port()
    results = run_script_ranks(FIT, [framework, "--json", str(report)], {0: port, 1: port}, timeout_s=120,
                               extra_env={fault: "1"}, cwd=tmp_path)
    assert [rc for rc, _ in results] == [0, 0], [e for _, e in results]
    summaries = {r: json.loads(Path(f"{report}.summary{r}").read_text()) for r in range(2)}
    return json.loads(report.read_text())["findings"], summaries


@pytest.mark.parametrize("framework, module", [("lightning", "lightning"), ("hf", "transformers")])
def test_the_adapter_watches_a_real_fit_and_names_the_slow_rank(tmp_path, framework, module):
    pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[adapters]')")
    findings, summaries = fit(tmp_path, framework)
    assert all(s["steps"] == 110 and s["comm_measured"] for s in summaries.values()), summaries
    codes = {f["code"]: f for f in findings}
    assert codes["STR001"]["ranks"] == [1] and codes["STR001"]["evidence"]["cause"] == "compute", findings
    assert "DOC008" not in codes and "DOC004" not in codes  # the frameworks shard and wrap: no false alarm
    # The optimizer the framework built, and 2 ranks x 32 (Hugging Face: from its arguments, batches are not passed).
    scaling = codes["DOC010"]["evidence"]
    assert scaling["effective_batch"] == 64 and scaling["learning_rates"] == ([0.01] if framework == "lightning"
                                                                              else [5e-5]), scaling


def test_the_lightning_adapter_passes_the_loss_and_names_the_rank_whose_loss_went_nan_first(tmp_path):
    """training_step's loss reaches the callback (on_train_batch_end's outputs): rank 1's batches turn NaN from
    its 51st step, and DOC018 names rank 1 at step 51; rank 0's loss follows at the next step (the averaged
    gradient), as in the plain loop (tests/ranks/test_divergence_e2e.py)."""
    pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[adapters]')")
    findings, _ = fit(tmp_path, "lightning", fault="ADAPTER_NAN")
    codes = {f["code"]: f for f in findings}
    loss = codes["DOC018"]
    assert loss["ranks"] == [1] and loss["evidence"]["first_nonfinite_step"] == {"0": 52, "1": 51}, loss
    assert [f["code"] for f in findings][0] == "DOC018", findings


def test_the_hf_adapter_names_a_rank_whose_dataset_is_slow_with_data_loading_as_its_cause(tmp_path):
    """Issue 42: rank 1's dataset takes 4 ms a sample (the Trainer's own DataLoader, no workers); the Trainer
    never passes batches to callbacks, but the time between its on_step_end and on_step_begin is the loader's."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[adapters]')")
    findings, summaries = fit(tmp_path, "hf", fault="ADAPTER_SLOWDATA")
    codes = {f["code"]: f for f in findings}
    assert codes["STR001"]["ranks"] == [1] and codes["STR001"]["evidence"]["cause"] == "data loading", findings
    assert [f["code"] for f in findings][0] == "STR001", findings
    assert all(s["replicas_equal_at"] == 100 for s in summaries.values()), summaries  # and the replicas agreed
