"""Real short fits through each framework ddpdoctor adapts to, one scenario after another in one job.

Started once per rank by tests/ranks/test_adapters_e2e.py and benchmarks/adapters_detection.py
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set: Lightning, the Hugging Face Trainer
and Accelerate all join processes launched outside them). The frameworks' imports cost seconds,
so one job runs several fits in a row, each with its own Doctor and report (JSON.SCENARIO.json):

- healthy: nothing wrong;
- slowdata: rank 1's dataset takes SLOW_SAMPLE_S a sample (a slow disk or decoding);
- hog: the ranks pinned one to a core, and a busy process (runtime/outside_faults.py, another
  process, as a data loader's workers or another job would be) on rank 1's core;
- nosampler: the data is not sharded, each framework's own way to get that wrong (Lightning's
  `use_distributed_sampler=False`, a Trainer whose `get_train_dataloader` returns a plain DataLoader,
  a loader not passed to `Accelerator.prepare`);
- nan: rank 1's batches turn NaN from its step NAN_FROM + 1;
- lossout (Hugging Face only): the Trainer computes the loss outside the model (`compute_loss_func`);
- hang (alone, with `on_hang="exit"`): rank 1 blocks on a lock it holds inside step HANG_STEP's forward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from ddpdoctor.callback.doctor import CONFIRM_S

EVERY = 20  # steps between the callback's checks (OPTIONS)
JUDGED_FROM = 80  # stragglers are judged once four windows of EVERY steps are in
STEPS = 110  # judged at step 80, with 64 steps in the windows
BATCH = 32
SLOW_SAMPLE_S = 0.0005  # 16 ms a batch of 32 on rank 1, against a step of about a millisecond
# A straggler is said once the checks have named it for CONFIRM_S of the job, so the fits that must say one run
# long enough on any machine, and the healthy fit long enough for a false alarm to be said.
# - slowdata: rank 1 sleeps at least BATCH * SLOW_SAMPLE_S a step (a sleep is never shorter than asked), so every
#   step lasts that long however fast the machine. The fit rests on the end of the run's verdict (issue 53): its
#   steps after the first stand for CONFIRM_S of the job with a quarter to spare, 158 steps, where the live rule
#   needed 280 (CONFIRM_S after the first judged check, plus three checks; sized from the steps' length in this VM
#   before that, a CI host whose steps took 22 ms ended the fit one check before it was said).
# - hog: a busy neighbour makes steps of 13-20 ms here (a rank that sleeps in every all-reduce loses less than
#   its share: the scheduler favours a thread that wakes); at 420 steps, steps of 8 ms would still say it.
# - healthy: steps of about 10 ms, judged at 15 checks over 3 s.
SLOWDATA_STEPS = max(JUDGED_FROM, math.ceil(1.25 * CONFIRM_S / (BATCH * SLOW_SAMPLE_S))) + 1
STEPS_BY_SCENARIO = {"healthy": 360, "slowdata": SLOWDATA_STEPS, "hog": 420}
NAN_FROM = 50
HANG_STEP = 6
# The hog last: the scenarios after it run on the same processes, which it pinned.
SCENARIOS = ("healthy", "slowdata", "nosampler", "nan", "hog")
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read once: Lightning removes it from the environment after a fit
OPTIONS = dict(every=EVERY, check_every_s=0, step_deadline_s=60)
# ADAPTER_FIT_UNEDITED=1: the fits as their users write them, with nothing of ddpdoctor in them (no callback, no
# Doctor): `ddpdoctor run` attaches (tests/ranks/test_run_command_e2e.py), its report at --json.
UNEDITED = bool(os.environ.get("ADAPTER_FIT_UNEDITED"))


class Net(nn.Module):
    """The same small MLP in every framework; its forward is where rank 1 misbehaves."""

    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.scenario, self.forwards = scenario, 0
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))

    def forward(self, x: torch.Tensor, labels: Any = None, **loss_kwargs: Any) -> Any:
        # **loss_kwargs, as Hugging Face's causal LMs take them: the Trainer then gathers every step's token
        # count across ranks (`num_items_in_batch`), a collective between the steps its callbacks see.
        if self.training:
            self.forwards += 1
            misbehave(self.scenario, self.forwards, self.report_path)
            if self.scenario == "nan" and RANK == 1 and self.forwards > NAN_FROM:
                x = x * float("nan")  # a corrupt batch on rank 1: its loss goes NaN
        logits = self.net(x)
        if labels is None:
            return logits
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    report_path = ""


def pin(cpus: set) -> None:
    """Every thread of this process on `cpus` (sched_setaffinity(0) moves the calling thread only: gloo's
    threads, or those the hog's helper pinned, would stay where they were and skew the fits after)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def misbehave(scenario: str, step: int, report: str) -> None:
    if scenario != "hang" or RANK != 1 or step != HANG_STEP:
        return
    with open(f"{report}.culprit", "w") as f:
        json.dump({"pid": os.getpid(), "t": time.time()}, f)
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # a deadlock in the user's own code: never returns


class Rows(torch.utils.data.Dataset):
    """Rows of (x, label); on rank 1 under `slowdata`, each read takes SLOW_SAMPLE_S (time.sleep: off the CPU)."""

    def __init__(self, n: int, slow: bool, as_dict: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 64, generator=g), torch.randint(0, 4, (n,), generator=g)
        self.slow, self.as_dict = slow, as_dict

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if self.slow:
            time.sleep(SLOW_SAMPLE_S)
        return {"x": self.x[i], "labels": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


def steps(scenario: str) -> int:
    forced = os.environ.get("ADAPTER_FIT_STEPS")  # benchmarks/adapters_detection.py --steps: every fit this long
    return int(forced) if forced else STEPS_BY_SCENARIO.get(scenario, STEPS)


def rows(scenario: str, as_dict: bool) -> Rows:
    return Rows(BATCH * steps(scenario) * 2, slow=scenario == "slowdata" and RANK == 1, as_dict=as_dict)


def lightning_fit(scenario: str, report: str, options: dict) -> Any:
    import lightning
    from torch.utils.data import DataLoader

    from ddpdoctor.adapters import lightning_callback

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net(scenario)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.model(*batch)["loss"]

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = lightning_callback(json_path=report, **options)
    trainer = lightning.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp",
                                max_steps=steps(scenario), enable_progress_bar=False, enable_model_summary=False,
                                logger=False, enable_checkpointing=False, callbacks=[] if UNEDITED else [callback],
                                use_distributed_sampler=scenario != "nosampler")
    trainer.fit(Model(), DataLoader(rows(scenario, as_dict=False), batch_size=BATCH))
    return (None, None) if UNEDITED else (callback.doctor, callback.timed_between)


def hf_fit(scenario: str, report: str, options: dict) -> Any:
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainingArguments

    from ddpdoctor.adapters import hf_callback

    class PlainLoaderTrainer(Trainer):
        """A Trainer subclassed for its own loader, which returns a plain DataLoader: accelerate never shards it."""

        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_dataset, batch_size=BATCH)

    callback = hf_callback(json_path=report, **options)
    args = TrainingArguments(output_dir=os.path.dirname(report), use_cpu=True, ddp_backend="gloo", max_steps=steps(scenario),
                             per_device_train_batch_size=BATCH, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    kind = PlainLoaderTrainer if scenario == "nosampler" else Trainer
    outside = {"compute_loss_func": cross_entropy_outside} if scenario == "lossout" else {}
    kind(model=Net(scenario), args=args, train_dataset=rows(scenario, as_dict=True),
         callbacks=[] if UNEDITED else [callback], **outside).train()
    return (None, None) if UNEDITED else (callback.doctor, callback.timed_between)


def cross_entropy_outside(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    """A loss the Trainer computes from the model's logits (its `compute_loss_func`): the model never sees labels."""
    return nn.functional.cross_entropy(outputs, labels)


def accelerate_fit(scenario: str, report: str, options: dict) -> Any:
    """`Accelerator.prepare` and a plain loop, with Doctor given the model, optimizer and loader it prepared."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    import ddpdoctor

    accelerator = Accelerator(cpu=True)
    model = Net(scenario)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(rows(scenario, as_dict=False), batch_size=BATCH)
    if scenario == "nosampler":  # the loader left out of prepare: every rank reads the whole dataset
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if UNEDITED:
        for step, (x, y) in enumerate(loader, 1):
            accelerator.backward(model(x, y)["loss"])
            optimizer.step()
            optimizer.zero_grad()
            if step == steps(scenario):
                break
        return None, None
    doctor = ddpdoctor.Doctor(model, optimizer, loader, json_path=report, **options)
    for step, (x, y) in enumerate(loader, 1):
        with doctor.step((x, y)) as now:
            loss = model(x, y)["loss"]
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            now.loss = loss
        if step == steps(scenario):
            break
    doctor.close()
    return doctor, None


def wrong(scenario: str, findings: list[dict]) -> str:
    """What is wrong with a scenario's report (rank 0's findings, as written), or "" when it is right:
    its fault named first with the right rank and cause, and nothing else above information."""
    loud = [f for f in findings if f["severity"] in ("warn", "critical")]

    def told(fs: list[dict]) -> str:
        return "; ".join(f"{f['code']} {f['ranks']} {f['evidence'].get('cause', '')} ({f['title'][:150]})" for f in fs)

    said = told(loud) or "nothing"
    expected = {"slowdata": ("STR001", [1], "data loading"), "hog": ("STR001", [1], "CPU contention"),
                "nosampler": ("DOC001", [0, 1], None), "nan": ("DOC018", [1], None)}.get(scenario)
    if expected is None:
        return "" if not loud else f"a false alarm: {said}"
    code, ranks, cause = expected
    if not loud or loud[0]["code"] != code or loud[0]["ranks"] != ranks or \
            (cause is not None and loud[0]["evidence"].get("cause") != cause):
        return f"expected {code} {ranks} {cause or ''} first, said {said}"
    if scenario == "nan" and loud[0]["evidence"].get("first_nonfinite_step", {}).get("1") != NAN_FROM + 1:
        return f"DOC018 dated {loud[0]['evidence'].get('first_nonfinite_step')}, not rank 1 at {NAN_FROM + 1}"
    extra = [f for f in loud[1:] if f["code"] != code]
    return "" if not extra else f"also said {told(extra)}"


FITS: dict[str, Callable[[str, str, dict], Any]] = {"lightning": lightning_fit, "hf": hf_fit,
                                                    "accelerate": accelerate_fit}


def run(framework: str, scenario: str, prefix: str) -> None:
    report = f"{prefix}.{scenario}.json"
    Net.report_path = report
    # --doctor-defaults in benchmarks/adapters_detection.py: the Doctor's own schedule (a check every 50 steps, at
    # most every 2 s), as a user's fit has it, instead of the tests' check every 20 steps.
    base = dict(OPTIONS, every=50, check_every_s=2.0) if os.environ.get("ADAPTER_FIT_DEFAULTS") else OPTIONS
    options = dict(base, **({"on_hang": "exit", "step_deadline_s": 3.0} if scenario == "hang" else {}))
    hog, pinned = None, os.sched_getaffinity(0)
    if scenario == "hog":
        from ddpdoctor.runtime import outside_faults

        pin({RANK % (os.cpu_count() or 1)})
        if RANK == 1:
            hog = outside_faults.start("hog", os.getpid(), pct=100.0, cpu=RANK % (os.cpu_count() or 1))
    began = time.perf_counter()
    try:
        doctor, timed_between = FITS[framework](scenario, report, options)
    finally:
        if hog is not None:
            hog.stop()
        pin(pinned)
    if doctor is None:  # unedited: `ddpdoctor run` wrote the report
        return
    if RANK == 0 and doctor._history.windows:  # what rank 0 judged last (History.facts()), for recording
        with open(f"{report}.facts", "w") as f:
            json.dump({"facts": doctor._history.facts()}, f)
    with open(f"{report}.summary{RANK}", "w") as f:
        json.dump({"fit_s": round(time.perf_counter() - began, 2), "steps": doctor._steps, "timed_between": timed_between,
                   "comm_measured": doctor.wait_measured,
                   "findings": [x.code for x in doctor.report()],
                   "replicas_equal_at": doctor._replicas.last_equal_step, "seen": seen(doctor)}, f)


def seen(doctor: Any) -> dict:
    """Rank 0's view of the kept windows, per rank (medians, ms; the CPU wait): for reading a run, not asserted."""
    import statistics

    out: dict = {}
    for rows in doctor._history.windows:
        for r, w in rows.items():
            c = w.contention or {}
            out.setdefault(str(r), []).append([round(statistics.median(w.step_ms), 2), round(statistics.median(w.wait_ms), 2),
                                               round(statistics.median(w.data_ms), 2), c.get("run_delay_pct"), c.get("cpu_pct"),
                                               c.get("process_run_delay_pct"), c.get("process_cpu_pct"), c.get("corunners")])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=sorted(FITS))
    parser.add_argument("--json", required=True, help="reports go to JSON.SCENARIO.json")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {', '.join(SCENARIOS)}, lossout, hang")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for scenario in args.scenarios.split(","):
        run(args.framework, scenario, args.json)
    import torch.distributed as dist

    if dist.is_initialized():
        # Rank 0 hosts the store: nobody leaves while another still uses it (gloo aborts otherwise).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
