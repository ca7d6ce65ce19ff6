"""Two ranks of plain DDP, rank 1 late to every step by --late-ms: the wait as DDP's reducer times it
(callback/reducer_wait.py) beside the same wait timed directly, step by step, by a comm hook.

The hook is the direct measurement the reducer's reading replaced (it times, per step, from the
launch of the last gradient bucket's all-reduce to its completion); here it is only the yardstick.
Rank r writes {"reducer": [...], "hook": [...], "samples": [...], "rate": R} to --json.r<r>: one entry
per window of --every steps, the reducer's window mean and the hook's mean over the same steps.
Started once per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpdoctor.callback.reducer_wait import ReducerWait


class HookTimer:
    def __init__(self) -> None:
        self.launch = 0.0
        self.done = 0.0


def timing_hook(state, bucket):  # unannotated: DDP's register_comm_hook checks annotations
    state.launch = time.perf_counter()
    buffer = bucket.buffer().div_(dist.get_world_size())

    def finished(fut):
        value = fut.value()[0]
        state.done = time.perf_counter()
        return value

    return dist.all_reduce(buffer, async_op=True).get_future().then(finished)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--late-ms", type=float, default=5.0)
    parser.add_argument("--step-ms-hint", type=float, default=2.0, help="what the sample rate is tuned from")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))
    timer = HookTimer()
    model.register_comm_hook(timer, timing_hook)
    wait = ReducerWait(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    out: dict = {"reducer": [], "hook": [], "samples": [], "rate": None}
    hooked: list[float] = []
    for step in range(1, args.steps + 1):
        if rank == 1:
            time.sleep(args.late_ms / 1e3)  # late to every step: its peer waits in the all-reduce
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hooked.append(1e3 * (timer.done - timer.launch))
        if step == 8:
            wait.tune(args.step_ms_hint)
            out["rate"] = wait.rate
        if step % args.every == 0:
            window = wait.take()
            # The reducer's record of step i is written at the forward of step i+1: the window it
            # reports ends one step earlier than the hook's.
            out["reducer"].append(window.mean_ms)
            out["samples"].append(window.samples)
            out["hook"].append(sum(hooked[:-1]) / max(1, len(hooked) - 1))
            hooked = hooked[-1:]
    with open(f"{args.json}.r{rank}", "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
