"""The batch and the loss, read off the model's forward, for a framework that hides both from its callbacks.

The Hugging Face Trainer calls `on_step_begin`/`on_step_end` but passes its callbacks neither the
batch nor the loss. Without the batch the same-batch check (DOC001: data not sharded) cannot run;
without the loss, which rank's loss went NaN first (DOC018) cannot be said, and the Trainer's own
`logging_nan_inf_filter` (on by default) hides a NaN loss from its logs too. Both pass through the
model: a forward pre-hook sees the inputs, a forward hook sees the outputs (a Hugging Face model
given labels returns `loss` in them).

Per forward: one Python call each way and, for the loss, a reference kept until the step's end (no
copy, no read: a GPU is never waited for; `LossWatch` copies it on the device at the step's end).
Only forwards in training mode inside a Doctor step count: evaluation's forwards are not training
steps. With gradient accumulation a step has several forwards: the first one's inputs stand for the
batch (as the plain loop's `doctor.step(batch)` does), and the micro-batches' losses are summed on
the device (one add), so a NaN in any of them is seen. The hooks hold the tap weakly
(callback/weak_hooks.py): a deepcopy or `torch.save` of the model does not drag the Doctor along. A
loss computed outside the model (the Trainer's `compute_loss_func`, label smoothing) is not seen:
`loss_seen` then stays False and the report says so (DOC020) rather than staying silent.
"""

from __future__ import annotations

from typing import Any, Optional

from ddpdoctor.callback.loss_watch import loss_of
from ddpdoctor.callback.weak_hooks import WeakHook


class ModelTap:
    """Hooks on `module` feeding `doctor.see_batch`, and the step's loss for `take_loss()`."""

    def __init__(self, module: Any, doctor: Any, batch: bool = True) -> None:
        """`batch=False`: the loss only (`ddpdoctor run` reads the batch in the hook that begins its steps)."""
        self.doctor = doctor
        self.loss: Any = None
        self.loss_seen = False
        self._loss_hook = module.register_forward_hook(WeakHook(self, "_after"))
        self._handles = [self._loss_hook]
        if batch:
            self._handles.append(module.register_forward_pre_hook(WeakHook(self, "_before"), with_kwargs=True))

    def _inside(self, module: Any) -> bool:
        return bool(module.training and self.doctor.in_step)

    def _before(self, module: Any, args: Any, kwargs: Any) -> None:
        if self._inside(module):
            self.doctor.see_batch(kwargs if kwargs else args)

    def _after(self, module: Any, args: Any, output: Any) -> None:
        if not self._inside(module):
            return
        loss = loss_of(output, bare_is_loss=False)
        if loss is None or not hasattr(loss, "detach"):
            return
        self.loss_seen = True
        loss = loss.detach()
        self.loss = loss if self.loss is None else self.loss + loss

    def take_loss(self) -> Optional[Any]:
        """The step's loss (summed over its micro-batches), or None: once per step, at its end."""
        loss, self.loss = self.loss, None
        return loss

    def stop_watching_loss(self) -> None:
        """No loss in the model's outputs so far (a plain loop computes it outside): its hook is removed, a call
        less a forward; `loss_seen` stays False, so the report says the loss was not watched (DOC020)."""
        self._loss_hook.remove()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def unseen_loss(world_size: int, steps: int, seen_from: str = "hf") -> Any:
    """DOC020: no training forward of the model returned a loss, so DOC018 was not judged (said by rank 0).
    `seen_from`: "hf" (the Trainer's adapter) or "ddpdoctor run" (a plain loop, attached without code)."""
    from ddpdoctor.core import codes

    where = ("it was computed outside the model: a compute_loss_func, label smoothing" if seen_from == "hf" else
             "the script computes it from the model's outputs, where `ddpdoctor run` cannot see it")
    return codes.finding(
        "DOC020", "callback",
        f"The loss was not watched: in {steps} steps the model's forward returned no loss ({where}), so which rank's "
        "loss went NaN first (DOC018) cannot be said",
        ranks=tuple(range(world_size)), nodes=(),
        evidence={"steps": steps, "seen_from": "the model's outputs.loss" if seen_from == "hf" else
                  "the DDP model's outputs (ddpdoctor run)"})
