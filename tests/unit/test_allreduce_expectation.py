"""The bench's measurement set against what the topology allows (issue 6): efficiency in the
verdict, BW006 far below it, BW007 above the links' speed.

The topology facts are the modelled node snapshots in tests/fixtures/topology (8 x H100 on
NVSwitch: about 360 GB/s busbw; a 4-GPU PCIe workstation: 15.8 GB/s), loaded as `ddpdoctor
diagnose` loads them; the sweep's times are set by hand for a chosen busbw:
t = size x 2(n-1)/n / busbw.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpdoctor.core.findings import Severity
from ddpdoctor.probes import RunView, with_context
from ddpdoctor.probes.allreduce.probe import AllReduce
from ddpdoctor.snapshot import load_inputs

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "topology"
MiB = 2**20
SIZES = (MiB, 25 * MiB, 256 * MiB)


def topology(name: str) -> dict:
    return load_inputs([str(FIXTURES / name)]).facts["topology"]


def sweep(n: int, busbw_gbps: dict[int, float], device: str = "cuda:0", op: str = "all_reduce") -> dict:
    factor = 2 * (n - 1) / n
    results = [{"size_bytes": s, "count": s // 4, "in_place": True, "wrong": 0,
                "times_s": [s * factor / (busbw_gbps[s] * 1e9)] * 3} for s in busbw_gbps]
    return {r: {"host": "node", "rank": r, "local_rank": r, "device": device, "backend": "nccl", "op": op,
                "dtype": "float32", "world_size": n, "warmup": 1, "iters": 3, "results": results} for r in range(n)}


def judge(topo: dict, bench: dict) -> list:
    n = len(bench)
    hosts = {r: f["host"] for r, f in topo.items()} | {r: "node" for r in range(n) if r not in topo}
    view = with_context(RunView(world_size=n, hosts=hosts), {"topology": topo, "allreduce": bench})
    return AllReduce().diagnose(bench, view)


def test_a_healthy_h100_node_reports_its_efficiency():
    topo = topology("dgx_h100_nvswitch.json")
    found = judge(topo, sweep(len(topo), {MiB: 40.0, 25 * MiB: 300.0, 256 * MiB: 342.0}))
    [verdict] = found
    assert verdict.code == "BW000"
    assert verdict.evidence["expected_busbw_gbps"] == pytest.approx(360.0)
    assert verdict.evidence["efficiency_pct"] == pytest.approx(95.0)  # 342 / 360
    assert verdict.evidence["expected_bottleneck"].startswith("NVLink 4.0 x18")
    assert "95% of the ~360 GB/s the topology allows" in verdict.title


def test_far_below_what_the_links_allow_is_bw006():
    topo = topology("dgx_h100_nvswitch.json")
    found = judge(topo, sweep(len(topo), {MiB: 10.0, 25 * MiB: 90.0, 256 * MiB: 120.0}))
    [low] = [f for f in found if f.code == "BW006"]
    assert low.severity == Severity.WARN
    [summary] = [f for f in found if f.code == "BW000"]
    assert summary.severity == Severity.INFO and summary.title.endswith("; see BW006")
    assert low.evidence["efficiency_pct"] == pytest.approx(33.3, abs=0.05)
    assert low.title.startswith("all_reduce peak busbw 120 GB/s is 33% of the ~360 GB/s this topology allows")
    assert "NET/Socket" in low.fix and "TOP002" in low.fix


def test_small_sweeps_are_not_judged_against_the_links():
    # Up to 25 MiB a ring is still latency-bound in part: the figure is shown, never judged.
    topo = topology("dgx_h100_nvswitch.json")
    found = judge(topo, sweep(len(topo), {MiB: 10.0, 25 * MiB: 90.0}))
    assert [f.code for f in found] == ["BW000"] and found[0].evidence["efficiency_pct"] == pytest.approx(25.0)


def test_above_the_links_speed_is_in_network_reduction():
    topo = topology("dgx_h100_nvswitch.json")
    # ~480 GB/s is what 8xH100 with NVLS reports; the ring's own bound is 18 x 25 = 450 GB/s raw.
    found = judge(topo, sweep(len(topo), {MiB: 40.0, 25 * MiB: 400.0, 256 * MiB: 480.0}))
    codes = [f.code for f in found]
    assert codes == ["BW000", "BW007"], codes
    [nvls] = [f for f in found if f.code == "BW007"]
    assert nvls.severity == Severity.INFO and "NVLS" in nvls.title and "NCCL_NVLS_ENABLE=0" in nvls.fix
    assert nvls.evidence["bottleneck_wire_gbps"] == pytest.approx(450.0)
    assert "above the 450 GB/s its slowest link carries" in nvls.title


def test_a_ring_at_nccl_tests_best_is_not_taken_for_in_network_reduction():
    topo = topology("dgx_h100_nvswitch.json")
    found = judge(topo, sweep(len(topo), {MiB: 40.0, 25 * MiB: 350.0, 256 * MiB: 400.0}))  # 111% of the model
    assert [f.code for f in found] == ["BW000"]


def test_a_pcie_workstation_at_its_model():
    topo = topology("workstation_4gpu_pcie_healthy.json")
    [verdict] = judge(topo, sweep(len(topo), {MiB: 2.0, 25 * MiB: 11.0, 256 * MiB: 14.2}))
    assert verdict.evidence["expected_busbw_gbps"] == pytest.approx(15.8)
    assert verdict.evidence["efficiency_pct"] == pytest.approx(89.9)


def test_cpu_ranks_and_all_to_all_are_not_set_against_the_ring():
    topo = topology("dgx_h100_nvswitch.json")
    cpu = judge(topo, sweep(len(topo), {MiB: 1.0, 256 * MiB: 2.0}, device="cpu"))
    assert [f.code for f in cpu] == ["BW000"]  # the number is shown, CPU ranks are not judged by GPU links
    a2a = judge(topo, sweep(len(topo), {MiB: 1.0, 256 * MiB: 2.0}, op="all_to_all"))
    assert [f.code for f in a2a] == ["BW000"] and "efficiency_pct" not in a2a[0].evidence


def test_without_the_topology_probe_nothing_is_claimed():
    bench = sweep(2, {MiB: 1.0, 256 * MiB: 2.0})
    view = with_context(RunView(world_size=2, hosts={0: "node", 1: "node"}), {"allreduce": bench})
    [verdict] = AllReduce().diagnose(bench, view)
    assert "expected_busbw_gbps" not in verdict.evidence and "expected_busbw" not in verdict.evidence


def test_unreadable_topology_facts_cost_only_the_expectation():
    bench = sweep(2, {MiB: 1.0, 256 * MiB: 2.0})
    view = with_context(RunView(world_size=2, hosts={0: "node", 1: "node"}),
                        {"topology": {0: {"node": "garbage"}, 1: 7}, "allreduce": bench})
    [verdict] = AllReduce().diagnose(bench, view)
    assert verdict.evidence["expected_busbw"].startswith("not modelled")


# -- what NCCL says it chose ------------------------------------------------------------------------
# NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING lines. The AllGather pair is verbatim from a public
# training log; the name-form bodies (two spellings) are as public write-ups quote them; the last
# choice line follows NCCL's older format string "%ld Bytes -> Algo %d proto %d time %f". The
# "gpu01:1234:1234 [0]" prefixes are ours, in NCCL's "host:pid:tid [dev] NCCL INFO" shape. None
# was recorded here: no GPU was lent.
REAL_LINES = """\
node-0:309:309 [0] NCCL INFO AllGather: 37756928 Bytes -> Algo 1 proto 2 time 2860.208008
node-3:278:278 [0] NCCL INFO AllGather: opCount 1606 sendbuff 0x93fd44a00 recvbuff 0x96d44e200 count 2359808 datatype 7
gpu01:1234:1234 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo Tree proto LL channel{Lo..Hi}={0..1}
gpu01:1234:1234 [0] NCCL INFO AllReduce: 268435456 Bytes -> Algo NVLS proto Simple channel{Lo..Hi}={0..15}
gpu01:1234:1234 [0] NCCL INFO Broadcast:    32768 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..0}
gpu01:1234:1234 [0] NCCL INFO 1048576 Bytes -> Algo 4 proto 2 time 35.500000
gpu01:1234:1234 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
"""


def test_nccls_choice_lines_of_every_shape_are_read():
    from ddpdoctor.measure.nccl_tuning import Choice, parse

    assert parse(REAL_LINES) == [
        Choice("AllGather", 37756928, "Ring", "Simple"),
        Choice("AllReduce", 4096, "Tree", "LL"),
        Choice("AllReduce", 268435456, "NVLS", "Simple"),
        Choice("Broadcast", 32768, "Ring", "Simple"),
        Choice(None, 1048576, "NVLS", "Simple"),
    ]


def test_the_choices_are_asked_for_in_a_file_of_ours_unless_the_user_logs_nccl(tmp_path):
    from ddpdoctor.measure.nccl_tuning import by_size, capture_env, read_choices

    env = capture_env({}, str(tmp_path))
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "TUNING"
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl-tuning.%h.%p.log")  # NCCL expands %h and %p
    assert capture_env({"NCCL_DEBUG": "WARN"}, str(tmp_path)) == {}
    (tmp_path / "nccl-tuning.gpu01.1234.log").write_text(REAL_LINES)
    assert by_size(read_choices(str(tmp_path)), "all_reduce") == {4096: "Tree/LL", 268435456: "NVLS/Simple",
                                                                  1048576: "NVLS/Simple"}
    assert read_choices(str(tmp_path / "gone")) == []


def test_a_recorded_nvls_choice_is_named_in_the_finding_and_the_table():
    import io

    from rich.console import Console

    from ddpdoctor.probes.allreduce.probe import merge_results
    from ddpdoctor.probes.allreduce.render import render_bench

    topo = topology("dgx_h100_nvswitch.json")
    bench = sweep(len(topo), {MiB: 40.0, 25 * MiB: 400.0, 256 * MiB: 480.0})
    bench[0]["nccl_algorithms"] = {str(MiB): "Ring/LL128", str(25 * MiB): "NVLS/Simple", str(256 * MiB): "NVLS/Simple"}
    found = judge(topo, bench)
    [nvls] = [f for f in found if f.code == "BW007"]
    assert "NCCL chose NVLS/Simple there: the switch reduces in the network" in nvls.title
    assert nvls.evidence["nccl_algorithm_at_peak"] == "NVLS/Simple"
    [verdict] = [f for f in found if f.code == "BW000"]
    assert verdict.evidence["nccl_algorithm_by_size"] == {"1 MiB": "Ring/LL128", "25 MiB": "NVLS/Simple",
                                                          "256 MiB": "NVLS/Simple"}
    out = io.StringIO()
    render_bench(merge_results(bench), bench, Console(file=out, width=200, color_system=None))
    assert "nccl algo" in out.getvalue() and "NVLS/Simple" in out.getvalue()


def two_nodes(name: str) -> dict:
    """The snapshot's node twice, as a 2-node job: ranks 8-15 on a second host."""
    one = topology(name)
    return {r + 8 * k: {**f, "host": f"{f['host']}-{k}", "rank": r + 8 * k} for k in (0, 1) for r, f in one.items()}


