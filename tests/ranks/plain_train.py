"""A DDP training script as users write them, with nothing of ddpdoctor in it: `ddpdoctor run` attaches.

The same faults as tests/ranks/doctor_loop.py (which calls the Doctor by hand), made the same ways, so the two
can be compared verdict for verdict. Started like users start theirs:
- once per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun, or a test's env), or with SLURM_PROCID
  and SLURM_NTASKS (srun) and a tcp:// rendezvous;
- `--spawn N --port P`: one process that mp.spawns its ranks (`run_rank`, a function of this script, pickled).
`--record PATH`: each process writes what it saw of itself (its __name__, sys.argv, sys.path[0], whether a
sibling module imported): `ddpdoctor run` must change none of it. `--exit N` ends the script with sys.exit(N)
after training; `--raise` raises from inside the loop at step 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from plain_train_data import BATCH, make_data  # a sibling module: sys.path[0] is this script's folder


def spin(seconds: float) -> None:
    """Busy work that ends by the clock: a floor every host keeps."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class WithLoss(nn.Module):
    """A model whose forward returns the loss (as Hugging Face models do when given labels)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="healthy",
                   help="comma-separated: healthy, slowdata, noepoch, nosampler, backward, die, accum, loss_in_model, "
                        "compile (torch.compile of the DDP model), nan (rank 1's inputs NaN from step 11), fsdp (FSDP, not DDP)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--spin-ms", type=float, default=25.0)
    p.add_argument("--floor-ms", type=float, default=0.0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--record", default=None)
    p.add_argument("--exit", type=int, default=None)
    p.add_argument("--raise", dest="raise_", action="store_true")
    p.add_argument("--destroy", action="store_true", help="end with dist.destroy_process_group()")
    return p.parse_args(argv)


def record(path: str, rank: object) -> None:
    with open(f"{path}.{rank}", "w") as f:
        json.dump({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
                   "sibling": "plain_train_data" in sys.modules, "main_module": sys.modules["__main__"].__name__
                   if hasattr(sys.modules["__main__"], "__name__") else None}, f)


def run_rank(rank: int, world: int, args: argparse.Namespace) -> None:
    cases = set(args.case.split(","))
    if args.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    elif "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
    if args.record:
        record(args.record, rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
    inner = WithLoss(net) if "loss_in_model" in cases else net
    if "fsdp" in cases:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(inner, device_id=torch.device("cpu"))
    else:
        model = DistributedDataParallel(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if "compile" in cases:
        model = torch.compile(model)  # type: ignore[assignment]
    data = make_data(world)
    sampler = None
    if "nosampler" in cases:
        loader = DataLoader(data, batch_size=BATCH, shuffle=False)  # the tutorial bug: every rank, every sample
    else:
        sampler = DistributedSampler(data, shuffle=True, seed=3)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    if "backward" in cases and rank == 1:
        first = next(p for p in model.parameters() if p.dim() == 2)
        first.register_hook(lambda grad: (spin(args.spin_ms / 1e3), grad)[1])
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    for epoch in range(args.epochs):
        if sampler is not None and "noepoch" not in cases:
            sampler.set_epoch(epoch)
        for x, y in loader:
            if "slowdata" in cases and rank == 1:
                time.sleep(args.slow_ms / 1e3)  # a loader that really takes longer on this rank
            if args.floor_ms:
                time.sleep(args.floor_ms / 1e3)
            if "nan" in cases and rank == 1 and step >= 10:
                x = x * float("nan")  # a corrupt sample on this rank from its 11th step
            if args.raise_ and step == 3 and rank == 1:
                raise RuntimeError("the script's own error at step 3")
            optimizer.zero_grad()
            if "accum" in cases:  # gradient accumulation: two forwards, one optimizer step
                for k, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
                    if k == 0:
                        with model.no_sync():
                            loss_fn(model(xs), ys).backward()
                    else:
                        loss_fn(model(xs), ys).backward()
            elif "loss_in_model" in cases:
                model(x, y).backward()
            else:
                loss_fn(model(x), y).backward()
            optimizer.step()
            step += 1
    print(f"rank {rank}: trained {step} steps", flush=True)
    if "die" in cases and rank == 1:
        os._exit(0)
    if args.destroy or "die" in cases:
        dist.destroy_process_group()
    else:
        dist.barrier()
        dist.destroy_process_group()
    if args.exit is not None and not args.spawn:  # an mp.spawn job's parent exits (main)
        sys.exit(args.exit)


def main() -> None:
    args = parse(sys.argv[1:])
    if args.spawn:
        import torch.multiprocessing as mp

        if args.record:
            record(args.record, "parent")
        mp.spawn(run_rank, args=(args.spawn, args), nprocs=args.spawn)
        if args.exit is not None:
            sys.exit(args.exit)
    elif "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        run_rank(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), args)
    else:
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
