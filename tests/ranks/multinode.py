"""Several "nodes" on this machine: network namespaces with their own addresses and host names.

Each node is a network namespace (`ip netns`) joined to the others by veth pairs through a
bridge in node 0's namespace, with an address in 10.77.<k>.0/24, its own host name (a UTS
namespace) and an /etc/hosts that names every node (`ip netns exec` mounts
/etc/netns/NS/hosts over /etc/hosts). A `torchrun --nnodes` per node then sees what it
would see on a cluster: another host name, another address, another interface, and peers
it reaches only over the network. Only these addresses and loopback are ever used.

Needs root and iproute2; tests skip without them. Everything made is removed afterwards,
and every process left in a namespace is killed first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    host: str
    addr: str
    ifname: str
    hub_port: str = ""  # the hub's end of this node's veth (none for the hub itself)


def can_make_nodes() -> Optional[str]:
    """Why this machine cannot host namespace nodes, or None if it can."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2 (ip) and util-linux (unshare)"
    probe = f"ddpd-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.decode(errors='replace').strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def skip_without_nodes() -> pytest.MarkDecorator:
    reason = can_make_nodes()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def namespace_nodes(count: int) -> Iterator[list[Node]]:
    failing = False
    tag = uuid.uuid4().hex[:5]
    subnet = 77 + int(tag, 16) % 100  # 10.<subnet>.0.0/24: unlikely to meet another run's
    nodes = [Node(i, f"ddpd-{tag}-{i}", f"node{i}-{tag}", f"10.{subnet}.0.{i + 1}", f"dd{tag}n{i}",
                  f"hb{tag}{i}" if i else "") for i in range(count)]
    try:
        for node in nodes:
            _ip("netns", "add", node.netns)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            folder = Path("/etc/netns") / node.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.host}\n" for n in nodes))
        hub = nodes[0]
        _ip("-n", hub.netns, "link", "add", f"br{tag}", "type", "bridge")
        _ip("-n", hub.netns, "addr", "add", f"{hub.addr}/24", "dev", f"br{tag}")
        _ip("-n", hub.netns, "link", "set", f"br{tag}", "up")
        for node in nodes[1:]:
            # node's end is named node.ifname; the hub's end joins the bridge.
            _ip("link", "add", node.ifname, "netns", node.netns, "type", "veth",
                "peer", "name", f"hb{tag}{node.index}", "netns", hub.netns)
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", node.ifname, "up")
            _ip("-n", hub.netns, "link", "set", f"hb{tag}{node.index}", "master", f"br{tag}")
            _ip("-n", hub.netns, "link", "set", f"hb{tag}{node.index}", "up")
        # The hub's own traffic leaves through the bridge, so its interface is the bridge.
        nodes[0] = Node(hub.index, hub.netns, hub.host, hub.addr, f"br{tag}", "")
        yield nodes
    except BaseException:
        failing = True
        raise
    else:
        failing = False
    finally:
        left = []
        for node in nodes:
            pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
                    left.append(pid)
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / node.netns, ignore_errors=True)
        # Nothing of ours may outlive a run: the test found none, or this teardown says so.
        if left and not failing:
            raise AssertionError(f"processes left in the node namespaces after the run (killed): {left}")


def can_shape_links(netem: bool = False) -> Optional[str]:
    """Why this machine cannot slow a node's link with tc, or None if it can: a rate (tbf) always,
    a delay or loss (netem) with `netem` (kernels built without sch_netem refuse it)."""
    reason = can_make_nodes()
    if reason is not None:
        return reason
    if shutil.which("tc") is None:
        return "needs iproute2's tc"
    probe = f"ddpd-tc-{uuid.uuid4().hex[:6]}"
    wanted = [["tbf", "rate", "200mbit", "burst", "64kb", "latency", "100ms"]] + ([["netem", "delay", "1ms"]] * netem)
    try:
        _ip("netns", "add", probe)
        for qdisc in wanted:
            made = subprocess.run(["tc", "-n", probe, "qdisc", "replace", "dev", "lo", "root", *qdisc],
                                  capture_output=True, text=True)
            if made.returncode != 0:
                return f"tc {qdisc[0]} refused (no sch_{qdisc[0]} in this kernel?): {made.stderr.strip()}"
    except subprocess.CalledProcessError as exc:
        return f"ip netns add failed: {exc.stderr.decode(errors='replace').strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def skip_without_tc(netem: bool = False) -> pytest.MarkDecorator:
    reason = can_shape_links(netem)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