@pytest.mark.parametrize("busbw", [5.0, 900.0])
def test_across_nodes_the_model_is_shown_but_never_judged(busbw):
    # The network figure counts every NIC of each node, and SHARP is invisible to it: neither a
    # low (BW006) nor a high (BW007) measurement against it is a finding.
    topo = two_nodes("dgx_h100_nvswitch.json")
    found = judge(topo, sweep(len(topo), {MiB: 1.0, 25 * MiB: busbw, 256 * MiB: busbw}))
    assert [f.code for f in found] == ["BW000"], [f.title for f in found]
    [verdict] = found
    assert verdict.evidence["expected_busbw_gbps"] > 0 and verdict.evidence["expected_judged"].startswith("no")
    assert "not judged" in verdict.title and "the topology allows" not in verdict.title


ASK_AND_FAIL = """
import os, sys
from types import SimpleNamespace
from ddpdoctor.session.rank import _ask_nccl_for_its_choices, _teardown
from ddpdoctor.measure.host import read_env
from ddpdoctor.runtime.context import SharedState
ctx = SimpleNamespace(shared=SharedState())
_ask_nccl_for_its_choices(ctx)
folder = ctx.shared.nccl_tuning_dir
print(folder, os.path.isdir(folder), os.environ["NCCL_DEBUG"], "NCCL_DEBUG" in read_env(),
      "NCCL_DEBUG_FILE" in read_env(), flush=True)
_teardown()  # what run_rank's finally does; the probe never ran to read and remove it
os._exit(3)  # as ranks leave: no atexit handler runs
"""


