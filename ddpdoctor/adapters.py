"""`Doctor` for PyTorch Lightning and Hugging Face `Trainer`: optional, imported only when asked for.

    trainer = lightning.Trainer(..., callbacks=[ddpdoctor.adapters.lightning_callback()])
    trainer = transformers.Trainer(..., callbacks=[ddpdoctor.adapters.hf_callback()])

Both frameworks create the process group and the DDP wrapper before any callback runs, so
these adapters see the job from its first training step (use `ddpdoctor.watch()`-style
init diagnosis outside them). Lightning hands its callbacks the batch and training_step's
loss; Hugging Face hands them neither, so its adapter reads both off the model's forward
(callback/model_tap.py), and finds the DDP wrapper by looking for the DistributedDataParallel
that holds the model the Trainer passes. Accelerate used directly needs no adapter: `Doctor`
takes what `Accelerator.prepare` returned (docs/callback.md).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ddpdoctor.callback.doctor import Doctor
from ddpdoctor.callback.model_tap import ModelTap, unseen_loss
from ddpdoctor.callback.options import checked


def _ddp_holding(model: Any) -> Any:
    """The DistributedDataParallel whose `.module` is `model`, if the framework made one."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel) and obj.module is model:
            return obj
    return model


def _time_between_steps_collective(trainer: Any, doctor: Doctor) -> Any:
    """Lightning (2.x) broadcasts a SIGTERM flag from rank 0 before every batch, outside the callback's
    step: a rank that reaches it first waits there for the others, and that wait would read as its
    data loading, making a straggler's peers look as slow as it. The broadcast is timed and handed to
    the Doctor as waiting (`framework_wait`). Returns the loop timed, or None where this Lightning has
    no such method (then nothing is between the steps to time, or it is not known where)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    original = getattr(loop, "_broadcast_sigterm_tensor", None)
    if loop is None or not callable(original):
        return None

    def timed() -> Any:
        began = time.perf_counter()
        try:
            return original()
        finally:
            doctor.framework_wait((time.perf_counter() - began) * 1e3)

    loop._broadcast_sigterm_tensor = timed  # on this loop only; removed at on_train_end
    return loop


def lightning_callback(**options: Any) -> Any:
    """A `lightning.pytorch.Callback` (or `pytorch_lightning.Callback`) running a Doctor.

    `options` are `Doctor`'s, checked here: a bad one is a ValueError before the fit starts."""
    checked(options)
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # the older package name (mypy sees two classes where both are installed)
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment,no-redef,unused-ignore]

    class DoctorCallback(Callback):
        def __init__(self) -> None:
            self.doctor: Any = None
            self.timed: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
            optimizers = list(getattr(trainer, "optimizers", None) or [])
            # A fresh dict per fit: the next fit (or trainer) must not inherit this one's optimizer.
            chosen = {"optimizer": optimizers[0] if optimizers else None, "loader": trainer.train_dataloader, **options}
            self.doctor = Doctor(_ddp_holding(model), **chosen)  # the user's optimizer or loader, if given, wins
            self.timed = _time_between_steps_collective(trainer, self.doctor)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if self.doctor is not None:
                self.doctor.step_begin(batch)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.doctor is not None:
                # training_step's return: the loss, or a dict holding it (watched for a non-finite value: DOC018).
                self.doctor.step_end(outputs.get("loss") if isinstance(outputs, dict) else outputs)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.doctor is not None:
                if self.timed is not None:
                    with contextlib.suppress(AttributeError):
                        del self.timed._broadcast_sigterm_tensor  # Lightning's own method again
                    self.timed = None
                self.doctor.close()

    return DoctorCallback()


def hf_callback(**options: Any) -> Any:
    """A `transformers.TrainerCallback` running a Doctor (`options` checked here, as Lightning's)."""
    checked(options)
    from transformers import TrainerCallback

    class DoctorTrainerCallback(TrainerCallback):
        def __init__(self) -> None:
            self.doctor: Any = None
            self.tap: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           train_dataloader: Any = None, **kwargs: Any) -> None:
            if model is not None:
                # Trainer's step is an optimizer step over gradient_accumulation_steps batches, and the
                # batches are not passed to callbacks: the batch per rank comes from the arguments.
                batch = (int(getattr(args, "per_device_train_batch_size", 0) or 0)
                         * int(getattr(args, "gradient_accumulation_steps", 1) or 1) or None)
                chosen = {"optimizer": kwargs.get("optimizer"), "batch_size": batch, "loader": train_dataloader,
                          **options}
                self.doctor = Doctor(_ddp_holding(model), **chosen)
                # The batch (DOC001) and the loss (DOC018), which the Trainer passes its callbacks neither of.
                self.tap = ModelTap(model, self.doctor)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.doctor is not None:
                self.doctor.step_begin(None)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.doctor is not None:
                self.doctor.step_end(self.tap.take_loss())

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.doctor is not None:
                self.tap.close()
                if not self.tap.loss_seen and self.doctor.steps_done:  # said, never a silent gap (DOC020)
                    self.doctor.tell([unseen_loss(self.doctor.world_size, self.doctor.steps_done)])
                self.doctor.close()

    return DoctorTrainerCallback()
