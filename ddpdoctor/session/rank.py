"""One rank's life: rendezvous, init, probes, report, each a stage with a deadline.

The same code runs under our own launcher, torchrun and srun; only who hosts the store
and who writes the report differ (see launch_env).
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import faulthandler
import os
import signal
import sys
import time
from typing import Any, Mapping, Optional

from ddpdoctor.core import keys
from ddpdoctor.core.hello import Hello
from ddpdoctor.runtime.channel import Channel
from ddpdoctor.core.behaviour_env import behaviour_settings
from ddpdoctor.measure.host import machine_identity, users_environ
from ddpdoctor.measure import fr_snapshot
from ddpdoctor.runtime.config import CheckConfig
from ddpdoctor.runtime.context import RankContext, StageFailed
from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.findings import EXIT_CRITICAL, EXIT_UNKNOWN
from ddpdoctor.measure import host_load
from ddpdoctor.measure import nccl_tuning
from ddpdoctor.core.faults import check_ranks, check_standalone
from ddpdoctor.runtime.inject import Injector, no_show
from ddpdoctor.runtime.launch_env import BACKEND_VAR, DEVICE_VAR, LaunchEnv, launcher_pid
from ddpdoctor.runtime.liveness import Heartbeat, SideChannel, Watchdog
from ddpdoctor.measure.net import Resolution, resolve, wait_for_port
from ddpdoctor.runtime.rank_state import RankState, Terminated
from ddpdoctor.measure import peer_reach
from ddpdoctor.probes.init_hang import NAME as INIT_PROBE, InitHangFacts, before_rendezvous, reach_from
from ddpdoctor.core.run_record import RunRecord
from ddpdoctor.runtime.channel import read_record
from ddpdoctor.runtime.slurm import expand_nodelist


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if its launcher dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the heartbeat thread's parent check still applies


def _connect(env: LaunchEnv, cfg: CheckConfig, lookup: Resolution) -> Channel:
    """`lookup`: MASTER_ADDR resolved once for this rank (also a fact of the init-hang probe)."""
    where = f"{env.master_addr}:{env.master_port}"
    resolved, problem, _ = lookup
    if not resolved:
        why = str((problem or {}).get("unknown", "")).split(": ", 1)[-1]
        raise UsageError(f"MASTER_ADDR={env.master_addr!r} does not resolve on {env.hostname} ({why}): "
                         "use an address every node can resolve, e.g. the first node's IP")
    if not env.hosts_store:
        # A client gives up before rank 0's rendezvous wait (0.8 x timeout) ends, so its reason
        # reaches the launcher's report.
        wait_s = 0.7 * cfg.timeout_s
        began = time.monotonic()
        try:
            failure = wait_for_port(env.master_addr, env.master_port, wait_s, dial=resolved[0])
        except Terminated:
            # Stopped before its own deadline: rank 0's wait, started earlier, ended first (this
            # rank reached here later: slower imports on a loaded node). It still says why, from
            # one more dial, or the report names a missing rank with no reason (issue 40: seen
            # once in a suite run, 2 ranks on 2 busy cores).
            failure = wait_for_port(env.master_addr, env.master_port, 0.0, dial=resolved[0])
            if failure is None:
                raise
            wait_s = round(time.monotonic() - began, 1)
        if failure is not None:
            raise _Unreachable(f"rank {env.rank} on {env.hostname} could not reach the rendezvous store at {where} "
                               f"within {wait_s:g}s: {failure}")
    try:
        # The timeout is also every later store operation's: the full stage deadline, always.
        return Channel.connect(env.master_addr, env.master_port, cfg.timeout_s, is_master=env.hosts_store)
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if env.hosts_store:
            raise UsageError(f"rank 0 could not listen on port {env.master_port} ({text}): the port is in use "
                             "or not allowed; set MASTER_PORT to a free port") from None
        raise _Unreachable(f"rank {env.rank} on {env.hostname} could not reach the rendezvous store at {where}: "
                           f"{where} accepts connections but did not answer as a store (another service owns "
                           f"that port, or rank 0 is overloaded): {text}") from None


class _Unreachable(Exception):
    pass


def _hello(ctx: RankContext) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {"rank": ctx.rank, "host": ctx.env.hostname, "pid": os.getpid(), "machine": machine_identity(),
            "local_rank": ctx.env.local_rank,
            "local_world_size": ctx.env.local_world_size, "world_size": ctx.world_size, "mode": ctx.env.mode,
            "cuda_devices": torch.cuda.device_count() if cuda else 0, "t": time.time(),
            "torch": torch.__version__, "env_settings": behaviour_settings(users_environ()),
            **_node_placement(os.environ, ctx.rank), **_reach_endpoint(ctx)}


def _reach_endpoint(ctx: RankContext) -> dict[str, Any]:
    """A node's first rank: where the other nodes can dial it (measure/peer_reach.py), only when
    the init-hang probe runs; nothing on the other ranks. The address is its route's to the store,
    as the probe already read it (no second lookup); a loopback one is never published (a host name
    on 127.0.1.1 is INIT002's, and the other nodes could only dial themselves). Beside it, the
    address each *_SOCKET_IFNAME selects here where that is another one: the backend binds there
    and tells its peers to connect to it, so that is the address to try (INIT006)."""
    if ctx.env.local_rank != 0 or INIT_PROBE not in getattr(ctx.cfg, "probes", ()):
        return {}
    reach = ctx.shared.reach
    if reach is None or not isinstance(reach.source, str) or peer_reach.is_loopback(reach.source):
        return {}
    listener = peer_reach.listen()
    if listener is None:
        return {}
    ctx.shared.reach_listener = listener
    over = {var: [iface, addr] for var, (iface, addr) in reach.ifnames.items()
            if addr != reach.source and not peer_reach.is_loopback(addr)}
    return {"reach": [reach.source, int(listener.getsockname()[1])], **({"reach_ifname": over} if over else {})}


# A dial's name in peer_reach.dial_all: the other node's host name, and for a dial over an interface a
# *_SOCKET_IFNAME selects there, the variable after this separator (no host name holds it).
_OVER = " over "


def _reach_targets(ctx: RankContext, hellos: dict[int, dict[str, Any]]) -> dict[str, tuple[str, int]]:
    """What a node's first rank dials: the other nodes' first ranks, by host name, the MAX_DIALS after
    it in the order of their ranks (all of them up to that many nodes), so no node is dialled more
    often than that; and each one's *_SOCKET_IFNAME address, where it published one (`host over VAR`),
    unless this node has that address itself (a container bridge's 172.17.0.1 on every node: a dial
    would reach this node, not that one; INIT006 says so from the facts). None on the other ranks,
    and in a job on one node."""
    me = hellos.get(ctx.rank) or {}
    if not me.get("reach"):
        return {}
    own = ctx.shared.reach.own if ctx.shared.reach is not None else frozenset()
    leaders = [(r, h) for r, h in sorted(hellos.items()) if h.get("reach")]
    at = next(i for i, (r, _) in enumerate(leaders) if r == ctx.rank)
    targets: dict[str, tuple[str, int]] = {}
    nodes = 0
    for k in range(1, len(leaders)):  # by host name: a host with two leaders (two launchers) is one node
        h = leaders[(at + k) % len(leaders)][1]
        host = str(h.get("host"))
        if h.get("host") == me.get("host") or host in targets:
            continue
        if nodes == peer_reach.MAX_DIALS:
            break
        nodes += 1
        port = int(h["reach"][1])
        targets[host] = (str(h["reach"][0]), port)
        for var, (_, addr) in sorted((h.get("reach_ifname") or {}).items()):
            if str(addr) not in own:
                targets[f"{host}{_OVER}{var}"] = (str(addr), port)
    return targets


def _dial_other_nodes(ctx: RankContext, targets: dict[str, tuple[str, int]],
                      hellos: dict[int, dict[str, Any]]) -> None:
    """Dial them before the process group's init, and add what was found to this rank's init-hang
    facts: a firewall that passes only the store's port (INIT005), or an interface the backend is told
    to use that the other nodes cannot reach (INIT006), is named here, before gloo or NCCL hang on it."""
    found = peer_reach.dial_all(targets)
    facts = ctx.channel.get(keys.result(INIT_PROBE, ctx.rank)) or {}
    route = facts.get("route")  # the address this node listens on is its route's (_reach_endpoint)
    ifaces = {str(h.get("host")): h.get("reach_ifname") or {} for h in hellos.values() if h.get("reach")}
    direct, over = {}, []
    for name, (addr, port) in targets.items():
        if name not in found:
            continue
        host, _, var = name.partition(_OVER)
        if not var:
            direct[name] = {"address": f"{addr}:{port}", "result": found[name]}
        else:
            over.append({"to": host, "variable": var, "interface": (ifaces.get(host, {}).get(var) or [None])[0],
                         "address": f"{addr}:{port}", "result": found[name]})
    facts["peer_reach"] = {"source": route.get("source") if isinstance(route, dict) else None, "to": direct,
                           **({"over_ifname": over} if over else {})}
    ctx.channel.set(keys.result(INIT_PROBE, ctx.rank), facts)


def _node_placement(environ: Mapping[str, str], rank: int) -> dict[str, Any]:
    """Which node this rank's launcher says it is on (torchrun's GROUP_RANK, Slurm's SLURM_NODEID,
    and which of the two), and on rank 0 Slurm's node list: how the report names a node none of
    whose ranks arrived."""
    out: dict[str, Any] = {}
    for var, source in (("GROUP_RANK", "torchrun"), ("SLURM_NODEID", "slurm")):
        if environ.get(var, "").isdigit():
            out["node_rank"], out["node_rank_from"] = int(environ[var]), source
            break
    listed = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if listed and rank == 0:  # one copy is enough: it is the same list on every rank
        try:
            out["nodelist"] = expand_nodelist(listed)
        except UsageError:
            pass  # unreadable: the report names missing nodes by node rank only
    return out


# What the other ranks need of every rank's hello (the backend choice, node grouping, whose
# processes share a machine): rank 0 reads the N hellos once and publishes this digest, so the
# rendezvous costs O(N) store calls, not every rank reading every hello (N² on the one store).
HELLO_DIGEST = keys.HELLO_DIGEST
_DIGEST_FIELDS = ("rank", "host", "machine", "pid", "local_rank", "local_world_size", "cuda_devices", "reach",
                  "reach_ifname")


def _not_arrived(missing: list[int], arrived: int, world_size: int, wait_s: float) -> RuntimeError:
    return RuntimeError(f"ranks {missing} did not arrive within {wait_s:g}s ({arrived} of {world_size} arrived)")


def _rendezvous(ctx: RankContext) -> dict[int, dict[str, Any]]:
    """Everyone says hello; a missing rank is named here, before any collective waits on it."""
    ctx.channel.set(keys.hello(ctx.rank), _hello(ctx))
    hello_keys = [keys.hello(r) for r in range(ctx.world_size)]
    # Shorter than the stage deadline, so a missing rank is an orderly finding, not a watchdog exit;
    # the others wait a little longer than rank 0, whose digest says who is missing.
    wait_s = ctx.cfg.timeout_s * 0.8
    with ctx.collective("rendezvous"):
        if ctx.rank == 0:
            present = ctx.channel.wait(hello_keys, wait_s)
            missing = [r for r in range(ctx.world_size) if keys.hello(r) not in present]
            if missing:
                ctx.channel.set(HELLO_DIGEST, {"missing": missing, "arrived": len(present)})
                raise _not_arrived(missing, len(present), ctx.world_size, wait_s)
            # Rank 0 goes by the digest too, so every rank decides (the backend first) from the same facts.
            hellos = {r: {k: h.get(k) for k in _DIGEST_FIELDS}
                      for r, h in ctx.channel.collect(keys.HELLO_PATTERN, range(ctx.world_size)).items()}
            ctx.channel.set(HELLO_DIGEST, {"hellos": {str(r): h for r, h in hellos.items()}})
        else:
            if not ctx.channel.wait([HELLO_DIGEST], wait_s + ctx.cfg.timeout_s * 0.1):
                # Rank 0 never published: it is missing or stuck itself. Look once at who said hello.
                present = ctx.channel.wait(hello_keys, 0.0)
                missing = [r for r in range(ctx.world_size) if keys.hello(r) not in present]
                raise _not_arrived(missing or [0], len(present), ctx.world_size, wait_s)
            digest = ctx.channel.get(HELLO_DIGEST) or {}
            if "missing" in digest:
                raise _not_arrived(list(digest["missing"]), int(digest.get("arrived", 0)), ctx.world_size, wait_s)
            hellos = {int(r): h for r, h in digest["hellos"].items()}
    ctx.shared.hellos = {r: Hello.from_json(h) for r, h in hellos.items()}
    return hellos


def choose_backend(requested_backend: str, requested_device: str, hellos: dict[int, dict[str, Any]]) -> tuple[str, str]:
    """NCCL only when every rank can own a GPU; decided from all ranks' hellos so all agree."""
    # A rank owns a GPU if it sees one per local rank, or exactly one (Slurm's
    # --gpus-per-task=1 binds one to each task). Sharing is the gpu-count probe's finding.
    every_rank_has_gpu = all(h.get("cuda_devices", 0) >= h.get("local_world_size", 1) or h.get("cuda_devices", 0) == 1
                             for h in hellos.values())
    device = requested_device
    if device == "auto":
        device = "cuda" if every_rank_has_gpu else "cpu"
    backend = requested_backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return backend, device


