"""A DDP loop of about 5 ms steps with `ddpdoctor.Doctor` and no step deadline set, under torchrun
(tests/ranks/test_learned_deadline_e2e.py): the Doctor must learn what a step takes here.

`--case hang`: after `--steps` steps rank 1 blocks on a lock inside its step (rank 0 then
waits in the gradient all-reduce); it writes the wall time it blocked at to `--started`.
`--case healthy`: `--steps` irregular steps: every 50th step is 20x longer (logging), one
checkpoint-like pause of 3 s is marked with `expect_slow` on every rank, one unmarked 1 s
pause sits inside a step; the loop ends, and once the Doctor is closed each rank writes what its
clock learned from every step (clockRANK.json).
The sleeps stand for GPU work: the steps are as long as a real loop's, at little CPU cost
on a shared test machine.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpdoctor

STEP_S = 0.004  # plus the model's own step and the all-reduce: about 5 ms a step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("hang", "healthy"), required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--started", help="--case hang: where rank 1 writes when it blocked")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    doctor = ddpdoctor.Doctor(model, optimizer, json_path=args.json)  # no step_deadline_s: learned
    lock = threading.Lock()
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    for step in range(args.steps + (1 if args.case == "hang" else 0)):
        if args.case == "healthy" and step == args.steps // 2:
            with doctor.expect_slow("checkpoint"):  # between steps, on every rank: rank 0 saves, all wait
                if rank == 0:
                    time.sleep(3.0)
                dist.barrier()
        with doctor.step((x, y)):
            time.sleep(STEP_S * (20 if step % 50 == 49 else 1))
            if args.case == "healthy" and step == 3 * args.steps // 4 and rank == 1:
                time.sleep(1.0)  # an unmarked second: a slow write, a busy host
            if args.case == "hang" and step == args.steps and rank == 1:
                with open(args.started, "w") as out:
                    out.write(repr(time.time()))
                lock.acquire()
                lock.acquire()  # stuck in its own code, for good
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    # What the clock learned, for the test, once it has been told every step. The watchdog thread alone
    # feeds it, at each tick (WATCH_TICK_S, 0.5 s: Doctor.allowance_s), so read at the loop's end it lacked
    # the steps since the last tick, however many fit there on this host (1,450 of 1,501 seen on one twice
    # as fast, 1,466 here). Closed, the Doctor's watchdog is stopped; once it has ended, this thread hands
    # the clock the steps still queued as the watchdog does, and nothing else touches the clock meanwhile.
    doctor.close()
    doctor._hang._watchdog.join(timeout=30)
    assert not doctor._hang._watchdog.is_alive(), "the Doctor's watchdog outlived close()"
    doctor.allowance_s()
    Path(args.json).with_name(f"clock{rank}.json").write_text(json.dumps(doctor._clock.describe()))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
