"""A real short fit with Lightning or Hugging Face Trainer and ddpdoctor's adapter, on CPU ranks.

Started once per rank by tests/ranks/test_adapters_e2e.py (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set: both frameworks then join processes launched outside them).
Rank 1 computes slower on purpose with `--slow`, to prove the adapter sees a straggler.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

from ddpdoctor.measure.slow_compute import spin

STEPS = 110  # checks every 20 steps: a straggler judged at step 80 and confirmed at 100


def _slow() -> bool:
    return os.environ.get("ADAPTER_SLOW") == "1" and os.environ.get("RANK") == "1"


def lightning_fit(report: str) -> None:
    import lightning
    from torch.utils.data import DataLoader, TensorDataset

    from ddpdoctor.adapters import lightning_callback

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if _slow():
                spin(0.004)
            x, y = batch
            if os.environ.get("ADAPTER_NAN") == "1" and os.environ.get("RANK") == "1" and batch_idx >= 50:
                x = x * float("nan")  # a corrupt batch on rank 1 from its 51st step: its loss goes NaN
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32 * STEPS * 2, 64, generator=g), torch.randint(0, 4, (32 * STEPS * 2,), generator=g))
    callback = lightning_callback(every=20, check_every_s=0, json_path=report, step_deadline_s=60)
    trainer = lightning.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp",
                                max_steps=STEPS, enable_progress_bar=False, enable_model_summary=False,
                                logger=False, enable_checkpointing=False, callbacks=[callback])
    trainer.fit(Model(), DataLoader(data, batch_size=32))
    _summary(report, callback.doctor)


def hf_fit(report: str) -> None:
    from transformers import Trainer, TrainingArguments

    from ddpdoctor.adapters import hf_callback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))

        def forward(self, x, labels=None):  # type: ignore[no-untyped-def]
            if _slow():
                spin(0.004)
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    g = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(64, generator=g), "labels": int(i % 4)} for i in range(32 * STEPS * 2)]
    if os.environ.get("ADAPTER_SLOWDATA") == "1" and os.environ.get("RANK") == "1":
        rows = SlowRows(rows, 0.004)  # rank 1's dataset takes 4 ms a sample (issue 42)
    callback = hf_callback(every=20, check_every_s=0, json_path=report, step_deadline_s=60)
    args = TrainingArguments(output_dir=os.path.dirname(report), use_cpu=True, ddp_backend="gloo", max_steps=STEPS,
                             per_device_train_batch_size=32, report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=Model(), args=args, train_dataset=rows, callbacks=[callback]).train()
    _summary(report, callback.doctor)


class SlowRows(torch.utils.data.Dataset):
    """A dataset whose every sample takes `seconds` to read, as a slow disk or decoding would."""

    def __init__(self, rows: list, seconds: float) -> None:
        self.rows, self.seconds = rows, seconds

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        import time

        time.sleep(self.seconds)
        return self.rows[i]


def _summary(report: str, doctor) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    with open(f"{report}.summary{os.environ['RANK']}", "w") as f:
        json.dump({"steps": doctor._steps, "comm_measured": doctor.wait_measured,
                   "findings": [x.code for x in doctor.report()],
                   "replicas_equal_at": doctor._replicas.last_equal_step}, f)
    if dist.is_initialized():
        # Rank 0 hosts the store: nobody leaves while another still uses it (gloo aborts otherwise).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("lightning", "hf"))
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    (lightning_fit if args.framework == "lightning" else hf_fit)(args.json)