def _init(ctx: RankContext, hellos: dict[int, dict[str, Any]]) -> None:
    import torch
    import torch.distributed as dist

    backend, device = choose_backend(os.environ.get(BACKEND_VAR, ctx.cfg.backend),
                                     os.environ.get(DEVICE_VAR, ctx.cfg.device), hellos)
    if backend == "nccl" and not dist.is_nccl_available():
        raise RuntimeError("the NCCL backend is not available in this torch build; use --backend gloo")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device on this rank")
        count = torch.cuda.device_count()
        torch.cuda.set_device(ctx.env.local_rank if count >= ctx.env.local_world_size else 0)
        ctx.device = torch.device("cuda", torch.cuda.current_device())
    else:
        ctx.device = torch.device("cpu")
    ctx.backend = backend
    if wants_nccl_choices(ctx.cfg, backend, ctx.rank):
        _ask_nccl_for_its_choices(ctx)
    with ctx.collective("init_process_group", backend=backend):
        dist.init_process_group(backend, store=ctx.channel.pg_store(), rank=ctx.rank,
                                world_size=ctx.world_size,
                                timeout=datetime.timedelta(seconds=ctx.cfg.timeout_s))


def wants_nccl_choices(cfg: CheckConfig, backend: str, rank: int) -> bool:
    """Asked for (--nccl-algo), on NCCL, by the bench, where NCCL logs them (its rank 0), for an
    op whose logged sizes are the bench's."""
    return (backend == "nccl" and rank == 0 and "allreduce" in cfg.probes and cfg.bench.nccl_algorithms
            and cfg.bench.op in nccl_tuning.SIZES_AGREE)