TBF_BURST_BYTES = 64 * 1024  # slow_link's token bucket ("burst 64kb": tc's kb is 1024 bytes)


def slow_link(hub: Node, node: Node, rate_mbit: Optional[float] = None, delay_ms: Optional[float] = None,
              loss_pct: Optional[float] = None) -> None:
    """Slow one node's link to the others, both ways, as a bad cable, port or NIC would: the
    kernel shapes what leaves its end of the veth and what the hub's bridge port sends to it.
    `rate_mbit` alone is a token bucket (tbf); a delay or loss is netem (with the rate, if any).
    The hub's own link is the bridge and cannot be shaped both ways: pick another node. The
    qdiscs go with the namespaces."""
    if not node.hub_port:
        raise ValueError("the hub node's link is its bridge: slow another node's link")
    if delay_ms is None and loss_pct is None:
        if rate_mbit is None:
            raise ValueError("give a rate, a delay or a loss")
        qdisc = ["tbf", "rate", f"{rate_mbit}mbit", "burst", f"{TBF_BURST_BYTES // 1024}kb", "latency", "100ms"]
    else:
        qdisc = ["netem", *(["delay", f"{delay_ms}ms"] if delay_ms is not None else []),
                 *(["loss", f"{loss_pct}%"] if loss_pct is not None else []),
                 *(["rate", f"{rate_mbit}mbit"] if rate_mbit is not None else [])]
    for netns, dev in ((node.netns, node.ifname), (hub.netns, node.hub_port)):
        subprocess.run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *qdisc], check=True,
                       capture_output=True)


def on_node(node: Node, argv: list[str]) -> list[str]:
    """argv run inside the node: its network, its host name, its /etc/hosts."""
    return ["ip", "netns", "exec", node.netns, "unshare", "--uts", "sh", "-c",
            f'hostname {node.host} && exec "$@"', "sh", *argv]


def torchrun_check(node: Node, hub: Node, nnodes: int, nproc: int, port: int, run_id: str,
                   args: list[str], subcommand: str = "check", static: bool = False) -> list[str]:
    """`torchrun --nnodes ... -m ddpdoctor <subcommand>` as a user types it on that node. `static`: the
    static rendezvous on MASTER_ADDR:MASTER_PORT (`--master-addr/--master-port`), whose store the ranks
    share, so `port` is the only one the job needs to reach; c10d's ranks get a store on another port."""
    rdzv = ([f"--master-addr={hub.addr}", f"--master-port={port}"] if static else
            ["--rdzv-backend=c10d", f"--rdzv-endpoint={hub.addr}:{port}", f"--rdzv-id={run_id}"])
    return on_node(node, [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        f"--node-rank={node.index}", *rdzv, "-m", "ddpdoctor", subcommand, "--no-live", *args])


@dataclass
class NodesRun:
    codes: list[int]
    outputs: list[str]
    report: Optional[dict]
    wall_s: float
    tag: str

    def explain(self) -> str:
        return "\n".join(f"--- node {i} exit {c}:\n{o[-3000:]}" for i, (c, o) in enumerate(zip(self.codes, self.outputs)))

    def findings(self, code: str) -> list[dict]:
        return [f for f in (self.report or {}).get("findings", []) if f["code"] == code]


def firewall_passing_only(hub: Node, others: list[Node], port: int) -> None:
    """The hub drops every TCP packet from the other nodes except to `port`, as a node's firewall that
    passes only the rendezvous port does (`iptables -A INPUT -s NODE -p tcp ! --dport PORT -j DROP`).
    This kernel has neither iptables nor tc classifiers, so policy routing does it: a rule sends those
    packets to a blackhole, which drops them silently (the sender's connect times out), and the
    local table moves after it. The hub's own connections to itself are untouched (not from those
    addresses), and its connections out get no answer back (the answers come from those addresses).
    Goes with the namespace."""
    ns = hub.netns
    _ip("-n", ns, "rule", "add", "pref", "100", "lookup", "local")
    _ip("-n", ns, "rule", "del", "pref", "0")
    for node in others:
        for low, high in ((1, port - 1), (port + 1, 65534)):  # ip rule takes no 65535 in a range
            _ip("-n", ns, "rule", "add", "pref", "10", "from", node.addr, "ipproto", "tcp", "dport",
                f"{low}-{high}", "blackhole")


