"""The Lightning and Hugging Face adapters in a real short fit on 2 CPU ranks (tests/ranks/adapter_fit.py).

Rank 1 really computes slower; the adapter's Doctor must measure the job's own steps and name it.
Skipped, with the reason, where the frameworks are not installed (`pip install -e ".[adapters]"`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .harness import _env, free_port, tagged_processes

pytestmark = pytest.mark.ranks
FIT = Path(__file__).with_name("adapter_fit.py")


def fit(tmp_path: Path, framework: str) -> tuple[list, dict]:
    tag, port = uuid.uuid4().hex, free_port()
    report = tmp_path / f"{framework}.json"
    procs = [subprocess.Popen([sys.executable, str(FIT), framework, "--json", str(report)], cwd=tmp_path,
                              env=_env(tag, {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                             "ADAPTER_SLOW": "1"}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    assert not tagged_processes(tag)
    summaries = {r: json.loads(Path(f"{report}.summary{r}").read_text()) for r in range(2)}
    return json.loads(report.read_text())["findings"], summaries


@pytest.mark.parametrize("framework, module", [("lightning", "lightning"), ("hf", "transformers")])
def test_the_adapter_watches_a_real_fit_and_names_the_slow_rank(tmp_path, framework, module):
    pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[adapters]')")
    findings, summaries = fit(tmp_path, framework)
    assert all(s["steps"] == 90 and s["comm_measured"] for s in summaries.values()), summaries
    codes = {f["code"]: f for f in findings}
    assert codes["STR001"]["ranks"] == [1] and codes["STR001"]["evidence"]["cause"] == "compute", findings
    assert "DOC008" not in codes and "DOC004" not in codes  # the frameworks shard and wrap: no false alarm