def _ask_nccl_for_its_choices(ctx: RankContext) -> None:
    """Before NCCL starts: its TUNING log in a folder of ours, so the bench can say which algorithm
    NCCL chose per size. Rank 0 only (NCCL logs the choice there); never over the user's NCCL_DEBUG."""
    import shutil
    import tempfile

    from ddpdoctor.measure.host import set_for_ourselves

    global _NCCL_LOG_DIR
    folder = tempfile.mkdtemp(prefix="ddpdoctor-nccl-")
    extra = nccl_tuning.capture_env(os.environ, folder)
    if not extra:
        shutil.rmtree(folder, True)
        return
    set_for_ourselves(extra)  # NCCL reads them at its init; the environment facts keep the user's own
    ctx.shared.nccl_tuning_dir = folder
    _NCCL_LOG_DIR = folder


# The folder NCCL logs its choices to: the probe removes it after reading; a rank that leaves
# before that (a failed probe, a stage deadline) removes it on its way out. Ranks leave through
# os._exit, which runs no atexit handler, so this is called from those exits.
_NCCL_LOG_DIR: Optional[str] = None


def _remove_nccl_log() -> None:
    if _NCCL_LOG_DIR is not None:
        import shutil

        shutil.rmtree(_NCCL_LOG_DIR, True)


