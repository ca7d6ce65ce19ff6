"""What does `ddpdoctor.Doctor` cost a training step? Side by side, in one process, on short steps.

For each step shape (a target step time: 0.5, 2 and 10 ms by default), every rank builds two
identical DDP models on the same data, one watched by a Doctor at its defaults (checks every 50
steps but at most every 2 s, the all-reduce wait read from DDP's reducer), one not, and trains them
in alternating blocks of about --block-s seconds. A block's time is its whole wall time over its
steps (a mean, so the checks are counted: a median would hide them). The overhead of a pair is the
watched block's time over the bare one's; the table gives the median over --pairs pairs (the first
pair warms up and is not counted), in percent and in microseconds a step, and the worst pair.

The time inside the Doctor's calls (step path and checks, amortised over the steps) is then read on
--pairs more watched blocks run back to back: in the alternation the Doctor's clock runs through the
bare blocks too, and its checks, which are by time, come about twice as often a watched second.

Beside it, the CPU time the Doctor's own threads took (the step watchdog, the stop clock) per second
of wall time: they run through both kinds of block alike, so the pairs cannot see them.

    python benchmarks/callback_overhead.py                          # 2 CPU ranks, 0.5/2/10 ms, 9 pairs
    python benchmarks/callback_overhead.py --nproc 1 --pairs 15     # one rank: less noise from the other
    python benchmarks/callback_overhead.py --device cuda --nproc 1  # on a GPU (NCCL)
    python benchmarks/callback_overhead.py --check-every-s 0        # the checks by count alone (every 50)
    python benchmarks/callback_overhead.py --via run                # the Doctor attached as `ddpdoctor run` does

--via run: the watched model's Doctor is attached by `ddpdoctor run`'s hooks (attach/step_hooks.py: the DDP
constructor, then the step's begin called from DDP's own `_pre_forward`, its optimizer's step post hook, and the
loss hook while it looks), not called by the loop; the bare model is built before the attachment is installed,
so it is never watched. "Inside the Doctor" is then the time in those hooks' calls (the Doctor's step_end
included); what torch's own hook dispatch costs (the optimizer's step hook loop; the loss hook, while it looks,
takes the forward off `Module.__call__`'s fast path) is in the pairs' wall time and thread CPU, not there.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

IN, OUT, BATCH = 256, 10, 64


def _model(width: int, device: str):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, OUT)).to(device)


def _ddp(width: int, device: str):  # type: ignore[no-untyped-def]
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model(width, device), device_ids=[torch.cuda.current_device()]
                                    if device == "cuda" else None)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _steps(model, opt, x, y, n: int, doctor=None) -> float:  # type: ignore[no-untyped-def]
    """n steps, the wall time they took (the GPU's queue drained at both ends)."""
    return _timed(model, opt, x, y, n, doctor)[0]


def _time_calls(owner, name: str, record, item: bool = False) -> None:  # type: ignore[no-untyped-def]
    """`owner.name(...)` replaced, on this object, by the same call with its wall time given to `record(seconds)`
    (`item`: `owner[name]`, a dict's entry)."""
    inner = owner[name] if item else getattr(owner, name)

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            record(time.perf_counter() - began)
    if item:
        owner[name] = timed
    else:
        setattr(owner, name, timed)


class _Split:
    """Where the time inside the Doctor goes, on the back-to-back blocks: the step path (steps without a
    check) apart from the checks, and a check's parts (its window row, the gather, the judging, the
    replica comparison), timed around the Doctor's own methods. Measuring only: nothing is changed."""

    PARTS = ("_window_row", "_judge_rows", "_compare_replicas")

    def __init__(self, doctor) -> None:  # type: ignore[no-untyped-def]
        self.doctor = doctor
        self.path_s: list[float] = []
        self.check_s: list[float] = []
        self.parts: dict[str, list[float]] = {}
        for name in self.PARTS:
            self._wrap(doctor, name, name.strip("_"))
        self._wrap(doctor._gather, "exchange", "gather")

    def _wrap(self, owner, name: str, key: str) -> None:  # type: ignore[no-untyped-def]
        _time_calls(owner, name, self.parts.setdefault(key, []).append)

    def step(self, seconds: float, next_check_before: int) -> None:
        (self.check_s if self.doctor._next_check != next_check_before else self.path_s).append(seconds)

    def summary(self) -> dict:
        if not self.path_s:
            return {}
        return {"path_us": round(1e6 * statistics.mean(self.path_s), 2),
                "path_us_median": round(1e6 * statistics.median(self.path_s), 2),
                "checks": len(self.check_s), "check_ms": round(1e3 * statistics.mean(self.check_s), 2) if self.check_s
                else None, "check_parts_ms": {k: round(1e3 * statistics.mean(v), 2) for k, v in self.parts.items()}}


class _HookMeter:
    """--via run: the wall time in the attachment's calls on the step path, summed (nothing else changed)."""

    def __init__(self, attacher, model, optimizer) -> None:  # type: ignore[no-untyped-def]
        self.total = 0.0
        _time_calls(attacher.tap, "_after", self._add)  # the loss hook, while it looks (a WeakHook calls it)
        # The attached Doctor's own hooks (_BeginStep, _EndStep: slotted callables), each timed where it is kept:
        # a DDP model's _BeginStep in the table DDP's wrapped _pre_forward reads, a forward pre-hook otherwise.
        from ddpdoctor.attach.step_hooks import _BEGINS

        for hooks in (_BEGINS, model._forward_pre_hooks, optimizer._optimizer_step_post_hooks):
            for key in list(hooks):
                if type(hooks[key]).__name__ in ("_BeginStep", "_EndStep"):
                    holder = {"call": hooks[key]}
                    _time_calls(holder, "call", self._add, item=True)
                    hooks[key] = holder["call"]

    def _add(self, seconds: float) -> None:
        self.total += seconds


def _timed(model, opt, x, y, n: int, doctor=None, split: "_Split | None" = None,  # type: ignore[no-untyped-def]
           meter: "_HookMeter | None" = None) -> tuple[float, float, float, float]:
    """n steps: (wall, this thread's CPU, the whole process's CPU, wall inside the Doctor's calls) seconds.
    `meter`: the Doctor is attached by hooks (--via run), not called here; the time in them is read off it."""
    import torch.nn.functional as F

    clock = time.perf_counter
    inside = -meter.total if meter is not None else 0.0
    _sync(x.device.type)
    began, thread0, process0 = clock(), time.thread_time(), time.process_time()
    for _ in range(n):
        if doctor is not None:
            t0 = clock()
            doctor.step_begin((x, y))
            here = clock() - t0
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if doctor is not None:
            planned = doctor._next_check
            t0 = clock()
            doctor.step_end()  # the checks included
            here += clock() - t0
            inside += here
            if split is not None:
                split.step(here, planned)
    _sync(x.device.type)
    if meter is not None:
        inside += meter.total
    return clock() - began, time.thread_time() - thread0, time.process_time() - process0, inside


def _calibrate(target_ms: float, device: str) -> tuple[int, float]:
    """The width whose bare DDP step takes about target_ms here, and the step it gives (rank 0 decides)."""
    import torch

    x = torch.randn(BATCH, IN, device=device)
    y = torch.randint(0, OUT, (BATCH,), device=device)
    measured: dict[int, float] = {}
    for width in (16, 64, 256, 1024, 2048, 4096):
        model, opt = _ddp(width, device)
        _steps(model, opt, x, y, 5)
        n = 30
        measured[width] = _from_rank0(1e3 * _steps(model, opt, x, y, n) / n, device)
        if measured[width] >= target_ms:
            break
    widths = sorted(measured)
    best = min(widths, key=lambda w: abs(measured[w] - target_ms))
    above = [w for w in widths if measured[w] >= target_ms]
    if above and above[0] != widths[0]:  # interpolate between the two around the target (compute ~ width^2)
        hi = above[0]
        lo = widths[widths.index(hi) - 1]
        share = (target_ms - measured[lo]) / max(1e-9, measured[hi] - measured[lo])
        best = int((lo ** 2 + share * (hi ** 2 - lo ** 2)) ** 0.5)
    width = int(_from_rank0(best, device))
    model, opt = _ddp(width, device)
    _steps(model, opt, x, y, 5)
    return width, _from_rank0(1e3 * _steps(model, opt, x, y, 30) / 30, device)


def _from_rank0(value: float, device: str) -> float:
    """Rank 0's value on every rank (NCCL broadcasts device tensors only)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.broadcast(tensor, 0)
    return float(tensor.item())


def _thread_cpu_s(prefix: str = "ddpdoctor") -> float:
    """CPU seconds of this process's Python threads whose name starts with `prefix` (Linux /proc)."""
    import threading

    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():
        if not thread.name.startswith(prefix) or thread.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def shape(target_ms: float, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    import ddpdoctor

    device = args.device
    width, calibrated = _calibrate(target_ms, device)
    bare, bare_opt = _ddp(width, device)
    options = {} if args.check_every_s is None else {"check_every_s": args.check_every_s}
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(BATCH, IN, generator=g).to(device)
    y = torch.randint(0, OUT, (BATCH,), generator=g).to(device)
    meter = None
    if args.via == "run":  # as `ddpdoctor run` attaches: built after the hooks are in, found at its first step
        from ddpdoctor import autorun
        from ddpdoctor.attach.settings import RunSettings

        attacher = autorun.start(RunSettings(options=dict(options, summary=False)))
        watched, watched_opt = _ddp(width, device)
        _timed(watched, watched_opt, x, y, 1)  # its first training forward attaches the Doctor
        doctor, meter = attacher.doctor, _HookMeter(attacher, watched, watched_opt)
    else:
        watched, watched_opt = _ddp(width, device)
        doctor = ddpdoctor.Doctor(watched, watched_opt, **options)
    called = None if meter is not None else doctor  # the loop calls the Doctor itself, or the hooks do
    # Every rank runs as many steps a block: the collectives must match.
    n = int(_from_rank0(max(20, int(args.block_s * 1e3 / max(calibrated, 0.05))), device))
    bare_ms, watched_ms = [], []
    cpu: dict[str, list[tuple[float, float]]] = {"bare": [], "watched": []}  # (thread, process) ms a step
    inside_us: list[float] = []  # per counted watched block: µs a step inside step_begin and step_end
    threads_before, wall_before = _thread_cpu_s(), time.perf_counter()
    counted_from = 0
    for pair in range(args.pairs + 1):
        order = ("bare", "watched") if pair % 2 else ("watched", "bare")
        for name in order:
            if name == "bare":
                wall, thread, process, _ = _timed(bare, bare_opt, x, y, n)
                bare_ms.append(1e3 * wall / n)
            else:
                if pair == 1:
                    counted_from = doctor._steps
                wall, thread, process, inside = _timed(watched, watched_opt, x, y, n, called, meter=meter)
                watched_ms.append(1e3 * wall / n)
                if pair:
                    inside_us.append(1e6 * inside / n)
            cpu[name].append((1e3 * thread / n, 1e3 * process / n))
    threads_cpu = _thread_cpu_s() - threads_before  # the threads live as long as the Doctor: read before close
    wall = time.perf_counter() - wall_before
    steps_watched = doctor._steps  # the alternated blocks' (the back-to-back ones below are not counted there)
    # The time inside the Doctor, read again on watched blocks back to back, as a user's loop runs: in the
    # alternation its clock also counts the bare blocks, so it takes the steps for twice as long and checks
    # about twice as often a watched second as it would (its checks are by time: check_every_s).
    continuous_us: list[float] = []
    split = _Split(doctor)
    for block in range(args.pairs + 1):
        inside = _timed(watched, watched_opt, x, y, n, called, split if block and called is not None else None,
                        meter=meter)[3]
        if block:
            continuous_us.append(1e6 * inside / n)
    findings = [f"{f.code} {f.severity.label}" for f in doctor.report()]
    doctor.close()
    ratios = [w / b for w, b in zip(watched_ms[1:], bare_ms[1:])]
    extra_us = [1e3 * (w - b) for w, b in zip(watched_ms[1:], bare_ms[1:])]
    return {"target_ms": target_ms, "width": width, "bare_ms": round(statistics.median(bare_ms[1:]), 4),
            "watched_ms": round(statistics.median(watched_ms[1:]), 4), "steps_per_block": n, "pairs": len(ratios),
            "overhead_pct": round(100 * (statistics.median(ratios) - 1), 2),
            "overhead_us": round(statistics.median(extra_us), 1),
            "worst_pct": round(100 * (max(ratios) - 1), 2), "best_pct": round(100 * (min(ratios) - 1), 2),
            "pair_pcts": [round(100 * (r - 1), 1) for r in ratios],
            # The CPU the training thread (and the whole process: gloo's, the Doctor's threads) spent a
            # step more when watched: what the callback adds, without the wall clock's noise.
            "thread_cpu_us": round(statistics.median(1e3 * (w[0] - b[0]) for w, b in zip(cpu["watched"][1:],
                                                                                        cpu["bare"][1:])), 1),
            "process_cpu_us": round(statistics.median(1e3 * (w[1] - b[1]) for w, b in zip(cpu["watched"][1:],
                                                                                         cpu["bare"][1:])), 1),
            "bare_thread_cpu_ms": round(statistics.median(b[0] for b in cpu["bare"][1:]), 4),
            # Timed around the Doctor's calls in the watched blocks (checks included, amortised): the
            # training thread's time the callback takes, measured directly, not as a noisy difference.
            "inside_us": round(statistics.mean(continuous_us), 2),
            "inside_us_max_block": round(max(continuous_us), 2),
            "inside_alternated_us": round(statistics.mean(inside_us), 2),
            "threads_cpu_ms_per_s": round(1e3 * threads_cpu / wall, 2), **split.summary(),
            "watched_steps": steps_watched - counted_from, "wait_measured": doctor.wait_measured,
            "findings": findings}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    if args.pin:  # one core a rank: this VM's cores differ in speed, and a thread that moves between them
        os.sched_setaffinity(0, {int(os.environ["RANK"]) % (os.cpu_count() or 1)})  # changes its step's CPU time
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rows = [shape(float(ms), args) for ms in args.shapes.split(",")]
    if dist.get_rank() == 0:
        print(json.dumps({"nproc": dist.get_world_size(), "device": args.device, "rows": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shapes", default="0.5,2,10", help="target step times in ms (comma-separated)")
    parser.add_argument("--pairs", type=int, default=9, help="block pairs counted (one more warms up)")
    parser.add_argument("--block-s", type=float, default=2.5, help="seconds of steps per block")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--check-every-s", type=float, default=None, help="the Doctor's (default: its own)")
    parser.add_argument("--pin", action="store_true", help="pin rank r to core r (as srun --cpu-bind=cores)")
    parser.add_argument("--json", help="write the table's numbers here")
    parser.add_argument("--via", choices=("doctor", "run"), default="doctor",
                        help="run: the Doctor attached by `ddpdoctor run`'s hooks, not called by the loop")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    port = _port()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--shapes", args.shapes, "--pairs", str(args.pairs),
           "--block-s", str(args.block_s), "--device", args.device, "--via", args.via]
    if args.check_every_s is not None:
        cmd += ["--check-every-s", str(args.check_every_s)]
    if args.pin:
        cmd.append("--pin")
    # --via run: one job a shape. The attachment lives as long as its process, and would find the next shape's
    # calibration and bare models (built after it is installed) and attach to the first that steps.
    shapes = args.shapes.split(",") if args.via == "run" else [args.shapes]
    result: dict = {}
    for one in shapes:
        shaped = [*cmd[:cmd.index("--shapes") + 1], one, *cmd[cmd.index("--shapes") + 2:]]
        port = _port()
        procs = [subprocess.Popen(shaped, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.nproc),
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                                  stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True)
                 for r in range(args.nproc)]
        out, _ = procs[0].communicate()
        for proc in procs[1:]:
            proc.wait()
        got = json.loads(out.strip().splitlines()[-1])
        result = dict(got, rows=result.get("rows", []) + got["rows"])
    pinned = " pinned" if args.pin else ""
    setting = "" if args.check_every_s is None else f" but check_every_s={args.check_every_s:g}"
    via = ", attached by `ddpdoctor run`'s hooks" if args.via == "run" else ""
    print(f"{result['nproc']} rank(s){pinned}, {result['device']}, median of {args.pairs} alternated block pairs "
          f"of ~{args.block_s:g} s; the Doctor at its defaults{setting}{via}")
    print("| target step | bare step | inside the Doctor a step, back to back (worst block; alternated) | share of the step "
          "| wall, A/B pairs (worst) "
          "| training thread's CPU, A/B | Doctor's threads (CPU ms/s) | findings |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['target_ms']:g} ms | {r['bare_ms']:.3f} ms | {r['inside_us']:.1f} µs (worst block "
              f"{r['inside_us_max_block']:.1f}; {r['inside_alternated_us']:.1f}) | "
              f"{100 * r['inside_us'] / 1e3 / r['bare_ms']:.2f}% | "
              f"{r['overhead_pct']:+.2f}% ({r['worst_pct']:+.1f}%) | {r['thread_cpu_us']:+.1f} µs | "
              f"{r['threads_cpu_ms_per_s']:.2f} | {', '.join(r['findings']) or 'none'} |")
    print("\nWhere the time inside the Doctor goes (the back-to-back blocks): the step path on steps without a check, "
          "and the checks with their parts")
    for r in result["rows"]:
        if "path_us" in r:
            print(f"- {r['target_ms']:g} ms: path {r['path_us']:.1f} µs a step (median {r['path_us_median']:.1f}); "
                  f"{r['checks']} checks of {r['check_ms']} ms: {r['check_parts_ms']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
