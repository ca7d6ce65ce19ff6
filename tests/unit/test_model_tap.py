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
    gaps = []
    try:
        for _ in range(3):
            doctor.step_begin(None)
            doctor.step_end()
            began = time.perf_counter()
            time.sleep(0.02)  # 20 ms between steps, of which the framework says 15 were its collective
            doctor.framework_wait(15.0)
            doctor.step_begin(None)
            gaps.append((time.perf_counter() - began) * 1e3)  # at least the gap the Doctor measured
            doctor.step_end()
        row = doctor._window_row()
    finally:
        doctor.close()
    moved = [(d, s, w) for d, s, w in zip(row.data_ms, row.step_ms, row.wait_ms) if w >= 15.0]
    assert len(moved) == 3, (row.data_ms, row.step_ms, row.wait_ms)
    for (data, step, wait), gap in zip(moved, gaps):
        assert 20.0 - 15.0 - 0.5 <= data <= gap - 15.0 + 0.5, (data, gap)  # the sleep, less the 15 ms of waiting
        assert step >= wait >= 15.0
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


def test_a_tapped_model_copies_and_pickles_without_the_doctor():
    """EMA callbacks deepcopy the model and users torch.save it whole: hooks bound to the tap would drag the
    Doctor and its thread locks along ("cannot pickle '_thread.lock'"), and a local closure does not pickle at
    all. The copy's and the loaded model's hooks do nothing; the job's model is still watched."""
    import copy
    import io

    model = Returns()
    doctor = _doctor(model)
    tap = ModelTap(model, doctor)
    try:
        twin = copy.deepcopy(model)
        saved = io.BytesIO()
        torch.save(model, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        doctor.step_begin(None)
        for other in (twin, loaded):
            other(x=torch.randn(2, 4), labels=torch.zeros(2, dtype=torch.long))
        assert not tap.loss_seen and doctor._batch is None  # a copy is not the job's model
        model(x=torch.randn(2, 4), labels=torch.zeros(2, dtype=torch.long))
        assert tap.loss_seen and doctor._batch is not None
        doctor.step_end(tap.take_loss())
    finally:
        tap.close()
        doctor.close()


def test_the_loss_is_found_in_each_shape_a_framework_returns():
    from types import SimpleNamespace

    from ddpdoctor.callback.loss_watch import loss_of

    loss, logits = torch.tensor(0.5), torch.randn(4, 2)
    assert loss_of({"loss": loss, "logits": logits}, bare_is_loss=False) is loss  # a dict, a ModelOutput
    assert loss_of(SimpleNamespace(loss=loss), bare_is_loss=False) is loss
    assert loss_of((loss, logits), bare_is_loss=False) is loss  # return_dict=False with labels
    assert loss_of((logits,), bare_is_loss=False) is None  # without labels: logits only
    assert loss_of(logits, bare_is_loss=False) is None  # a model's bare output is never its loss...
    assert loss_of(loss, bare_is_loss=False) is loss  # ...unless it is one 0-d value: a model returning its loss
    assert loss_of(loss, bare_is_loss=True) is loss  # Lightning's training_step returns the loss itself
    assert loss_of({"loss": loss}, bare_is_loss=True) is loss and loss_of(None, bare_is_loss=True) is None


def test_a_framework_s_collective_between_steps_is_timed_as_waiting_on_cpu_only_and_undone():
    """Lightning 2.x's epoch loop calls `_broadcast_sigterm_tensor` before every batch, the Trainer
    `_get_num_items_in_batch` (a gather): both outside the callback's step. The adapter times the call on that
    object only, passing its arguments through; `undo` restores the framework's own method unless another
    wrapper replaced ours; a framework without the method, or a job on a GPU, is left as it is."""
    from types import SimpleNamespace

    from ddpdoctor.adapters import time_as_waiting

    class Loop:
        def _broadcast_sigterm_tensor(self, *args: object, **kwargs: object) -> tuple:
            time.sleep(0.01)
            return args, kwargs

    class Wants:  # a Doctor's two attributes used here (weakly referenced, as a Doctor is)
        def __init__(self, device: object) -> None:
            self.device = device

        def framework_wait(self, ms: float) -> None:
            seen.append(ms)

    seen: list[float] = []
    doctor = Wants(torch.device("cpu"))
    loop = Loop()
    timed = time_as_waiting(loop, "_broadcast_sigterm_tensor", doctor)  # type: ignore[arg-type]
    assert timed is not None and timed.name == "_broadcast_sigterm_tensor"
    assert loop._broadcast_sigterm_tensor(1, x=2) == ((1,), {"x": 2})
    assert len(seen) == 1 and 9.0 <= seen[0] <= 500.0
    timed.undo()  # the fit's end: Lightning's own method again
    loop._broadcast_sigterm_tensor()
    assert len(seen) == 1 and "_broadcast_sigterm_tensor" not in vars(loop)
    again = time_as_waiting(loop, "_broadcast_sigterm_tensor", doctor)  # type: ignore[arg-type]
    assert again is not None
    theirs = lambda: None  # noqa: E731  (someone else's wrapper over ours)
    loop._broadcast_sigterm_tensor = theirs  # type: ignore[method-assign]
    again.undo()
    assert vars(loop)["_broadcast_sigterm_tensor"] is theirs  # theirs is kept
    assert time_as_waiting(object(), "_broadcast_sigterm_tensor", doctor) is None  # type: ignore[arg-type]
    on_gpu = Wants(SimpleNamespace(type="cuda"))
    assert time_as_waiting(Loop(), "_broadcast_sigterm_tensor", on_gpu) is None  # type: ignore[arg-type]


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