def _wait_for_ranks(channel: Channel, record: RunRecord, cfg: CheckConfig) -> None:
    """The reporter waits until every rank is done or failed, or has gone silent."""
    while True:
        read_record(channel, record)
        now = time.time()
        pending = []
        for r in range(record.world_size):
            if r in record.done or r in record.errors or r in record.timeouts:
                continue
            hb = record.heartbeats.get(r)
            if hb is None:
                if now - record.started < cfg.timeout_s:
                    pending.append(r)
            elif now - float(hb.get("t", 0)) < cfg.silent_after_s:
                pending.append(r)
        if not pending:
            return
        time.sleep(0.1)


def _write_report(ctx: RankContext, record: RunRecord, channel: Channel, command: list[str],
                  wait: bool = True, stopped: bool = False) -> int:
    """`stopped`: the launcher is stopping every rank, so a stale heartbeat too means a dead rank."""
    from ddpdoctor.render.console import make_console, render_report
    from ddpdoctor.session.reporter import build_report, write_outputs

    if wait:
        _wait_for_ranks(channel, record, ctx.cfg)
    if ctx.env.store_host != "launcher":
        # Under torchrun a peer's crash can reach us as a transport error before the agent's
        # SIGTERM does: a rank on this host whose process is gone crashed, it is not frozen.
        _find_dead_ranks(channel, record, ctx.env, by_heartbeat=stopped)
    read_record(channel, record)
    report = build_report(record, ctx.backend, str(ctx.device.type if ctx.device is not None else ""), command)
    write_outputs(report, ctx.cfg)
    render_report(report, make_console(), charts=ctx.cfg.live)
    return report.exit_code


