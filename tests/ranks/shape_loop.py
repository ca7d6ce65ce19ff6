"""A healthy user's training loop of a chosen step time, with `ddpdoctor.Doctor` at its defaults.

The false-alarm matrix of the callback (benchmarks/stragglers_detection.py --shapes) and the
healthy-shape e2e tests run it: a plain DDP loop over a DistributedSampler, an MLP whose width is
chosen so that a step takes about `--step-ms` on this machine, nothing wrong with it. Whatever the
callback reports above "info" here is a false alarm.

The width is calibrated once, on rank 0, before the Doctor exists (a few timed steps of the bare
model at two widths, then a linear fit), and broadcast, so every rank trains the same model.
Start once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (torchrun's variables).
`--lightning` runs the same model and data as a Lightning fit with the adapter instead.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpdoctor
from ddpdoctor.measure.slow_compute import spin

IN, OUT, BATCH = 32, 4, 64
WARM = 20  # steps timed before the ranks agree how many more make --seconds
# Never fewer: at the default every=50, checks at steps 1, 50, ..., 250 and one more, so that slow steps
# too are judged (a straggler is named from 3 checks and when the next check names it again).
MIN_STEPS = 310


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--step-ms", type=float, default=2.0, help="the step time to aim for")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long to train (MIN_STEPS at least)")
    parser.add_argument("--every", type=int, default=None, help="the Doctor's every (default: its own)")
    parser.add_argument("--check-every-s", type=float, default=None, help="the Doctor's check_every_s")
    parser.add_argument("--width", type=int, default=0, help="this hidden width (0: calibrate on rank 0)")
    parser.add_argument("--calibrate", action="store_true", help="print the width for --step-ms and exit")
    parser.add_argument("--lightning", action="store_true", help="a Lightning fit with the adapter")
    parser.add_argument("--spin-rank", type=int, default=-1, help="this rank computes --spin-ms more a step")
    parser.add_argument("--spin-ms", type=float, default=0.0, help="CPU work added inside each step of --spin-rank")
    parser.add_argument("--facts", help="rank 0 writes the windows of each straggler verdict here (JSON)")
    return parser.parse_args()


def model_of(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, OUT))


def _bare_step_ms(width: int, steps: int = 30) -> float:
    torch.manual_seed(0)
    model = model_of(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, IN), torch.randint(0, OUT, (BATCH,))
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - began)
    return 1e3 * sorted(times)[len(times) // 2]


def calibrated_width(step_ms: float) -> int:
    """The hidden width whose bare step takes about `step_ms` here (compute grows with width^2; a DDP
    step adds its all-reduce, so this aims a little under and lets the all-reduce make up the rest)."""
    small, large = 16, 512
    t_small, t_large = _bare_step_ms(small), _bare_step_ms(large)
    per_unit = max(1e-9, (t_large - t_small) / (large ** 2 - small ** 2))
    wanted = max(0.0, 0.8 * step_ms - t_small) / per_unit + small ** 2
    return int(min(8192, max(8, wanted ** 0.5)))


EPOCH_STEPS = 256  # batches per rank and epoch; the loop runs as many epochs as its --seconds take


def data(world: int) -> TensorDataset:
    n = BATCH * EPOCH_STEPS * world
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def doctor_options(args: argparse.Namespace) -> dict:
    options: dict = {"json_path": args.json}
    if args.every is not None:
        options["every"] = args.every
    if args.check_every_s is not None:
        options["check_every_s"] = args.check_every_s
    return options


def record_verdicts(doctor: ddpdoctor.Doctor, judged: list) -> None:
    judge = doctor._stragglers

    def recorded(rows: dict) -> list:
        found = judge(rows)
        if found or not judged:
            judged.append({"step": doctor._steps, "job_s": doctor._job_s, "facts": doctor._history.facts(),
                           "findings": [[f.code, list(f.ranks), f.evidence.get("cause")] for f in found]})
        return found

    setattr(doctor, "_stragglers", recorded)


def plain(args: argparse.Namespace, width: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(model_of(width))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = data(world)
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    doctor = ddpdoctor.Doctor(model, optimizer, loader=loader, **doctor_options(args))
    judged: list = []
    if args.facts and rank == 0:
        record_verdicts(doctor, judged)
    loss_fn = nn.CrossEntropyLoss()
    spin_s = args.spin_ms / 1e3 if rank == args.spin_rank else 0.0
    began = time.perf_counter()
    total, step, epoch, paced = 0, 0, 0, began  # total: agreed after WARM steps, from the slowest rank's pace
    while not total or step < total:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            with doctor.step((x, y)):
                if spin_s:
                    spin(spin_s)  # a rank that really computes more (a slower CPU, a bigger shard of work)
                loss = loss_fn(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            step += 1
            if step == 5:
                paced = time.perf_counter()  # the first steps warm up: the pace is timed after them
            if step == WARM:  # every rank must run as many steps: the count comes from one collective
                elapsed = torch.tensor([(time.perf_counter() - paced) / (WARM - 5)])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                total = max(MIN_STEPS, int(args.seconds / float(elapsed)))
            if total and step >= total:
                break
    wall = time.perf_counter() - began
    doctor.close()
    if args.facts and rank == 0:
        with open(args.facts, "w") as f:
            json.dump(judged, f)
    if rank == 0:  # what the run really was: its steps and their mean time
        with open(f"{args.json}.shape", "w") as f:
            json.dump({"steps": doctor._steps, "mean_step_ms": 1e3 * wall / max(1, doctor._steps), "width": width}, f)


def lightning_fit(args: argparse.Namespace, width: int) -> None:
    import lightning as L

    from ddpdoctor.adapters import lightning_callback

    world = int(os.environ["WORLD_SIZE"])

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model_of(width)

        def training_step(self, batch, batch_idx):  # noqa: ANN001
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Timing(L.Callback):  # what the run really was, as the plain loop writes it
        def on_train_start(self, trainer, module):  # noqa: ANN001
            self.began = time.perf_counter()

        def on_train_end(self, trainer, module):  # noqa: ANN001
            steps = trainer.global_step
            if trainer.global_rank == 0:
                with open(f"{args.json}.shape", "w") as f:
                    json.dump({"steps": steps, "mean_step_ms": 1e3 * (time.perf_counter() - self.began) / max(1, steps),
                               "width": width}, f)

    torch.manual_seed(0)
    loader = DataLoader(data(world), batch_size=BATCH, shuffle=True)
    # Lightning's own time limit (its Timer broadcasts rank 0's decision to stop, so every rank stops alike).
    seconds = int(round(args.seconds))
    trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy="ddp", max_epochs=-1,
                        max_time={"seconds": seconds},
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[lightning_callback(**doctor_options(args)), Timing()])
    trainer.fit(Module(), loader)


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    if args.calibrate:
        print(calibrated_width(args.step_ms))
        return
    if args.lightning:  # Lightning makes the process group itself: the width must be given
        lightning_fit(args, args.width or calibrated_width(args.step_ms))
        return
    dist.init_process_group("gloo")
    width = torch.tensor([args.width or (calibrated_width(args.step_ms) if dist.get_rank() == 0 else 0)])
    dist.broadcast(width, 0)
    plain(args, int(width))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
