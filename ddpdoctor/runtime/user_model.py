"""The user's own model and batches in place of the built-in workload (`--model`, `--batch`).

Timings of a 400k-parameter MLP say little about a 7B-parameter job: its gradient buckets,
its all-reduce sizes and its compute-to-communication ratio are the user's. So `check`,
`scaling` and the probes can train the user's model on the user's batches instead.

The contract (docs/scaling.md):
- `--model module:function` (or `path/to/file.py:function`): `function()` returns a
  `torch.nn.Module`, on the CPU; ddpdoctor moves it to the rank's device.
- `--batch module:function`: `function(batch_size)` returns `(inputs, targets)`: tensors,
  or a tuple of tensors for `inputs`. Integer targets of one dimension are class indices
  (cross-entropy); anything else is regressed (mean squared error); a model whose output
  is already a scalar is its own loss.
Everything is checked once, in the CLI, before any rank starts: a wrong path or a wrong
shape is one line saying which and how to fix it, not a traceback on every rank.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ddpdoctor.core.errors import UsageError


@dataclass(frozen=True)
class ModelSpec:
    """Where the user's factories live; both None means the built-in workload."""

    model: Optional[str] = None
    batch: Optional[str] = None

    @property
    def builtin(self) -> bool:
        return self.model is None


def _load_module(target: str, flag: str) -> Any:
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise UsageError(f"{flag}: no such file {target}")
        name = f"ddpdoctor_user_{abs(hash(path))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"{flag}: {target} cannot be loaded as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loader = spec.loader
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's package in the current folder
        try:
            return importlib.import_module(target)
        except ImportError as exc:
            missing = getattr(exc, "name", None)
            if missing and not target.startswith(missing):
                raise UsageError(f"{flag}: importing {target!r} needs {missing!r}, which is not installed here "
                                 f"({_line(exc)})") from None
            raise UsageError(f"{flag}: cannot import {target!r} ({type(exc).__name__}: {exc}); run from the folder "
                             "that holds it, or give a file path (path/to/file.py:function)") from None
        except (Exception, SystemExit) as exc:
            raise UsageError(f"{flag}: importing {target!r} raised {_raised(exc)}") from None
    try:
        loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        raise UsageError(f"{flag}: running {target} raised {_raised(exc)}") from None
    return module


def resolve(text: str, flag: str) -> Callable[..., Any]:
    """`module:function` or `file.py:function` (dotted names reach into classes) → the callable."""
    target, sep, attr = text.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"{flag} {text!r}: give module:function or path/to/file.py:function")
    value: Any = _load_module(target, flag)
    for part in attr.split("."):
        if not hasattr(value, part):
            raise UsageError(f"{flag} {text!r}: {target} has no {attr!r}")
        value = getattr(value, part)
    if not callable(value):
        raise UsageError(f"{flag} {text!r}: {attr} is {_shape(value)}, not a function")
    return value


def _raised(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return (f"SystemExit({exc.code}): it exits when imported or called (argparse at the top of the file?); "
                "put that code under `if __name__ == \"__main__\":`")
    return f"{type(exc).__name__}: {_line(exc)}"


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _tensors(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


def to_device(value: Any, device: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(v.to(device, non_blocking=True) for v in value)
    return value.to(device, non_blocking=True)


def forward(model: Any, inputs: Any) -> Any:
    """A tuple of inputs is the model's positional arguments."""
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def batch_size_of(inputs: Any) -> int:
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    return int(first.shape[0]) if first.dim() > 0 else 1


def loss_of(output: Any, targets: Any) -> Any:
    """The loss the contract promises: the model's own scalar, cross-entropy on class indices, else MSE."""
    import torch
    from torch.nn import functional

    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not targets.is_floating_point() and targets.dim() == 1:
        return functional.cross_entropy(output, targets)
    return functional.mse_loss(output.float(), targets.float().reshape(output.shape))


class UserWorkload:
    """The user's model and batches, called the same way on every rank."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.make_model = resolve(spec.model or "", "--model")
        self.make_batch = resolve(spec.batch or "", "--batch")

    def model(self, device: Any, seed: int) -> Any:
        import torch

        torch.manual_seed(seed)
        model = self.make_model()
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"--model {self.spec.model} returned {_shape(model)}: return a torch.nn.Module")
        return model.to(device)

    def batch(self, batch_size: int, seed: int) -> tuple[Any, Any]:
        import torch

        torch.manual_seed(seed)  # the user's function may draw from torch's global generator
        produced = self.make_batch(batch_size)
        if not (isinstance(produced, tuple) and len(produced) == 2 and _tensors(produced[0])
                and isinstance(produced[1], torch.Tensor)):
            raise UsageError(f"--batch {self.spec.batch} returned {_shape(produced)}: return (inputs, targets), "
                             "tensors (inputs may be a tuple of tensors)")
        return produced[0], produced[1]

    def batches(self, batch_size: int, rank: int, count: int) -> list[tuple[Any, Any]]:
        """`count` batches for this rank, each drawn with its own seed, as a sampler would shard."""
        return [self.batch(batch_size, 1000 * rank + i) for i in range(count)]


def validate(spec: ModelSpec, batch_size: int = 2) -> dict[str, Any]:
    """Build the model, make a batch, run forward and backward once on the CPU; one line on any failure."""
    import torch

    if spec.model is None and spec.batch is None:
        return {}
    if spec.model is None or spec.batch is None:
        raise UsageError("--model and --batch go together: the batch function feeds the model "
                         "(see docs/scaling.md, 'Your own model')")
    work = UserWorkload(spec)
    try:
        model = work.model(torch.device("cpu"), 0)
    except UsageError:
        raise
    except (Exception, SystemExit) as exc:
        raise UsageError(f"--model {spec.model}: calling it raised {_raised(exc)}") from None
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise UsageError(f"--model {spec.model}: the model has no trainable parameters, so DDP has nothing to all-reduce")
    try:
        inputs, targets = work.batch(batch_size, 0)
    except UsageError:
        raise
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--batch {spec.batch}: calling it with batch_size={batch_size} raised "
                         f"{type(exc).__name__}: {_line(exc)}; it must return (inputs, targets)") from None
    except (Exception, SystemExit) as exc:
        raise UsageError(f"--batch {spec.batch}: calling it raised {_raised(exc)}") from None
    if batch_size_of(inputs) != batch_size:
        raise UsageError(f"--batch {spec.batch}: asked for {batch_size} samples, the inputs hold "
                         f"{batch_size_of(inputs)} along dimension 0")
    try:
        loss = loss_of(forward(model, inputs), targets)
        if loss.dim() != 0:
            raise ValueError(f"the loss has shape {tuple(loss.shape)}, not a scalar")
        loss.backward()
    except (Exception, SystemExit) as exc:
        raise UsageError(f"--model {spec.model} on a batch from --batch {spec.batch}: {_raised(exc)}") from None
    if all(p.grad is None for p in trainable):
        raise UsageError(f"--model {spec.model}: backward reached no parameter: the loss does not depend on the model")
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        raise UsageError(f"--model {spec.model}: {len(unused)} trainable parameter(s) get no gradient (first: "
                         f"{unused[0]}); DDP without find_unused_parameters fails on them: freeze them "
                         "(requires_grad=False) in the factory, or give a model whose every parameter is used")
    return {"parameters": sum(p.numel() for p in trainable),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in trainable)}


def _shape(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    if type(value).__name__ == "Tensor":
        return f"one tensor of shape {tuple(value.shape)}"
    return f"a value of type {type(value).__name__}"