def container_bridge(node: Node, cidr: str, name: str = "docker0") -> None:
    """A bridge with an address and no ports in the node, as Docker's daemon makes docker0 (172.17.0.1/16 on
    every host that runs it): up, with its address, reaching nothing outside the node. Goes with the namespace."""
    _ip("-n", node.netns, "link", "add", name, "type", "bridge")
    _ip("-n", node.netns, "addr", "add", cidr, "dev", name)
    _ip("-n", node.netns, "link", "set", name, "up")


def run_nodes(tmp_path: Path, nodes: list[Node], args: list[str], nproc: int = 2, subcommand: str = "check",
              per_node_env: Optional[dict[int, dict[str, str]]] = None, timeout_s: float = 150,
              port: Optional[int] = None, static: bool = False) -> NodesRun:
    """One torchrun per node, started together as a job script would; rank 0's JSON report.
    `port`: the rendezvous endpoint's; `static`: torchrun's static rendezvous on it (torchrun_check)."""
    import random
    import time

    from .harness import _env

    tag = uuid.uuid4().hex
    report_path = tmp_path / f"nodes-{tag[:8]}.json"
    port, run_id = port or random.randint(20000, 60000), f"ddpd{tag[:8]}"
    start = time.perf_counter()
    procs = []
    for node in nodes:
        env = _env(tag, {"GLOO_SOCKET_IFNAME": node.ifname, **(per_node_env or {}).get(node.index, {})})
        argv = torchrun_check(node, nodes[0], len(nodes), nproc, port, run_id,
                              [*args, "--json", str(report_path)], subcommand, static)
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return _finish(procs, tag, report_path, start, timeout_s)


