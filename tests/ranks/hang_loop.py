"""A user's DDP training loop with `ddpdoctor.Doctor(on_hang="exit")`, and one rank that makes it hang.

Started once per rank (torchrun, or RANK/WORLD_SIZE/MASTER_* set by hand as srun would), or
with `--spawn N --port P` (torch.multiprocessing.spawn, the tutorial pattern). `--case`:
- own: rank 1 blocks on a lock it already holds, inside step STEP (stuck in its own code);
- dead, frozen: rank 1 waits inside step STEP for the test to SIGKILL or SIGSTOP it from outside;
- desync: rank 1 calls an extra all_reduce of another shape inside step STEP;
- uneven: rank 1's shard is shorter: it leaves the loop after STEP - 1 steps, closes its Doctor
  and waits in the final barrier while rank 0 waits in the next step's all-reduce.
Rank 1 writes its pid and the time it starts to misbehave to JSON.culprit, for the test.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpdoctor

STEP = 6
STEPS = 12
BATCH = 16


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=("own", "dead", "frozen", "desync", "uneven"))
    parser.add_argument("--json", required=True)
    parser.add_argument("--deadline", type=float, default=3.0)
    parser.add_argument("--trace", default=None, help="the Doctor's trace_path (rank 0's timeline)")
    parser.add_argument("--spawn", type=int, default=0, help="start this many ranks with mp.spawn")
    parser.add_argument("--port", type=int, default=0, help="the MASTER_PORT an mp.spawn job hard-codes")
    return parser.parse_args()


def mark(json_path: str) -> None:
    with open(f"{json_path}.culprit", "w") as f:
        json.dump({"pid": os.getpid(), "t": time.time()}, f)


def misbehave(case: str, rank: int, step: int, json_path: str) -> None:
    """What rank 1 does at step STEP, inside the step."""
    if rank != 1 or step != STEP:
        return
    mark(json_path)
    if case == "own":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # a deadlock in the user's own code: never returns
    elif case in ("dead", "frozen"):
        time.sleep(3600)  # the test kills or stops this process from outside
    elif case == "desync":
        dist.all_reduce(torch.ones(3))  # rank 0 is in DDP's gradient all-reduce instead


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    if args.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    doctor = ddpdoctor.Doctor(model, optimizer, every=5, json_path=args.json, step_deadline_s=args.deadline,
                              on_hang="exit", trace_path=args.trace)
    steps = STEP - 1 if args.case == "uneven" and rank == 1 else STEPS
    g = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        x, y = torch.randn(BATCH, 32, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        with doctor.step((x, y)):
            misbehave(args.case, rank, step, args.json)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if steps < STEPS:
        mark(args.json)
    doctor.close()
    dist.barrier()  # the usual end of a loop: nobody leaves while another still needs the store
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    if args.spawn:
        import torch.multiprocessing as mp

        mp.spawn(train, args=(args.spawn, args), nprocs=args.spawn)
    else:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
