"""The standalone launcher: `ddpdoctor check` with no rank variables spawns local ranks.

Spawning and killing are plain subprocesses (`rank_processes`: each rank in its own
session, logs to files, SIGTERM then SIGKILL on close), started before the launcher
imports torch. Also here: a store that outlives the ranks and listens on loopback only,
deadlines for ranks that hang rather than exit, stacks of stuck ranks before they are
killed, a live view, and a report that is written whatever happened.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import shutil
import time
import uuid
from typing import Any, Optional

from ddpdoctor.runtime.channel import Channel
from ddpdoctor.runtime.rank_processes import RankProcesses
from ddpdoctor.runtime.config import CheckConfig
from ddpdoctor.core.errors import UsageError
from ddpdoctor.core.faults import check_ranks
from ddpdoctor.runtime.launch_env import BACKEND_VAR, DEVICE_VAR, LAUNCHER_PID_VAR, RUN_ID_VAR
from ddpdoctor.core.run_record import ExitInfo, RunRecord, signal_name
from ddpdoctor.runtime.channel import read_record

STOP_GRACE_S = 3.0  # SIGTERM → SIGKILL


GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")  # NVIDIA, ROCm, WSL


def no_gpu_here() -> bool:
    """Certainly no GPU torch could use: no NVIDIA, ROCm or WSL device file. Then the launcher
    decides CPU ranks without importing torch, and the ranks start 2 s sooner."""
    import glob

    return not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def default_nproc() -> int:
    if no_gpu_here():
        return 2
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 2


def resolve_backend(cfg: CheckConfig, nproc: int) -> tuple[str, str]:
    if cfg.device != "cuda" and cfg.backend != "nccl" and no_gpu_here():
        return "gloo", "cpu"  # torch's own checks follow once it is imported (check_torch_distributed)
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed: install a standard PyTorch wheel")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = cfg.device
    if device == "auto":
        # NCCL asked for by name runs on the GPUs there are, so too few of them is said as such below.
        device = "cuda" if gpus and (cfg.backend == "nccl" or (gpus >= nproc and cfg.backend != "gloo")) else "cpu"
    if device == "cuda" and gpus == 0:
        raise UsageError("--device cuda: torch sees no CUDA device here; use --device cpu")
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise UsageError("--backend nccl: this torch build has no NCCL (CPU-only wheel?); use --backend gloo")
        if device != "cuda":
            why = "torch sees none here" if not gpus else "--device cpu was given"
            raise UsageError(f"--backend nccl runs on GPUs, and {why}: use --backend gloo for CPU ranks")
        if gpus < nproc:
            # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") before 2.30, and from 2.30
            # only with NCCL_MULTI_RANK_GPU_ENABLE=1.
            raise UsageError(f"{nproc} ranks but {gpus} GPU{'' if gpus == 1 else 's'}: NCCL needs one GPU per rank "
                             f"(several ranks on one GPU only from NCCL 2.30, with NCCL_MULTI_RANK_GPU_ENABLE=1); "
                             f"use --nproc {gpus}, or --backend gloo for CPU ranks")
    check_torch_distributed(backend)
    return backend, device


def cpu_instead_of_gpus(cfg: CheckConfig, nproc: int, device: str) -> Optional[dict[str, int]]:
    """The GPUs left unused when the automatic choice fell back to CPU ranks for want of one GPU per
    rank (`allreduce-bench --nproc 2` on one H100 measured gloo on CPU and said OK): recorded in the
    run's settings, so the report says what was measured. None where nothing was left unused."""
    if device != "cpu" or cfg.device != "auto" or cfg.backend == "gloo" or no_gpu_here():
        return None
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"gpus": gpus, "ranks": nproc} if gpus else None


def check_torch_distributed(backend: str) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed: install a standard PyTorch wheel")
    if backend == "gloo" and not dist.is_gloo_available():
        raise UsageError("this torch build has no gloo backend: install a standard PyTorch wheel")


def _listen(port: Optional[int]) -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port or 0))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise UsageError(f"port {port} on 127.0.0.1 is not free ({exc.strerror}): choose another with --port, "
                         "or leave --port out to pick a free one") from None
    return sock, sock.getsockname()[1]


def _tail(path: Optional[str], lines: int = 20) -> list[str]:
    if not path:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16384))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


