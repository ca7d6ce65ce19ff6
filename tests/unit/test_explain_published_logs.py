"""`ddpdoctor explain` on NCCL, CUDA, Slurm and elastic messages as those libraries print them.

These failures need GPUs, InfiniBand or Slurm, which this machine lacks, so the logs in
tests/fixtures/explain/published/ are composed from published message texts (sources per
message in the README there); truth.json says which rank or node each story blames.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.explain.command import explain
from ddpdoctor.core.findings import Severity

PUBLISHED = Path(__file__).resolve().parents[1] / "fixtures" / "explain" / "published"
TRUTH: dict[str, dict[str, Any]] = json.loads((PUBLISHED / "truth.json").read_text())

CODE_FOR_STORY = {
    "illegal_memory_access": "LOG009", "device_assert": "LOG009", "gpu_ecc": "LOG009",
    "cuda_oom": "LOG001", "dataloader_shm": "LOG002", "dataloader_timeout": "LOG002",
    "dataloader_worker_killed": "LOG002", "driver_too_old": "GPU008", "no_gpu": "GPU008",
    "sigkill": "LOG012", "host_oom_kill": "RUN002", "invalid_device_ordinal": "GPU005",
    "duplicate_gpu": "GPU003", "watchdog_stuck": "LOG010", "network_interface": "LOG007",
    "network_link": "LOG007", "desync": "RUN009", "straggler": "RUN004",
    "rendezvous_unreachable": "LOG006", "store_unreachable": "RUN001", "time_limit": "LOG008",
    "port_in_use": "LOG005",
}


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_each_published_failure_gets_its_diagnosis(name: str) -> None:
    truth = TRUTH[name]
    run = explain([str(PUBLISHED / name)])
    critical = [f for f in run.explanation.findings if f.severity == Severity.CRITICAL]
    assert critical, (name, [(f.code, f.title) for f in run.explanation.findings])
    first = critical[0]
    assert first.code == CODE_FOR_STORY[truth["story"]], (name, [(f.code, f.title, f.ranks) for f in critical])
    if truth["culprit_ranks"]:
        assert set(first.ranks) == set(truth["culprit_ranks"]), (name, first.title, first.ranks)
    nodes = set(truth.get("culprit_nodes") or [])
    if nodes and truth["culprit_ranks"]:
        assert set(first.nodes) == nodes, (name, first.title, first.nodes)


def test_every_story_has_a_code() -> None:
    assert {t["story"] for t in TRUTH.values()} <= set(CODE_FOR_STORY)


def test_every_signature_is_matched_by_a_real_or_published_message() -> None:
    """No signature without a message from a fixture log behind it (READMEs are not scanned)."""
    from ddpdoctor.explain.read import discover
    from ddpdoctor.explain.scan import scan
    from ddpdoctor.explain.signatures import SIGNATURES

    logs = sorted(str(p) for p in PUBLISHED.parent.rglob("*.log"))
    seen = {e.sig for e in scan(discover(logs).logs).events}
    assert sorted(s.id for s in SIGNATURES if s.id not in seen) == []


def test_first_error_per_node_across_srun_and_torchrun() -> None:
    """srun --label torchrun: labels are nodes' tasks; each node's first error is its own."""
    data = explain([str(PUBLISHED / "nccl_remote_error_ib.log")]).to_json()
    by_node = {n["node"]: n for n in data["nodes"]}
    assert set(by_node) == {"node01", "node02", "node03"}
    assert by_node["node02"]["ranks"] == [2, 3]
    assert all(n["first_error"]["signature"] == "nccl_ib_error" for n in by_node.values())
