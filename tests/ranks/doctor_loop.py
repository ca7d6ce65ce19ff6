"""A real DDP training loop with `ddpdoctor.Doctor` in it, as a user would write one.

Started once per rank by tests/ranks/test_doctor_e2e.py with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set. `--case` picks the bug the loop really has.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import ddpdoctor
from ddpdoctor.slow_compute import spin

BATCH = 32
BATCHES = 8  # per rank and epoch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", help="comma-separated: healthy, nosampler, noepoch, uneven, straggler, hang")
    parser.add_argument("--json", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    cases = set(args.case.split(","))
    ddpdoctor.watch(timeout_s=60.0, json_path=args.json)  # a healthy start reports nothing
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    n = BATCH * BATCHES * world
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 4, (n,), generator=g))
    sampler = None
    if "nosampler" in cases:
        loader = DataLoader(data, batch_size=BATCH, shuffle=False)  # the tutorial bug: every rank, every sample
    elif "uneven" in cases:
        # The last rank's shard is two batches short (a hand-made split, no DistributedSampler padding).
        size = BATCH * (BATCHES - 2 if rank == world - 1 else BATCHES)
        loader = DataLoader(Subset(data, range(rank * BATCH * BATCHES, rank * BATCH * BATCHES + size)),
                            batch_size=BATCH)
    else:
        sampler = DistributedSampler(data, shuffle=True, seed=3)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    doctor = ddpdoctor.Doctor(model, optimizer, loader=loader, every=args.every, json_path=args.json,
                              step_deadline_s=3.0, on_hang="exit")
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    for epoch in range(args.epochs):
        if sampler is not None and "noepoch" not in cases:
            sampler.set_epoch(epoch)
        for x, y in loader:
            if "uneven" in cases and step >= BATCHES - 3:
                break  # stop before the short rank runs out (the real job would hang there)
            with doctor.step((x, y)):
                if "straggler" in cases and rank == 1:
                    spin(0.004)  # a rank whose compute really takes longer
                if "hang" in cases and rank == 1 and step == 12:
                    time.sleep(3600)  # stuck in its own code: the others wait in the all-reduce
                loss = loss_fn(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            step += 1
    doctor.close()
    dist.barrier()  # rank 0 hosts the store: nobody leaves while another still needs it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
