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

import functools
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ddpdoctor
from ddpdoctor.callback.doctor import Doctor
from ddpdoctor.callback.loss_watch import loss_of
from ddpdoctor.callback.model_tap import ModelTap, unseen_loss
from ddpdoctor.callback.options import checked

log = logging.getLogger("ddpdoctor")
ddpdoctor._doctor_module()  # the run summary's screen at the end of every fit (render/run_summary.py)


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


def _trainer_holding(callback: Any) -> Any:
    """The Hugging Face Trainer whose callbacks include `callback` (it passes its callbacks no reference to itself)."""
    import gc

    try:
        from transformers import Trainer
    except ImportError:  # a stand-in or a build without it: nothing between the steps is timed
        return None
    for obj in gc.get_objects():
        if isinstance(obj, Trainer) and callback in getattr(obj.callback_handler, "callbacks", ()):
            return obj
    return None


@dataclass
class Timed:
    """A framework's method replaced, on one object, by a timed call of it (`time_as_waiting`)."""

    owner: Any
    name: str
    wrapper: Callable[..., Any]

    def undo(self) -> None:
        """The framework's own method again, unless someone replaced ours meanwhile."""
        if vars(self.owner).get(self.name) is self.wrapper:
            delattr(self.owner, self.name)


def time_as_waiting(owner: Any, name: str, doctor: Doctor) -> Optional[Timed]:
    """Time `owner.name(...)` into `doctor.framework_wait`: a collective the framework runs between the steps a
    callback sees, where a rank that arrives first waits for its peers. Without this that wait reads as the
    rank's data loading, and a straggler's peers look as slow between steps as it (measured through Lightning:
    a busy process on rank 1's core was called "the network is the bottleneck"). The collectives:
    Lightning 2.x broadcasts a SIGTERM flag from rank 0 before every batch (`_broadcast_sigterm_tensor`);
    the Hugging Face Trainer gathers the batch's token count (`_get_num_items_in_batch`, for models that take
    loss keyword arguments, with `average_tokens_across_devices`, its default).

    On CPU ranks only: on a GPU, Lightning's broadcast ends in `.item()`, which waits for the rank's own queued
    kernels, so the time would be its own GPU work counted as waiting; and the Trainer's NCCL gather does not
    hold the CPU at all. Returns None where not timed (the method is absent: a framework's version without it)."""
    if owner is None or getattr(getattr(doctor, "device", None), "type", "cpu") == "cuda":
        return None
    original = getattr(owner, name, None)
    if not callable(original):
        log.debug("ddpdoctor: %s has no %s: the framework's wait between steps is not timed", type(owner).__name__, name)
        return None
    ref = weakref.ref(doctor)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            target = ref()
            if target is not None:
                target.framework_wait((time.perf_counter() - began) * 1e3)

    setattr(owner, name, timed)  # on this object only; `undo` at the fit's end
    return Timed(owner, name, timed)


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
            self.timed: Optional[Timed] = None
            self.timed_between: Optional[str] = None  # the framework's method timed as waiting, if any

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._end()  # a fit before that never reached its end: its Doctor closed, Lightning's method back
            model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
            optimizers = list(getattr(trainer, "optimizers", None) or [])
            # A fresh dict per fit: the next fit (or trainer) must not inherit this one's optimizer.
            chosen = {"optimizer": optimizers[0] if optimizers else None, "loader": trainer.train_dataloader, **options}
            self.doctor = Doctor(_ddp_holding(model), **chosen)  # the user's optimizer or loader, if given, wins
            loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
            self.timed = time_as_waiting(loop, "_broadcast_sigterm_tensor", self.doctor)
            self.timed_between = self.timed.name if self.timed is not None else None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if self.doctor is not None:
                self.doctor.step_begin(batch)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.doctor is not None:
                # training_step's return: the loss, or a dict holding it (watched for a non-finite value: DOC018).
                self.doctor.step_end(loss_of(outputs, bare_is_loss=True))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._end()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._end()  # the fit failed: no on_train_end comes; the report is written all the same

        def _end(self) -> None:
            if self.timed is not None:
                self.timed.undo()
                self.timed = None
            if self.doctor is not None:
                self.doctor.close()  # once: a closed Doctor's close does nothing

    return DoctorCallback()


def hf_callback(**options: Any) -> Any:
    """A `transformers.TrainerCallback` running a Doctor (`options` checked here, as Lightning's)."""
    checked(options)
    from transformers import TrainerCallback

    class DoctorTrainerCallback(TrainerCallback):
        def __init__(self) -> None:
            self.doctor: Any = None
            self.tap: Optional[ModelTap] = None
            self.timed: Optional[Timed] = None
            self.timed_between: Optional[str] = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           train_dataloader: Any = None, **kwargs: Any) -> None:
            # The Trainer runs its loop again after an out-of-memory error with auto_find_batch_size, and has no
            # exception hook: the try before is closed here, its hooks removed.
            self._end()
            if model is None:
                return
            # Trainer's step is an optimizer step over gradient_accumulation_steps batches, and the
            # batches are not passed to callbacks: the batch per rank comes from the arguments.
            batch = (int(getattr(args, "per_device_train_batch_size", 0) or 0)
                     * int(getattr(args, "gradient_accumulation_steps", 1) or 1) or None)
            chosen = {"optimizer": kwargs.get("optimizer"), "batch_size": batch, "loader": train_dataloader,
                      **options}
            self.doctor = Doctor(_ddp_holding(model), **chosen)
            # The batch (DOC001) and the loss (DOC018), which the Trainer passes its callbacks neither of.
            self.tap = ModelTap(model, self.doctor)
            self.timed = time_as_waiting(_trainer_holding(self), "_get_num_items_in_batch", self.doctor)
            self.timed_between = self.timed.name if self.timed is not None else None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.doctor is not None:
                self.doctor.step_begin(None)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.doctor is not None and self.tap is not None:
                self.doctor.step_end(self.tap.take_loss())

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.doctor is not None and self.tap is not None and not self.tap.loss_seen and self.doctor.steps_done:
                self.doctor.tell([unseen_loss(self.doctor.world_size, self.doctor.steps_done)])  # never a silent gap
            self._end()

        def _end(self) -> None:
            if self.timed is not None:
                self.timed.undo()
                self.timed = None
            if self.tap is not None:
                self.tap.close()
                self.tap = None
            if self.doctor is not None:
                self.doctor.close()

    return DoctorTrainerCallback()