class _Interrupted(BaseException):
    """A signal to the launcher: BaseException, so no `except Exception` on the way swallows it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # Ctrl-C, kill, ssh gone, Ctrl-\\
_signalled: list[str] = []
# While set, a signal is only noted, and raised when the section ends: an exception raised
# inside `import torch` leaves a half-imported module ("cannot load module more than once
# per process") or is swallowed on the way, and the run would end as an internal error.
_deferred: list[bool] = []


def _raise_interrupted(signum: int, frame: Any) -> None:
    """Once: a second Ctrl-C while the first is being handled must not cut the cleanup short."""
    if _signalled:
        return
    _signalled.append(signal.Signals(signum).name)
    if not _deferred:
        raise _Interrupted(_signalled[0])


class _SignalsAfter:
    """A section a signal must not cut: it is raised as soon as the section is over."""

    def __enter__(self) -> None:
        _deferred.append(True)

    def __exit__(self, *exc: Any) -> None:
        _deferred.pop()
        if _signalled and not _deferred and exc[0] is None:
            raise _Interrupted(_signalled[0])


def run_standalone(cfg: CheckConfig, argv: list[str], command: list[str]) -> int:
    from ddpdoctor.core.behaviour_env import behaviour_settings
    from ddpdoctor.measure.host import users_environ
    from ddpdoctor.render.console import make_console, render_report
    from ddpdoctor.session import crash_retry
    from ddpdoctor.session.reporter import build_report, write_outputs

    nproc = cfg.nproc if cfg.nproc is not None else default_nproc()
    check_ranks(cfg.inject, nproc)
    backend, device = resolve_backend(cfg, nproc)
    settings = dict(cfg.settings)
    unused = cpu_instead_of_gpus(cfg, nproc, device)
    if unused:
        settings["cpu_instead_of_gpus"] = unused
    # What the ranks inherit from here that changes torch's, NCCL's, gloo's or CUDA's behaviour (a crash names it).
    settings["env_settings"] = behaviour_settings(users_environ())
    console = make_console()
    record = _run_ranks(cfg, argv, nproc, backend, device, settings, console)
    plan = crash_retry.plan(record, cfg)
    if plan is not None:
        console.print(f"ddpdoctor: stage {plan.stage} failed with {', '.join(plan.names)} set: trying it once more "
                      f"without {'it' if len(plan.names) == 1 else 'them'}", style="dim")
        record.settings["retried"] = crash_retry.run(
            plan, cfg, argv, lambda c, a, without: _run_ranks(c, a, nproc, backend, device, {}, console, without))
    report = build_report(record, backend, device, command)
    write_outputs(report, cfg)
    render_report(report, console, charts=cfg.live)
    return report.exit_code


def _run_ranks(cfg: CheckConfig, argv: list[str], nproc: int, backend: str, device: str, settings: dict[str, Any],
               console: Any, without: tuple[str, ...] = ()) -> RunRecord:
    """Spawn the ranks (`without`: variables of this environment they do not inherit), supervise them to the end,
    and return what the store recorded; every rank is stopped and the port is free when this returns."""
    from ddpdoctor.render.console import LiveView

    sock, port = _listen(cfg.port)  # bound and listening: ranks that connect early wait in its backlog
    run_id = uuid.uuid4().hex[:12]
    log_root = tempfile.mkdtemp(prefix="ddpdoctor-")
    threads = max(1, (os.cpu_count() or 1) // nproc)
    envs: dict[int, dict[str, str]] = {}
    for rank in range(nproc):
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            LAUNCHER_PID_VAR: str(os.getpid()), RUN_ID_VAR: run_id,
            BACKEND_VAR: backend, DEVICE_VAR: device, "PYTHONUNBUFFERED": "1",
            "TORCHELASTIC_RUN_ID": run_id,
        }
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(threads)))
        if backend == "gloo" and ("GLOO_SOCKET_IFNAME" not in os.environ or "GLOO_SOCKET_IFNAME" in without):
            env["GLOO_SOCKET_IFNAME"] = _loopback_ifname()
        envs[rank] = env
    record = RunRecord(world_size=nproc, mode="ddpdoctor", probes=cfg.probes, started=time.time(),
                       faults=tuple(f.describe() for f in cfg.inject), silent_after_s=cfg.silent_after_s,
                       settings=settings,
                       default_host=socket.gethostname())
    ranks = RankProcesses()
    _signalled.clear()
    _deferred.clear()
    channel: Optional[Channel] = None
    listen_fd: Optional[int] = None
    try:
        try:
            for sig in STOP_SIGNALS:
                signal.signal(sig, _raise_interrupted)
            ranks.start(list(argv), envs, log_root, without=without)
            with _SignalsAfter():
                # While the ranks import torch, so does the launcher: the store it hosts needs it.
                if backend == "gloo" and device == "cpu":
                    check_torch_distributed(backend)
                listen_fd = sock.detach()
                channel = Channel.connect("127.0.0.1", port, cfg.timeout_s, is_master=True, listen_fd=listen_fd)
            with LiveView(console, nproc, cfg.live) as view:
                _supervise(ranks, channel, record, cfg, view)
        except _Interrupted as exc:
            record.interrupted = exc.name
        except KeyboardInterrupt:
            record.interrupted = "SIGINT"
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup and the report short
        _deferred.clear()
        # A signal noted but never raised (it came as the run ended, or code on the way swallowed
        # the exception) still means the run was interrupted.
        record.interrupted = record.interrupted or (_signalled[0] if _signalled else "")
        _stop_all(ranks, record,
                  f"interrupted by {record.interrupted}" if record.interrupted else "ddpdoctor is exiting")
        for rank, path in ranks.stderrs.items():
            if rank in record.exits:
                record.exits[rank].log_tail = _tail(path)
        if channel is not None:
            try:
                read_record(channel, record)
            except (RuntimeError, OSError, ValueError):
                pass  # the store is gone: the report says what was read before
        elif listen_fd is not None:
            try:
                os.close(listen_fd)  # the store never took it: free the port
            except OSError:
                pass
        else:
            sock.close()
        shutil.rmtree(log_root, ignore_errors=True)
    del channel  # closes the store and frees the port
    return record


def _loopback_ifname() -> str:
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
                return name
    except Exception:
        pass
    return "lo"


def _stop_all(ranks: RankProcesses, record: RunRecord, reason: str) -> None:
    procs = ranks.procs
    now = time.time()
    for rank, proc in procs.items():
        if proc.poll() is None and rank not in record.exits:
            record.exits[rank] = ExitInfo(code=None, t=now, killed_by_us=reason)
    ranks.close(grace_s=STOP_GRACE_S)
    for rank, proc in procs.items():
        info = record.exits.setdefault(rank, ExitInfo(code=proc.poll(), t=time.time()))
        if info.code is None:
            info.code = proc.poll()
        info.signal = info.signal or signal_name(info.code)


FINISHING_GRACE_S = 5.0


def _finishing(record: RunRecord, rank: int, now: float) -> bool:
    """A rank that has published its own timeout is writing its stacks and Flight Recorder
    before it exits: let it, for a few seconds, or the report loses torch's view of its wait."""
    t = (record.timeouts.get(rank) or {}).get("t")
    return isinstance(t, (int, float)) and now - float(t) < FINISHING_GRACE_S