def run_rank(cfg: CheckConfig, env: LaunchEnv, command: list[str]) -> int:
    """One rank's whole life, in order: prepare the process, dial the store, run the stages,
    report (or wait for the reporter's verdict); a SIGTERM or Ctrl-C still ends in a report."""
    parent = launcher_pid(os.environ)
    state = RankState()
    early = _prepare_process(cfg, env, state, parent)
    if early is not None:
        return early
    # Whose CPU the check shares, from the first moment (the imports below are seconds of CPU
    # that another job's load slows down too): read again by homogeneity, against this start.
    load_start = host_load.sample() if env.local_rank == 0 else None
    Injector(cfg.inject, env.rank).at_stage("launch")
    if Injector(cfg.inject, env.rank).no_show():
        no_show()  # a process that never joins: only its launcher's deadline ends it
    _preload(cfg)
    record = _new_record(cfg, env)
    try:
        env, channel, side, reach = _dial(cfg, env, record)
    except _Unreachable as exc:
        sys.stderr.write(f"ddpdoctor: {exc}\n")
        return EXIT_CRITICAL

    def emergency_report() -> Optional[int]:
        # Our own stage deadline fired: the watchdog leaves through hard_exit after this.
        _remove_nccl_log()
        # On the reporter: say what we know before exiting.
        if env.is_reporter:
            time.sleep(min(2.0, cfg.timeout_s / 2))
            return _write_report(ctx, record, side.channel, command, wait=False)
        return None

    watchdog = Watchdog(side, env.rank, state, on_fire=emergency_report)
    watchdog.start()
    heartbeat = Heartbeat(side, env.rank, state, cfg.heartbeat_s, cfg.silent_after_s, parent)
    heartbeat.start()
    ctx = RankContext(env, cfg, channel, Injector(cfg.inject, env.rank), state, watchdog)
    ctx.shared.host_load_start = load_start
    ctx.shared.reach = reach
    outcome = _Outcome()
    try:
        healthy = _run_stages(ctx)
        _report_stage(ctx, record, command, healthy, outcome)
    except StageFailed:
        outcome.code = outcome.code or 1
        if state.store_lost:
            sys.stderr.write(f"ddpdoctor: rank {env.rank} lost the rendezvous store at {env.master_addr}:"
                             f"{env.master_port} (its host, rank 0 or the launcher, is gone); no report from here\n")
            outcome.code = EXIT_CRITICAL
    except (Terminated, KeyboardInterrupt):
        watchdog.close()
        return _after_termination(ctx, record, side, command, outcome)
    finally:
        watchdog.close()
        heartbeat.stop()
        _teardown()
    return outcome.code


@dataclasses.dataclass
class _Outcome:
    """The rank's exit code so far, and whether the report is written and the verdict given."""

    code: int = 0
    reported: bool = False  # a late SIGTERM then changes neither


