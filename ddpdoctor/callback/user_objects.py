"""Readings of the objects a job hands `Doctor`: its batch, model, optimizer, loader and store.

Apart from `Doctor`'s step flow because each answers one question about someone else's object
(is the model wrapped, is the loader sharded, what is in the batch) and is tested on its own;
torch is imported inside each, so importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def fingerprint(batch: Any) -> int:
    """52 bits of a SHA-1 over strided samples of the batch's first tensors; 0 for a batch with none.

    Of a batch already on the CPU (a GPU batch is read one check late: callback/gather.py)."""
    from ddpdoctor.callback.gather import _digest, _sample

    return _digest([_sample(t).cpu() for t in tensors(batch)[:4]]) or 0


_TENSOR: Any = None  # torch.Tensor, once the step path first asks (this module imports no torch)


def batch_len(batch: Any) -> float:
    """The batch's first dimension, as the step path reads it each step (0.0: not known).

    The common shapes (a tensor, a tuple or list starting with one, a dict whose first value is
    one) are read without a walk; anything else through `first_tensor`. Its cost is the step's: right
    after a step's compute every cache is cold, and an `import torch` statement, a lookup in torch's
    module took 9 µs there (0.9 µs in a hot loop); the class is kept here instead. (`len(tensor)` is no
    cheaper: Tensor.__len__ is Python.)"""
    global _TENSOR
    tensor = _TENSOR
    if tensor is None:
        import torch

        tensor = _TENSOR = torch.Tensor
    kind = type(batch)
    if (kind is tuple or kind is list) and batch:
        batch = batch[0]
    elif kind is dict and batch:
        batch = next(iter(batch.values()))
    if not isinstance(batch, tensor):
        batch = first_tensor(batch)
        if batch is None:
            return 0.0
    shape = batch.shape
    return float(shape[0]) if shape else 0.0


def safely(read: Callable[[], T]) -> Optional[T]:
    """A local reading, or None (unknown) where it fails: the training loop never sees our errors."""
    try:
        return read()
    except Exception:
        return None


def tensors(batch: Any) -> list[torch.Tensor]:
    import torch

    if isinstance(batch, torch.Tensor):
        return [batch] if batch.layout == torch.strided and batch.numel() else []
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in tensors(item)]
    return []


def first_tensor(batch: Any) -> Optional[torch.Tensor]:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):  # dicts, and Hugging Face's BatchEncoding (a UserDict)
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def is_wrapped(model: Any, ddp_class: Any) -> bool:
    """DDP, or another data-parallel wrapper that averages gradients (FSDP, DeepSpeed), or
    torch.compile of one of them: not DOC004."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile(DDP(m))
    if isinstance(inner, ddp_class):
        return True
    name = type(inner).__name__
    # FSDP1's wrapper, FSDP2's fully_shard (it renames the class "FSDP<name>"), a DeepSpeed engine.
    return "FullyShardedDataParallel" in name or name.startswith("FSDP") or "DeepSpeed" in name


def learning_rates(optimizer: Any) -> list[float]:
    """Each parameter group's base rate: a scheduler's `initial_lr` (the warm-up's start is not the rate)."""
    out = []
    for group in getattr(optimizer, "param_groups", None) or []:
        lr = group.get("initial_lr", group.get("lr"))
        if hasattr(lr, "item"):  # a tensor learning rate (capturable optimizers)
            if getattr(lr, "is_cuda", False):
                continue  # reading it would wait for the GPU: the rate is not known here
            lr = lr.item()
        if isinstance(lr, (int, float)):
            out.append(float(lr))
    return out


def unsharded_sampler(loader: Any, sampler: Any) -> Optional[str]:
    """The sampler's class name when nothing in the loader shards the data; None otherwise.

    Frameworks shard in their own ways: Lightning swaps in a DistributedSampler, Accelerate
    (Hugging Face) wraps the loader and its batch sampler ("...Shard")."""
    if loader is None or sampler is None:
        return None
    names = [type(x).__name__ for x in (loader, sampler, getattr(loader, "batch_sampler", None)) if x is not None]
    if any("Distributed" in n or "Shard" in n or "Dispatcher" in n or n.startswith("_Infinite") for n in names):
        return None  # sharded, dispatched by Accelerate, or an IterableDataset (which shards itself)
    return type(sampler).__name__


def default_store() -> Optional[torch.distributed.Store]:
    """The job's own rendezvous store (torch keeps no public handle to it), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def gather_device(nccl: bool, model_device: torch.device) -> torch.device:
    """Where the callback's own gather runs: the model's GPU under NCCL (its index, not the current
    device, which a job that never called set_device leaves at 0 on every rank); CPU otherwise."""
    import torch

    if not nccl:
        return torch.device("cpu")
    if model_device.type == "cuda":
        index = model_device.index if model_device.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cuda", torch.cuda.current_device())