def _request_stacks(proc: Any) -> None:
    """SIGUSR1: the rank's faulthandler writes every thread's stack to its log."""
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        pass


def _supervise(ranks: RankProcesses, channel: Channel, record: RunRecord, cfg: CheckConfig, view: Any) -> None:
    """Poll until every rank has exited; end the ones that are stuck, with their stacks."""
    procs = ranks.procs
    first_failure: Optional[float] = None
    # Once a rank has died the run cannot complete: give the others a moment to publish
    # what they were doing (their heartbeats already say where they wait), then stop them.
    grace_s = min(cfg.timeout_s, 2.0)
    while True:
        now = time.time()
        for rank, proc in procs.items():
            code = proc.poll()
            if code is not None and rank not in record.exits:
                record.exits[rank] = ExitInfo(code=code, t=now,
                                              signal=signal_name(code))
                if code != 0 and first_failure is None:
                    first_failure = now
        try:
            read_record(channel, record)
        except (RuntimeError, OSError, ValueError):
            pass  # a store hiccup: the next poll reads again (signals must pass through)
        states = {r: ("exited %s" % record.exits[r].code) if r in record.exits else "running" for r in procs}
        view.update(record.heartbeats, states)
        running = [r for r in procs if r not in record.exits]
        if not running:
            return
        to_stop: dict[int, str] = {}
        # Once every rank that did join has finished or failed, nobody waits for the rest:
        # their peers already gave them the rendezvous deadline.
        joined_all_over = bool(record.hellos) and all(r in record.exits for r in record.hellos)
        for rank in running:
            hb = record.heartbeats.get(rank)
            if hb is None:
                if now - record.started > cfg.startup_allowance_s:
                    to_stop[rank] = f"silent: no heartbeat {cfg.startup_allowance_s:g}s after start"
                elif joined_all_over and rank not in record.hellos:
                    to_stop[rank] = "never joined: every rank that did has already ended"
            elif now - float(hb["t"]) > cfg.silent_after_s:
                to_stop[rank] = f"silent: no heartbeat for {now - float(hb['t']):.1f}s"
            elif now - float(hb.get("stage_started", now)) > cfg.run_deadline_s + 10:
                to_stop[rank] = f"stuck in stage {hb.get('stage')} past every deadline"
            elif first_failure is not None and now - first_failure > grace_s and not _finishing(record, rank, now) and (
                    hb.get("collective") or now > float(hb.get("stage_started", now)) + cfg.timeout_s + 1):
                # Only ranks waiting on a peer, or past their own deadline: a rank stuck in its
                # own code gets its stage deadline, so its watchdog can say where it is.
                to_stop[rank] = f"stopped {grace_s:g}s after another rank failed"
        if to_stop:
            for rank in to_stop:
                _request_stacks(procs[rank])
            time.sleep(0.5)
            for rank, reason in to_stop.items():
                record.exits[rank] = ExitInfo(code=None, t=time.time(), killed_by_us=reason)
                try:
                    os.killpg(procs[rank].pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    procs[rank].wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass  # stuck in the kernel (D state): recorded as still running
                record.exits[rank].code = procs[rank].poll()
                record.exits[rank].signal = signal_name(record.exits[rank].code)
        time.sleep(0.1)
