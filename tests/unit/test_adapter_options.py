"""The adapters' options: each fit builds its Doctor from its own trainer, not the last one's.

The frameworks' base classes are stood in for (an empty class under their import names), so
this runs where Lightning and transformers are not installed; the real fits are
tests/ranks/test_adapters_e2e.py.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import torch
from torch import nn

from ddpdoctor import adapters


def _stand_in(monkeypatch, dotted: str, **names) -> None:
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        module = types.ModuleType(".".join(parts[:i]))
        if i == len(parts):
            module.__dict__.update(names)
        monkeypatch.setitem(sys.modules, module.__name__, module)


def test_a_second_lightning_fit_watches_its_own_optimizer(monkeypatch):
    _stand_in(monkeypatch, "lightning.pytorch.callbacks", Callback=object)
    callback = adapters.lightning_callback(every=5)
    doctors = []
    for _ in range(2):
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = SimpleNamespace(strategy=SimpleNamespace(model=model), optimizers=[optimizer], train_dataloader=None)
        callback.on_train_start(trainer, model)
        doctors.append((callback.doctor, optimizer))
        callback.on_train_end(trainer, model)
    assert [d.optimizer for d, _ in doctors] == [o for _, o in doctors]
    assert doctors[0][0].every == 5 and doctors[1][0].every == 5


def test_a_second_hf_training_watches_its_own_optimizer_and_batch(monkeypatch):
    _stand_in(monkeypatch, "transformers", TrainerCallback=object)
    callback = adapters.hf_callback()
    seen = []
    for batch in (8, 16):
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        args = SimpleNamespace(per_device_train_batch_size=batch, gradient_accumulation_steps=2)
        callback.on_train_begin(args, None, None, model=model, train_dataloader=None, optimizer=optimizer)
        seen.append((callback.doctor.optimizer is optimizer, callback.doctor.batch_size))
        callback.doctor.close()
    assert seen == [(True, 16), (True, 32)]