def _prepare_process(cfg: CheckConfig, env: LaunchEnv, state: RankState, parent: Optional[int]) -> Optional[int]:
    """Never outlive the launcher, dump stacks on SIGUSR1, turn SIGTERM into a reported stop,
    and refuse faults this launch cannot carry out. An exit code when the rank must not start."""
    if parent is not None:
        _die_with_parent()
        if os.getppid() != parent:
            return EXIT_UNKNOWN  # the launcher died before we got here
    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for our stacks

    def on_sigterm(signum: int, frame: Any) -> None:
        # SIGTERM from our launcher or torchrun's agent: stop, but report first.
        state.terminating = True
        raise Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
    check_ranks(cfg.inject, env.world_size)
    check_standalone(cfg.inject, standalone=parent is not None)
    return None


def _preload(cfg: CheckConfig) -> None:
    """Heavy imports before the first deadline is armed: DDP's constructor imports torch._dynamo,
    seconds of CPU on a loaded node, which no stage should be charged for. Probes that build no
    DDP model skip them: 2 s of CPU per rank."""
    from ddpdoctor.probes import get_probe

    if any(get_probe(name).trains for name in cfg.probes):
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel  # noqa: F401


def _new_record(cfg: CheckConfig, env: LaunchEnv) -> RunRecord:
    """The run as this rank will report it, from this process's start, imports included, as the
    standalone launcher counts from the spawn."""
    import psutil

    return RunRecord(world_size=env.world_size, mode=env.mode, probes=cfg.probes,
                     started=psutil.Process().create_time(),
                     faults=tuple(f.describe() for f in cfg.inject), silent_after_s=cfg.silent_after_s,
                     settings=cfg.settings)


def _dial(cfg: CheckConfig, env: LaunchEnv, record: RunRecord
          ) -> tuple[LaunchEnv, Channel, SideChannel, Optional[peer_reach.ReachFrom]]:
    """Connect to the store (and the helper threads' second connection); the init-hang probe's
    first facts are published before anyone waits on anyone, so a rank that hangs from here on
    has already said how it got here. Raises _Unreachable when the store cannot be reached."""
    addr, port = Injector(cfg.inject, env.rank).rendezvous_target(env.master_addr, env.master_port)
    env = dataclasses.replace(env, master_addr=addr, master_port=port)
    lookup = resolve(env.master_addr, env.master_port, min(cfg.timeout_s, 10.0))
    connect_t0 = time.monotonic()
    channel = _connect(env, cfg, lookup)
    connect_s = time.monotonic() - connect_t0
    side = SideChannel(Channel.connect(env.master_addr, env.master_port, cfg.timeout_s))
    reach = None
    if INIT_PROBE in cfg.probes:
        facts = before_rendezvous(env, lookup, connect_s, record.started)
        channel.set(keys.result(INIT_PROBE, env.rank), facts)
        reach = reach_from(InitHangFacts.from_json(facts))  # where the other nodes may dial
    return env, channel, side, reach


def _run_stages(ctx: RankContext) -> bool:
    """Rendezvous, init, then each probe's collect, each a stage with its deadline. False when a
    stage failed (its error is already published): the rank goes on to the report stage."""
    from ddpdoctor.probes import get_probe

    try:
        with ctx.stage("rendezvous"):
            hellos = _rendezvous(ctx)
        targets = _reach_targets(ctx, hellos)
        if targets:  # its own stage: the rendezvous' timing (INIT004's gaps) stays its own, the dials get a deadline
            with ctx.stage("reach", deadline_s=peer_reach.DIAL_TIMEOUT_S + 10.0):
                _dial_other_nodes(ctx, targets, hellos)
        with ctx.stage("init"):
            _init(ctx, hellos)
        for name in ctx.cfg.probes:
            with ctx.stage(f"probe:{name}", deadline_s=ctx.cfg.timeout_s):
                ctx.publish_partial(name, get_probe(name).collect(ctx))
    except StageFailed:
        return False
    return True


