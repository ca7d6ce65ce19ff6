"""Training loops whose ranks stop training one model, written the way users write them, and healthy ones.

Every case is its own small DDP model, optimizer and `Doctor` (checking every 10 steps), and all the
cases named with --cases train side by side in one pair of processes, one step of each in turn:
each Doctor's collectives come in the same order on every rank, so the cases do not disturb one
another, and one start-up serves them all. Rank r writes each case's findings to
`<--json>.<case>` (rank 0) or `<--json>.<case>.rank<r>`.

The bugs (their public reports in docs/callback.md, "Ranks out of sync"):
- temperature: a learnable scale made with torch.ones(1, requires_grad=True), passed to the optimizer
  with model.parameters(): DDP never averages its gradient (CLIP's logit_scale, openai/CLIP#111);
- clamp_rank0: a max-norm clamp written inside the `if rank == 0 and step % 25 == 0:` logging block;
- lr_by_rank: the learning rate computed from the rank (nanochat#857 computes it from rank-local progress);
- sched_rank0: a StepLR stepped on rank 0 only;
- ema_rank0: an EMA kept on rank 0 and copied into the model every 20 steps (ema-pytorch#9);
- resume_rank0: a checkpoint loaded on rank 0 only, after DDP was built (mlcommons#412);
- all_no_sync: gradient accumulation with every micro-batch, the last too, under no_sync();
- module_forward: the loss computed with model.module(x), bypassing DDP (minimind#853);
- unfrozen: a layer frozen when DDP was built and unfrozen after (Lightning#20340);
- nan_skip: rank 1's loss turns NaN at step 30 and each rank skips its step when its loss is not finite;
- bn_no_broadcast: BatchNorm with broadcast_buffers=False (information, not a bug);
- late_buffer: a running mean of the inputs registered as a buffer after DDP(...) on a model that had
  no buffer then, updated from each rank's batch: DDP never broadcasts it (torch 2.13, recorded).
Healthy: plain, batchnorm (default broadcast), amp (bfloat16 autocast with a GradScaler), static_graph,
fp16_hook (DDP's fp16 compression hook), accumulate (no_sync on all but the last micro-batch).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpdoctor


class Net(nn.Module):
    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if bn else nn.Identity()
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class Case:
    def __init__(self, name: str, rank: int, path: str, sleep_ms: float = 0.0, nan_at: int = 30,
                 ema_every: int = 20) -> None:
        self.sleep_s = sleep_ms / 1e3
        self.nan_at, self.ema_every = nan_at, ema_every
        self.name, self.rank = name, rank
        torch.manual_seed(100 + rank)  # a rank's own initial weights: DDP must broadcast rank 0's
        kwargs: dict = {}
        if name in ("batchnorm", "bn_no_broadcast"):
            self.net = Net(bn=True)
            kwargs["broadcast_buffers"] = name == "batchnorm"
        else:
            self.net = Net()
        if name == "unfrozen":
            self.net.fc1.requires_grad_(False)
        if name == "static_graph":
            kwargs["static_graph"] = True
        self.model = DistributedDataParallel(self.net, **kwargs)
        if name == "unfrozen":
            self.net.fc1.requires_grad_(True)  # after DDP was built: its reducer never averages fc1
        if name == "fp16_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        if name == "late_buffer":
            self.net.fc1.register_buffer("input_mean", torch.zeros(8))  # after DDP(...): never broadcast
        if name == "resume_rank0" and rank == 0:
            torch.manual_seed(7)
            self.model.module.load_state_dict(Net().state_dict())  # "resume": on rank 0 only, after wrapping
        params = list(self.model.parameters())
        self.temperature = None
        if name == "temperature":
            self.temperature = torch.ones(1, requires_grad=True)
            params = params + [self.temperature]
        lr = 0.05 * (1 + rank) if name == "lr_by_rank" else 0.05
        self.opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=10, gamma=0.5) if name == "sched_rank0" else None
        self.scaler = torch.amp.GradScaler("cpu") if name == "amp" else None
        self.ema = copy.deepcopy(self.net) if name == "ema_rank0" and rank == 0 else None
        self.doctor = ddpdoctor.Doctor(self.model, self.opt, every=10, check_every_s=0, json_path=f"{path}.{name}")

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        name, model, opt = self.name, self.model, self.opt
        with self.doctor.step((x, y)) as watched:
            if self.sleep_s:
                time.sleep(self.sleep_s)  # a longer step (I/O, a bigger model): a per-step fingerprint is then cheap
            opt.zero_grad()
            if name == "late_buffer":
                with torch.no_grad():  # a running mean of the inputs, from this rank's own batch
                    self.net.fc1.input_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
            if name in ("all_no_sync", "accumulate"):
                for k, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
                    last = k == 1 and name == "accumulate"
                    if last:
                        nn.functional.cross_entropy(model(xs), ys).backward()
                    else:
                        with model.no_sync():
                            nn.functional.cross_entropy(model(xs), ys).backward()
                opt.step()
                return
            if name == "nan_skip" and self.rank == 1 and step >= self.nan_at:
                x = x * float("nan")
            out = model.module(x) if name == "module_forward" else model(x)
            if self.temperature is not None:
                out = out * self.temperature
            if self.scaler is not None:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                watched.loss = loss
                self.scaler.scale(loss).backward()
                self.scaler.step(opt)
                self.scaler.update()
                return
            loss = nn.functional.cross_entropy(out, y)
            watched.loss = loss  # the step's loss, watched for the first non-finite value (DOC018)
            loss.backward()
            if name == "nan_skip" and not torch.isfinite(loss):
                return  # skipped on this rank alone
            opt.step()
            if self.sched is not None and self.rank == 0:
                self.sched.step()
            if name == "clamp_rank0" and self.rank == 0 and step % 25 == 0:
                print(f"step {step} loss {loss.item():.3f}")  # the logging block the constraint was put in
                with torch.no_grad():
                    for p in model.parameters():
                        p.clamp_(-0.1, 0.1)
            if self.ema is not None:
                with torch.no_grad():
                    for e, p in zip(self.ema.parameters(), self.net.parameters()):
                        e.mul_(0.9).add_(p, alpha=0.1)
                if step % self.ema_every == self.ema_every - 1:
                    self.net.load_state_dict(self.ema.state_dict())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="added to every step of every case")
    parser.add_argument("--nan-at", type=int, default=30, help="nan_skip: rank 1's loss is NaN from this step on")
    parser.add_argument("--ema-every", type=int, default=20, help="ema_rank0: the EMA is copied in every this many steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = [Case(name, rank, args.json, args.sleep_ms, args.nan_at, args.ema_every) for name in args.cases.split(",")]
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of data
    for step in range(args.steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
        for case in cases:
            case.step(step, x, y)
    for case in cases:
        case.doctor.close()
    summary = {c.name: {"steps": c.doctor._steps, "findings": [f.code for f in c.doctor.report()],
                        "buffers_compared": c.doctor._buffers.compared} for c in cases}
    with open(f"{args.json}.summary{rank}", "w") as f:
        json.dump(summary, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