def run_slurm_tasks(tmp_path: Path, nodes: list[Node], tasks_per_node: int, args: list[str],
                    started: Optional[list[int]] = None, timeout_s: float = 120) -> NodesRun:
    """What `srun --nodes=N --ntasks-per-node=T ddpdoctor check ...` starts: one process per task,
    inside its node, with only the SLURM_* variables an allocation sets. `started`: the nodes
    whose tasks really start (a node that never comes up is left out)."""
    import random
    import time

    from .harness import _env

    tag = uuid.uuid4().hex
    report_path = tmp_path / f"slurm-{tag[:8]}.json"
    job_id = str(random.randint(100000, 999999))
    nodelist = ",".join(n.host for n in nodes)
    common = {"SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_NNODES": str(len(nodes)),
              "SLURM_NTASKS": str(len(nodes) * tasks_per_node), "SLURM_JOB_NODELIST": nodelist,
              "SLURM_STEP_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{len(nodes)})",
              "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "MASTER_ADDR": None, "MASTER_PORT": None}
    start = time.perf_counter()
    procs = []
    for node in nodes:
        if started is not None and node.index not in started:
            continue
        for local in range(tasks_per_node):
            env = _env(tag, {**common, "SLURM_PROCID": str(node.index * tasks_per_node + local),
                             "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node.index),
                             "GLOO_SOCKET_IFNAME": node.ifname})
            argv = on_node(node, [sys.executable, "-m", "ddpdoctor", "check", "--no-live", *args,
                                  "--json", str(report_path)])
            procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    return _finish(procs, tag, report_path, start, timeout_s)


def _finish(procs: list[subprocess.Popen], tag: str, report_path: Path, start: float, timeout_s: float) -> NodesRun:
    """Wait for every process of a run within its time; whatever outlives it is killed."""
    import json
    import time

    from .harness import tagged_processes

    outputs, codes = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            for p in tagged_processes(tag):
                p.kill()
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
        codes.append(proc.returncode)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return NodesRun(codes, outputs, report, time.perf_counter() - start, tag)


# -- one node's link slowed by tc: is it named? (tests/ranks/test_slow_node_e2e.py, benchmarks/slow_node_matrix.py)

SLOW_CODES = ("BW003", "BW004", "BW005")
# tbf: a link at 200 Mbit/s among 15-20 Gbit/s veths (the issue's case); tbf1g: a NIC at 1 Gbit/s (a 10G
# port that negotiated 1G); netem: 20 ms each way (kernels without sch_netem skip it).
CASES: dict[str, Optional[dict[str, float]]] = {
    "tbf": {"rate_mbit": 200}, "tbf1g": {"rate_mbit": 1000}, "netem": {"delay_ms": 20.0}, "healthy": None}
SLOW_BENCH_ARGS = ["--timeout", "60", "--max-bytes", "1M", "--iters", "5", "--warmup", "1"]


def slowed_ceiling_gbps(shape: dict[str, float], size_bytes: int) -> float:
    """The most busbw (GB/s) a 2-rank all-reduce of `size_bytes` can reach over a link slowed by `shape`
    (slow_link's arguments) on any host, however fast: the kernel holds it there. Each rank must receive
    the other's whole buffer over the link: a rate lets it through no faster than the rate, less one
    full bucket (TBF_BURST_BYTES); a delay holds every call at least that long, the other's data crossing
    once. A 2-rank all-reduce's busbw is its size over its time."""
    seconds = 0.0
    if shape.get("rate_mbit"):
        seconds = max(seconds, (size_bytes - TBF_BURST_BYTES) / (shape["rate_mbit"] * 1e6 / 8))
    if shape.get("delay_ms"):
        seconds = max(seconds, shape["delay_ms"] / 1e3)
    if seconds <= 0:
        raise ValueError(f"no rate or delay bounds this link's speed: {shape}")
    return size_bytes / seconds / 1e9


@dataclass
class Outcome:
    verdict: str  # right / wrong / missed (a healthy run: right = quiet, wrong = any slow finding)
    named: list[str]
    wall_s: float
    run: NodesRun


def judge(run: NodesRun, hosts: list[str], case: str) -> tuple[str, list[str]]:
    """right/wrong/missed for one run, and what its slow findings named ("BW005:node2-x", ...)."""
    slow = [f for f in (run.report or {}).get("findings", []) if f["code"] in SLOW_CODES]
    named = [f"{f['code']}:{','.join(f['nodes'])}" for f in slow]
    if run.report is None:
        return "missed", ["no report"]
    if CASES[case] is None:
        return ("wrong" if slow else "right"), named
    meant = {hosts[-1]} if len(hosts) > 2 else set(hosts)
    if any(set(f["nodes"]) - meant for f in slow):
        return "wrong", named
    right = any(set(f["nodes"]) == meant for f in slow)
    return ("right" if right else "missed"), named


def node_pair_figures(run: NodesRun) -> tuple[list[dict[tuple[str, str], float]], dict[str, float]]:
    """Every node pair's busbw (GB/s) in each view the diagnosis judges (the node leaders', the
    rank ring's pairs across nodes), from the report's raw timings, and each node's own ranks'
    busbw among themselves (nodes of one rank have none)."""
    from ddpdoctor.probes.allreduce.facts import AllReduceFacts
    from ddpdoctor.probes.allreduce.localise import (
        intra_node_busbw, leader_pair_busbw, node_pair_busbw, ring_pair_busbw)

    probe = next((p for p in (run.report or {}).get("probes", []) if p["name"] == "allreduce"), None)
    facts = {int(r): AllReduceFacts.from_json(f) for r, f in ((probe or {}).get("facts") or {}).items()}
    part = next((f.nodes for f in facts.values() if f.nodes is not None and f.nodes.node_of_rank), None)
    if part is None:
        return [], {}
    ring, _ = ring_pair_busbw({r: f.pairs for r, f in facts.items() if f.pairs is not None})
    leaders = leader_pair_busbw({r: f.nodes for r, f in facts.items() if f.nodes is not None})
    hosts = part.node_of_rank
    return ([node_pair_busbw([leaders], hosts), node_pair_busbw([ring], hosts)],
            intra_node_busbw(facts, hosts, int(part.size_bytes)))


def one_run(tmp: Path, nodes_n: int, per_node: int, case: str, timeout_s: float = 240,
            extra: tuple[str, ...] = ()) -> Outcome:
    """One allreduce-bench over `nodes_n` namespace nodes of `per_node` ranks, the last node slowed by `case`
    (`extra`: more of allreduce-bench's arguments)."""
    with namespace_nodes(nodes_n) as nodes:
        shape = CASES[case]
        if shape is not None:
            slow_link(nodes[0], nodes[-1], **shape)
        run = run_nodes(tmp, nodes, [*SLOW_BENCH_ARGS, *extra], nproc=per_node, subcommand="allreduce-bench",
                        timeout_s=timeout_s)
        verdict, named = judge(run, [n.host for n in nodes], case)
    return Outcome(verdict, named, run.wall_s, run)