def _report_stage(ctx: RankContext, record: RunRecord, command: list[str], healthy: bool, outcome: _Outcome) -> None:
    """Say done, then the reporter writes the report and publishes the verdict while the others
    wait for it; whoever hosts the store keeps it up until everyone said goodbye."""
    env, cfg, channel = ctx.env, ctx.cfg, ctx.channel
    # The reporter waits for every other rank's stages, and the others wait for its
    # verdict, so this deadline spans a whole run's stages, not one.
    report_deadline = cfg.run_deadline_s if env.store_host != "launcher" else cfg.timeout_s
    # A rank's own part of the stage (its collective record, "done") has the usual deadline, so a
    # rank stuck there is named as itself within --timeout; only the waiting that follows gets
    # the long one (else the reporter, waiting as long as the stuck rank, would be named too).
    with ctx.stage("report", deadline_s=cfg.timeout_s):
        if healthy:
            if ctx.backend:
                # torch's own record of every collective, compared across ranks by the report.
                channel.set(keys.flight_recorder(env.rank), fr_snapshot.take())
            channel.set(keys.done(env.rank), time.time())
        ctx.watchdog.arm("report", report_deadline)
        if env.is_reporter:
            outcome.code = _write_report(ctx, record, channel, command)
            channel.set(keys.VERDICT, outcome.code)
            outcome.reported = True
        else:
            if env.store_host != "launcher":
                # Wait for the verdict so the store (on rank 0) outlives nobody's reads, but
                # exit with our own health: torchrun names the first non-zero exit as the root
                # cause, and the verdict is rank 0's exit code and the report's.
                with ctx.collective("wait_for_verdict"):
                    channel.wait([keys.VERDICT], report_deadline - 1.0)
            outcome.code = 0 if healthy else 1
        channel.set(keys.bye(env.rank), time.time())
        if env.hosts_store:
            # Keep the store up until the others have read the verdict.
            channel.wait([keys.bye(r) for r in range(env.world_size)], 3.0)


def _after_termination(ctx: RankContext, record: RunRecord, side: SideChannel, command: list[str],
                       outcome: _Outcome) -> int:
    """A SIGTERM or Ctrl-C: under torchrun the agent stops every worker when one fails, so the
    reporter (or the first live rank to take over) names the one that failed."""
    env = ctx.env
    if outcome.reported:
        # srun --kill-on-bad-exit (or torchrun's agent) ends the step once another rank exits 1,
        # while this rank holds the store for the others' goodbyes: the report stands as written,
        # and rewriting it as "stopped" would replace the diagnosis with an interruption.
        return outcome.code
    side.set(keys.terminated(env.rank), time.time())
    code = outcome.code
    if env.store_host != "launcher":
        record.interrupted = "SIGTERM"
        try:
            code = 0
            if env.is_reporter or _take_over_reporting(side.channel, env):
                time.sleep(0.5)  # let the other ranks say they were terminated too
                code = _write_report(ctx, record, side.channel, command, wait=False, stopped=True)
        except Exception:
            pass
    return code if code else EXIT_UNKNOWN


def _process_gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False  # it exists (access denied, say): not known to be gone


def _is_dead(channel: Channel, env: LaunchEnv, rank: int, by_heartbeat: bool = True) -> bool:
    """A rank that ended without saying so: its process is gone, or (if by_heartbeat) its heartbeat is stale.

    A stale heartbeat alone cannot tell a dead rank on another host from a frozen one; only
    after the launcher's SIGTERM, when every live rank is being stopped, is it taken as death.
    """
    if channel.has(keys.terminated(rank)) or channel.has(keys.done(rank)):
        return False
    hello = channel.get(keys.hello(rank)) or {}
    # A pid means something only in the same kernel and pid namespace: containers on two hosts
    # may share a host name, so the machine identity (boot id + pid namespace) must match too.
    if hello.get("host") == env.hostname and hello.get("pid") and hello.get("machine") == machine_identity():
        return _process_gone(int(hello["pid"]))
    if not by_heartbeat:
        return False
    hb = channel.get(keys.heartbeat(rank)) or {}
    return time.time() - float(hb.get("t", 0)) > 2.0


def _take_over_reporting(channel: Channel, env: LaunchEnv) -> bool:
    """Rank 0 is the reporter; if it is the casualty, the first live rank to claim it reports."""
    if not _is_dead(channel, env, 0):
        return False
    return int(channel.store.add(keys.REPORTER_TAKEOVER, 1)) == 1


def _find_dead_ranks(channel: Channel, record: RunRecord, env: LaunchEnv, by_heartbeat: bool = True) -> None:
    for rank in range(env.world_size):
        if rank != env.rank and not channel.has(keys.error(rank)) and not channel.has(keys.timeout(rank)) \
                and _is_dead(channel, env, rank, by_heartbeat):
            record.dead[rank] = ("its process had ended before the launcher stopped the job; its exit status is "
                                 "known only to the launcher (torchrun prints it, with the rank's output)")


def _teardown() -> None:
    _remove_nccl_log()
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
