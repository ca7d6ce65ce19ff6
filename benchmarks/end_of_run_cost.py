"""What the end of the run costs (issue 53): the close on real ranks, the judging of a large job, a rank gone.

    python benchmarks/end_of_run_cost.py                 # all three
    python benchmarks/end_of_run_cost.py --part judge --ranks 256

- close: 2 gloo ranks (pinned one to a core) train --steps steps under the Doctor at its defaults, then each
  times its `close()` (the final check: its row written to the store, rank 0's wait, the whole run judged, the
  summary made and printed, the JSON written), --runs times; the medians per rank.
- judge: rank 0's judging at the end of a job of --ranks ranks, on a synthetic table of the shape the checks
  keep (the run's windows at their bound: 1024 steps a rank in 8 windows of 128, step times with noise, one
  rank 30% slower): the stragglers' verdict on the run's windows, the data rules on the last table, the summary
  from a ledger that folded every window. Timed in this process, --runs times; the median.
- gone: rank 1 exits after its last step without closing; rank 0's close is timed (its process is known gone
  at once), and again with rank 1 alive but busy (silent: rank 0 waits out its deadline, 2 to 5 s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(steps: int, out: str, after: str) -> None:
    """One rank: a small DDP model, `steps` steps under the Doctor, its close() timed into OUT.rankN."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import ddpdoctor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    doctor = ddpdoctor.Doctor(model, opt, json_path=os.path.join(os.path.dirname(out), "doctor.json"), summary=True)
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    for _ in range(steps):
        with doctor.step((x, y)):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if rank == 1 and after == "die":
        os._exit(0)
    if rank == 1 and after == "busy":
        time.sleep(8.0)
    began = time.perf_counter()
    doctor.close()
    took = time.perf_counter() - began
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"close_ms": 1e3 * took, "waited_ms": (doctor.summary or {}).get("final_check", {}).get("waited_ms")},
                  f)
    if after == "close":
        dist.barrier()
    dist.destroy_process_group()


def run_ranks(steps: int, after: str) -> dict[int, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cost")
        port = _port()
        env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs = [subprocess.Popen(["taskset", "-c", str(r), sys.executable, __file__, "--worker", "--steps", str(steps),
                                   "--out", out, "--after", after], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
        for p in procs:
            p.wait(timeout=300)
        return {r: json.load(open(f"{out}.rank{r}")) for r in range(2) if os.path.exists(f"{out}.rank{r}")}


def judge_cost(ranks: int, runs: int) -> list[float]:
    """Rank 0's end-of-run judging on a synthetic job of `ranks` ranks, in ms, `runs` times."""
    from ddpdoctor.callback.online_checks import RankWindow, RunHistory, data_findings
    from ddpdoctor.callback.row import GatheredRow
    from ddpdoctor.callback.run_summary import RunLedger, summary
    from ddpdoctor.judge import causal_order
    from ddpdoctor.probes.base import RunView
    from ddpdoctor.probes.stragglers.scores import diagnose_stragglers

    rng = random.Random(0)

    def window(r: int, k: int) -> tuple[RankWindow, GatheredRow]:
        slow = 1.3 if r == 7 else 1.0
        step = [10.0 * slow * (1 + 0.05 * rng.random()) for _ in range(128)]
        wait = [max(0.0, 13.0 - s) for s in step]
        data = [0.5] * 128
        samples = [32.0] * 128
        w = RankWindow(rank=r, host=f"node{r // 8}", step=128 * k, step_ms=step, data_ms=data, wait_ms=wait,
                       samples=samples, fingerprint=r + 1, loader_len=1000, stale_epoch=False, peak_mem_bytes=2**30)
        g = GatheredRow(rank=r, steps_done=128 * k, window_steps=128, window_s=1.6, step_ms=step, data_ms=data,
                        wait_ms=wait, samples=samples)
        return w, g

    tables = [{r: window(r, k) for r in range(ranks)} for k in range(1, 9)]
    out = []
    for _ in range(runs):
        began = time.perf_counter()
        run, ledger = RunHistory(), RunLedger()
        hosts = {r: f"node{r // 8}" for r in range(ranks)}
        for table in tables:  # at the checks, off the end: folded as they came
            ledger.add({r: g for r, (_, g) in table.items()}, hosts)
            run.add({r: w for r, (w, _) in table.items()}, 1.6)
        folded = time.perf_counter()
        found = data_findings({r: w for r, (w, _) in tables[-1].items()})
        found += diagnose_stragglers(run.facts(), RunView(world_size=ranks, hosts=hosts))
        s = summary(ledger, causal_order.ordered(found, keep_order=True), ranks, 20.0, {}, 0.0, 12.8)
        out.append(1e3 * (time.perf_counter() - folded))
        assert s["ranks"] and len(s["ranks"]) == ranks
        print(f"  judged {ranks} ranks in {out[-1]:.0f} ms (folding the 8 tables at the checks: "
              f"{1e3 * (folded - began):.0f} ms); verdict: {s['verdict'][:100]}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "close", "judge", "gone"), default="all")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--after", default="close", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.out, args.after)
        return 0
    if args.part in ("all", "close"):
        closes = [run_ranks(args.steps, "close") for _ in range(args.runs)]
        for r in (0, 1):
            ms = [c[r]["close_ms"] for c in closes if r in c]
            print(f"close() on rank {r}, 2 ranks, {args.steps} steps: median {statistics.median(ms):.1f} ms "
                  f"(runs: {', '.join(f'{m:.1f}' for m in ms)})")
    if args.part in ("all", "judge"):
        ms = judge_cost(args.ranks, args.runs)
        print(f"the end's judging of {args.ranks} ranks: median {statistics.median(ms):.0f} ms")
    if args.part in ("all", "gone"):
        for after in ("die", "busy"):
            got = run_ranks(args.steps, after)
            print(f"rank 1 {'gone' if after == 'die' else 'busy 8 s'} at the end: rank 0's close() took "
                  f"{got[0]['close_ms']:.0f} ms, of which waiting {got[0]['waited_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
