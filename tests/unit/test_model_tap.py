"""What an adapter reads off the model for a framework that hides it (callback/model_tap.py), and the wait a
framework spends in its own collective between steps (`Doctor.framework_wait`), on one process."""

from __future__ import annotations

import time

import torch
from torch import nn

from ddpdoctor.callback.doctor import Doctor
from ddpdoctor.callback.model_tap import ModelTap


class Returns(nn.Module):
    """A Hugging Face-shaped model: keyword inputs, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.fc(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _doctor(model: nn.Module) -> Doctor:
    return Doctor(model, every=10**6, check_every_s=0)


def test_the_first_training_forward_of_a_step_is_its_batch_and_the_micro_batches_losses_are_summed():
    model = Returns()
    doctor = _doctor(model)
    tap = ModelTap(model, doctor)
    try:
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        model(x=x, labels=y)  # outside a step (before training begins): not the step's
        assert doctor._batch is None and tap.take_loss() is None
        doctor.step_begin(None)
        first = model(x=x, labels=y)["loss"]
        second = model(x=x[:4], labels=y[:4])["loss"]  # a second micro-batch (gradient accumulation)
        model.eval()
        model(x=x, labels=y)  # evaluation inside the step: not a training forward
        model.train()
        assert doctor._batch["x"] is x and doctor._batch["labels"] is y  # the first forward's inputs
        loss = tap.take_loss()
        assert loss is not None and not loss.requires_grad
        assert torch.equal(loss, (first + second).detach())
        assert tap.take_loss() is None  # once per step
        doctor.step_end(loss)
    finally:
        tap.close()
        doctor.close()
    assert not model._forward_pre_hooks and not model._forward_hooks  # gone at close


def test_a_nan_in_any_micro_batch_reaches_the_loss_watch():
    model = Returns()
    doctor = _doctor(model)
    tap = ModelTap(model, doctor)
    try:
        for step in range(1, 4):
            doctor.step_begin(None)
            x = torch.randn(8, 4)
            model(x=x * float("nan") if step == 2 else x, labels=torch.zeros(8, dtype=torch.long))
            model(x=torch.randn(8, 4), labels=torch.zeros(8, dtype=torch.long))  # a finite second micro-batch
            doctor.step_end(tap.take_loss())
        assert doctor._loss.take(3) == 2
    finally:
        tap.close()
        doctor.close()


def test_outputs_without_a_scalar_loss_and_a_failing_read_never_break_the_forward():
    model = nn.Linear(4, 2)  # returns a tensor: no loss to read
    doctor = _doctor(model)
    tap = ModelTap(model, doctor)
    try:
        doctor.step_begin(None)
        model(torch.randn(3, 4))
        assert tap.take_loss() is None and not tap.loss_seen
        assert isinstance(doctor._batch, tuple) and doctor._batch[0].shape == (3, 4)  # positional inputs
        doctor.see_batch = None  # type: ignore[assignment]  (a tap whose doctor fails)
        doctor._batch = None
        model(torch.randn(3, 4))  # no exception reaches the user's forward
        doctor.step_end()
    finally:
        tap.close()
        doctor.close()


def test_a_framework_s_wait_between_steps_counts_as_waiting_not_as_data():
    """Lightning broadcasts a flag before every batch: the time spent there is peers' lateness, and the row
    moves it from the data time into the step and its wait; a plain loop's rows are unchanged."""
    model = nn.Linear(4, 2)
    doctor = _doctor(model)
    try:
        for _ in range(3):
            doctor.step_begin(None)
            doctor.step_end()
            time.sleep(0.02)  # 20 ms between steps, of which the framework says 15 were its collective
            doctor.framework_wait(15.0)
        doctor.step_begin(None)
        doctor.step_end()
        row = doctor._window_row()
    finally:
        doctor.close()
    gaps = list(zip(row.data_ms, row.step_ms, row.wait_ms))
    assert len(gaps) == 4 and gaps[0][0] == 0.0
    for data, step, wait in gaps[1:]:
        assert 4.0 <= data <= 15.0, data  # 20 ms and more between steps, less the 15 of waiting
        assert wait >= 15.0 and step >= 15.0
    # A wait longer than the gap itself (a clock's rounding) never makes the data time negative.
    doctor = _doctor(model)
    try:
        doctor.step_begin(None)
        doctor.step_end()
        doctor.framework_wait(1e6)
        doctor.step_begin(None)
        doctor.step_end()
        assert min(doctor._data_ms) == 0.0
    finally:
        doctor.close()


def test_lightning_s_broadcast_before_each_batch_is_timed_and_handed_over_as_waiting():
    """Lightning 2.x's epoch loop calls `_broadcast_sigterm_tensor` before every batch (a collective outside
    the callback's step); the adapter times that call on this loop only, and a Lightning without it is left
    as it is."""
    from types import SimpleNamespace

    from ddpdoctor.adapters import _time_between_steps_collective

    class Loop:
        def _broadcast_sigterm_tensor(self) -> str:
            time.sleep(0.01)
            return "done"

    seen: list[float] = []
    doctor = SimpleNamespace(framework_wait=seen.append)
    loop = Loop()
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop))
    assert _time_between_steps_collective(trainer, doctor) is loop  # type: ignore[arg-type]
    assert loop._broadcast_sigterm_tensor() == "done" and len(seen) == 1 and 9.0 <= seen[0] <= 200.0
    del loop._broadcast_sigterm_tensor  # what on_train_end does: Lightning's own method again
    loop._broadcast_sigterm_tensor()
    assert len(seen) == 1 and "_broadcast_sigterm_tensor" not in vars(Loop())
    assert _time_between_steps_collective(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=object())),
                                          doctor) is None  # type: ignore[arg-type]


def test_a_loss_the_model_never_returned_is_said_not_watched_and_reported_by_rank_0():
    from ddpdoctor.callback.model_tap import unseen_loss

    model = nn.Linear(4, 2)
    doctor = _doctor(model)
    try:
        finding = unseen_loss(world_size=2, steps=110)
        assert finding.code == "DOC020" and finding.ranks == (0, 1) and "110 steps" in finding.title
        doctor.tell([finding])
        assert [f.code for f in doctor.report()] == ["DOC020"]
        doctor.tell([finding])  # once
        assert [f.code for f in doctor.report()] == ["DOC020"]
    finally:
        doctor.close()