def test_the_nccl_log_folder_is_removed_and_never_counted_as_the_users_setting(tmp_path):
    # NCCL gets the variables (it reads them at its init), the environment facts do not: HOM005
    # would otherwise report the setting only rank 0 got from us. A run that fails leaves no folder.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")} | {"TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", ASK_AND_FAIL], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    folder, existed, debug, in_facts, file_in_facts = proc.stdout.split()
    assert existed == "True" and debug == "INFO" and in_facts == "False" and file_in_facts == "False"
    assert folder.startswith(str(tmp_path)) and not Path(folder).exists()


def test_the_users_own_nccl_setting_stays_in_the_facts(monkeypatch):
    from ddpdoctor.measure import host as host_facts

    monkeypatch.setattr(host_facts, "_OURS", {})
    monkeypatch.setenv("NCCL_DEBUG_SUBSYS", "INIT")
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    host_facts.set_for_ourselves({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING"})
    try:
        facts = host_facts.read_env()
        assert "NCCL_DEBUG" not in facts and facts["NCCL_DEBUG_SUBSYS"] == "INIT"
    finally:
        monkeypatch.delenv("NCCL_DEBUG", raising=False)


def test_nccls_choices_are_asked_for_only_when_wanted_and_where_sizes_agree():
    from dataclasses import replace

    from ddpdoctor.cli import _bench_config, build_parser
    from ddpdoctor.runtime.config import CheckConfig
    from ddpdoctor.core.errors import UsageError
    from ddpdoctor.session.rank import wants_nccl_choices

    parser = build_parser()
    off = _bench_config(parser.parse_args(["allreduce-bench"]))
    on = _bench_config(parser.parse_args(["allreduce-bench", "--nccl-algo"]))
    assert off.nccl_algorithms is False and on.nccl_algorithms is True
    bench = CheckConfig(probes=("topology", "allreduce"), bench=on)
    assert wants_nccl_choices(bench, "nccl", 0)
    assert not wants_nccl_choices(bench, "nccl", 1)  # NCCL logs its choices on its rank 0
    assert not wants_nccl_choices(bench, "gloo", 0)
    assert not wants_nccl_choices(replace(bench, bench=off), "nccl", 0)  # not asked for
    assert not wants_nccl_choices(replace(bench, probes=("topology",)), "nccl", 0)
    assert wants_nccl_choices(replace(bench, bench=replace(on, op="broadcast")), "nccl", 0)
    # all_gather's logged bytes differ across NCCL versions: refused in one line, not silently empty.
    assert not wants_nccl_choices(replace(bench, bench=replace(on, op="all_gather")), "nccl", 0)
    with pytest.raises(UsageError, match="--nccl-algo records NCCL's choices for all_reduce and broadcast only"):
        _bench_config(parser.parse_args(["allreduce-bench", "--nccl-algo", "--op", "all_gather"]))
