"""A real data-parallel training loop with `ddpdoctor.Doctor` in it, as a user would write one.

Two ways to start it, as users do:
- once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (torchrun, srun), as
  tests/ranks/test_doctor_e2e.py does;
- `--spawn N --port P`: one process that starts N ranks with torch.multiprocessing.spawn, the
  tutorial pattern: MASTER_ADDR/MASTER_PORT set in code, rank and world size passed to
  init_process_group, nothing of torchrun's in the environment;
- once per task by srun, with SLURM_PROCID and SLURM_NTASKS and no RANK: the Slurm tutorials' pattern,
  rank and world size read from Slurm's variables and a tcp:// init_method.
`--wrap` picks DistributedDataParallel, FSDP (FullyShardedDataParallel) or FSDP2 (fully_shard);
`--case` picks the bug the loop really has.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import ddpdoctor
from ddpdoctor.measure.slow_compute import spin

BATCH = 32
BATCHES = 8  # per rank and epoch


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", help="comma-separated: healthy, nosampler, noepoch, uneven, straggler, slowdata, hang, "
                        "backward (rank 1 spins in its backward pass), die (rank 1 exits after the loop, never closing)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--trace", default=None, help="the Doctor's trace_path (rank 0's timeline)")
    parser.add_argument("--html", default=None, help="the Doctor's html_path (rank 0's report page)")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--check-every-s", type=float, default=0.0,
                        help="the Doctor's check_every_s (0 here: checks by --every alone, at known steps)")
    parser.add_argument("--wrap", choices=("ddp", "fsdp", "fsdp2"), default="ddp")
    parser.add_argument("--spawn", type=int, default=0, help="start this many ranks with mp.spawn")
    parser.add_argument("--port", type=int, default=0, help="the MASTER_PORT an mp.spawn job hard-codes")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to stay initialised after training")
    parser.add_argument("--facts", help="rank 0 writes the merged windows it judged last here (JSON), for fixtures")
    parser.add_argument("--slow-ms", type=float, default=4.0, help="slowdata: rank 1's extra loading time a step")
    parser.add_argument("--spin-ms", type=float, default=6.0, help="straggler, backward: rank 1's extra compute a step")
    parser.add_argument("--floor-ms", type=float, default=0.0,
                        help="every rank sleeps this long in each step: the run lasts steps x this on any host")
    parser.add_argument("--end", choices=("close", "destroy"), default="close",
                        help="destroy: the script never closes the Doctor, it only calls dist.destroy_process_group()")
    return parser.parse_args()


def wrap(model: nn.Module, how: str) -> nn.Module:
    if how == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    return DistributedDataParallel(model)


def record_verdicts(doctor: ddpdoctor.Doctor, judged: list[dict]) -> None:
    """Keep each straggler verdict with the merged windows it judged and each window's CPU reading
    (tests/fixtures/stragglers_outside's shape), for `--facts`."""
    judge = doctor._stragglers

    def recorded(rows: dict) -> list:
        found = judge(rows)
        judged.append({"step": doctor._steps, "job_s": doctor._job_s, "facts": doctor._history.facts(),
                       "contention_by_window": [{r: row.contention for r, row in window.items()}
                                                for window in doctor._history.windows],
                       "findings": [[f.code, list(f.ranks), f.evidence.get("cause")] for f in found]})
        return found

    setattr(doctor, "_stragglers", recorded)


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    cases = set(args.case.split(","))
    if args.spawn:
        # The tutorial's mp.spawn setup: the rendezvous is hard-coded, rank and world size are arguments.
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
        torch.set_num_threads(1)
        ddpdoctor.watch(timeout_s=60.0, json_path=args.json, rank=rank, world_size=world)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    elif "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        # srun's task: rank and world size from Slurm's variables, the rendezvous a tcp:// address.
        ddpdoctor.watch(timeout_s=60.0, json_path=args.json, rank=rank, world_size=world)
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                rank=rank, world_size=world)
    else:
        ddpdoctor.watch(timeout_s=60.0, json_path=args.json)  # a healthy start reports nothing
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = wrap(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4)), args.wrap)
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
                              check_every_s=args.check_every_s, step_deadline_s=3.0, on_hang="exit",
                              trace_path=args.trace, html_path=args.html)
    judged: list[dict] = []
    if args.facts and rank == 0:
        record_verdicts(doctor, judged)
    if "backward" in cases and rank == 1:
        # A compute straggler inside the backward pass (a hook on the first layer's weight gradient), where the
        # gradient all-reduce's buckets are being launched: the spin is a floor on any host (it ends by the clock).
        first = next(p for p in model.parameters() if p.dim() == 2)
        first.register_hook(lambda grad: (spin(args.spin_ms / 1e3), grad)[1])
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    for epoch in range(args.epochs):
        if sampler is not None and "noepoch" not in cases:
            sampler.set_epoch(epoch)
        for x, y in loader:
            if "uneven" in cases and step >= BATCHES - 3:
                break  # stop before the short rank runs out (the real job would hang there)
            if "slowdata" in cases and rank == 1:
                time.sleep(args.slow_ms / 1e3)  # a loader that really takes longer on this rank, before the step
            with doctor.step((x, y)):
                if "straggler" in cases and rank == 1:
                    # A rank whose compute really takes longer. 6 ms, not 4: every step then lasts 6 ms or more on any
                    # host, so the callback's 2 s (judged from step 80) fall by step 434 of a 60-epoch run's 480.
                    spin(args.spin_ms / 1e3)
                if "hang" in cases and rank == 1 and step == 12:
                    time.sleep(3600)  # stuck in its own code: the others wait in the collective
                if args.floor_ms:
                    time.sleep(args.floor_ms / 1e3)  # a sleep is never shorter: the run's length has a floor
                loss = loss_fn(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            step += 1
    if "die" in cases and rank == 1:
        os._exit(0)  # gone after its last step, before the end of the run: rank 0 names it (DOC021)
    if args.end == "destroy":
        dist.destroy_process_group()  # the end of the run is judged from here: the script never closes the Doctor
        return
    doctor.close()
    if args.facts and rank == 0:
        with open(args.facts, "w") as f:
            json.dump(judged, f)
    time.sleep(args.hold)
    if "die" not in cases:  # rank 1 is gone: a barrier would fail on rank 0 ("Connection closed by peer")
        dist.barrier()  # rank 0 hosts the store: nobody leaves while another still needs it
    # FSDP's state holds gloo work objects; released here, not at interpreter teardown, where a
    # spawned FSDP2 rank once aborted ("terminate called without an active exception") after the
    # whole run, its report included, was done.
    del model, optimizer, doctor
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    if args.spawn:
        import torch.multiprocessing as mp

        mp.spawn(train, args=(args.spawn, args), nprocs=args.spawn)
    elif "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        train(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), args)
    else:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
