"""What does `ddpdoctor.Doctor` cost a training step? Side by side, in one run, on the same workload.

Every rank trains two identical DDP models on the same batches, in alternating blocks of
steps: one watched by a Doctor at its defaults (a comm hook, clocks per step, one
all_gather every 50 steps), one not. The overhead is the ratio of their median step
times, per block pair, then the median and the worst over pairs.

    python benchmarks/callback_overhead.py --nproc 2 --blocks 20 --block-steps 50
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import ddpdoctor

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def make() -> tuple:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512),
                                                      nn.ReLU(), nn.Linear(512, 10)))
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    watched, watched_opt = make()
    bare, bare_opt = make()
    doctor = ddpdoctor.Doctor(watched, watched_opt)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)

    def step(model, opt) -> None:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    ratios = []
    for block in range(args.blocks + 1):
        times = {"bare": [], "watched": []}
        for name in (("bare", "watched") if block % 2 else ("watched", "bare")):
            for _ in range(args.block_steps):
                t0 = time.perf_counter()
                if name == "watched":
                    with doctor.step((x, y)):
                        step(watched, watched_opt)
                else:
                    step(bare, bare_opt)
                times[name].append(time.perf_counter() - t0)
        if block:  # the first pair warms up
            ratios.append(statistics.median(times["watched"]) / statistics.median(times["bare"]))
    doctor.close()
    if rank == 0:
        ordered = sorted(ratios)
        print(f"step overhead over {len(ratios)} block pairs of {args.block_steps} steps: "
              f"median {100 * (statistics.median(ratios) - 1):+.2f}%, worst {100 * (ordered[-1] - 1):+.2f}%, "
              f"best {100 * (ordered[0] - 1):+.2f}%; findings: {[f.code for f in doctor.report()]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--block-steps", type=int, default=50)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--blocks", str(args.blocks),
                                       "--block-steps", str(args.block_steps)], env=env))
    return max(p.wait(timeout=1800) for p in procs)


if __name__ == "__main__":
    sys.exit(main())
