"""What a rank's replica of the model is, in a few numbers a rank can compare with its peers'.

DDP keeps every rank's replica bit-identical only because each starts from rank 0's weights
and applies the same averaged gradient with the same optimizer (the DDP design note: "Model
replicas on all DDP processes can keep in sync because they all start from the same state and
they have the same averaged gradients in every iteration"). Nothing checks it at run time. A
digest here is, for every tensor the optimizer steps, the wrapping integer sum of its bits:
exact (any changed bit changes it, whatever the order of the sum: integer addition is
associative, so no thread count, vector width or GPU model makes two equal tensors differ) and
as fast as a read of the tensor (35 ms for 100M float32 parameters on one CPU core of the VM,
against 790 ms for an int64 sum of the same bits, which widens each element first).

Reading only: this module computes numbers on the tensors' own device and never builds a
finding (judge/replicas.py compares; callback/replicas.py gathers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

if TYPE_CHECKING:
    import torch

# Compared per entry: at most this many; more tensors are summed into contiguous groups.
MAX_ENTRIES = 2048
# The optimizer settings compared, per parameter group (the numbers each optimizer keeps there).
SETTING_KEYS = ("lr", "weight_decay", "momentum", "dampening", "beta1", "beta2", "eps", "alpha", "nesterov",
                "amsgrad", "maximize")
MAX_GROUPS = 16
MASK_52 = (1 << 52) - 1  # an int64 sum travels in a float64: its low 52 bits, exactly
UNKNOWN = -1.0  # a setting not kept by this optimizer, or a tensor learning rate on a GPU (not read)


@dataclass(frozen=True)
class Entry:
    """One compared entry: a tensor the optimizer steps (or several, summed, past MAX_ENTRIES)."""

    names: tuple[str, ...]
    averaged: bool  # every tensor of it is a parameter DDP averages the gradient of
    numel: int


@dataclass
class Layout:
    """What the optimizer steps, in its order, named from the model: the same on every rank of a sane job."""

    entries: list[Entry]
    groups: list[list[int]]  # per entry, the indices into `tensors`
    tensors: list[Any] = field(repr=False)  # the optimizer's tensors, in its param_groups order
    group_sizes: list[int] = field(default_factory=list)  # tensors per optimizer param group


def layout(optimizer: Any, model: Any, averaged: Optional[set[int]] = None) -> Layout:
    """The optimizer's tensors as entries named by the model's parameter names (`module.` dropped).

    `averaged`: ids of the parameters whose gradients DDP averages (None: all of the model's)."""
    names: dict[int, str] = {}
    for name, p in getattr(model, "named_parameters", lambda: [])():
        names.setdefault(id(p), name[len("module."):] if name.startswith("module.") else name)
    tensors: list[Any] = []
    labels: list[str] = []
    sizes = []
    for g, group in enumerate(getattr(optimizer, "param_groups", None) or []):
        params = list(group.get("params", []))
        sizes.append(len(params))
        for k, p in enumerate(params):
            tensors.append(p)
            labels.append(names.get(id(p)) or f"a tensor of shape {tuple(p.shape)} outside the model (optimizer group {g}, "
                          f"tensor {k})")
    owned = averaged if averaged is not None else set(names)
    per = max(1, math.ceil(len(tensors) / MAX_ENTRIES))
    groups = [list(range(i, min(i + per, len(tensors)))) for i in range(0, len(tensors), per)]
    entries = [Entry(tuple(labels[i] for i in idx), all(id(tensors[i]) in owned for i in idx),
                     sum(int(tensors[i].numel()) for i in idx)) for idx in groups]
    return Layout(entries, groups, tensors, sizes)


def averaged_by(ddp_model: Any) -> Optional[set[int]]:
    """Ids of the parameters a DDP model averages: those it holds that require a gradient now and
    that it was not told to ignore (read when the Doctor is made, as DDP read them when it was)."""
    params = getattr(ddp_model, "_module_parameters", None)
    if params is None:
        return None
    return {id(p) for p in params if p.requires_grad}


def bitsum(tensor: torch.Tensor) -> torch.Tensor:
    """The wrapping integer sum of the tensor's bits, as a 0-d int tensor on its device (no wait)."""
    import torch

    if tensor.layout != torch.strided:  # a sparse tensor has no flat view of its values: not compared
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    flat = tensor.detach().reshape(-1)
    size = flat.element_size()
    if size == 4:
        return flat.view(torch.int32).sum(dtype=torch.int32).to(torch.int64)
    if size == 8:
        return flat.view(torch.int64).sum().bitwise_and(MASK_52)
    if size == 2:
        return flat.view(torch.int16).sum(dtype=torch.int32).to(torch.int64)
    return flat.view(torch.uint8).sum(dtype=torch.int64).bitwise_and(MASK_52)


def digest(layout_: Layout, grads: bool = False) -> torch.Tensor:
    """Per entry, the bitsum of its tensors (or of their gradients: -1 where one has none), as one
    float64 tensor on the tensors' device. Summing happens there; reading it is the caller's (late, on a GPU)."""
    import torch

    if not layout_.tensors:
        return torch.zeros(0, dtype=torch.float64)
    device = layout_.tensors[0].device
    sums = []
    for idx in layout_.groups:
        parts = []
        for i in idx:
            t = layout_.tensors[i]
            source = t.grad if grads else t
            if source is None:
                parts.append(torch.full((), -1, dtype=torch.int64, device=device))
            else:
                parts.append(bitsum(source).to(device))
        sums.append(torch.stack(parts).sum().bitwise_and(MASK_52) if len(parts) > 1 else parts[0])
    return torch.stack(sums).to(torch.float64)


def fingerprint(layout_: Layout) -> torch.Tensor:
    """One number for the whole replica: the wrapping sum of every tensor's bitsum, its low 52 bits,
    as a 0-d int64 on the tensors' device (no wait). Cheap enough, on a small model, to keep one per
    step: equal replicas give equal fingerprints, and the first step they differ dates a divergence."""
    import torch

    if not layout_.tensors:
        return torch.zeros((), dtype=torch.int64)
    device = layout_.tensors[0].device
    return torch.stack([bitsum(t).to(device) for t in layout_.tensors]).sum().bitwise_and(MASK_52)


def norms(layout_: Layout, grads: bool = False) -> torch.Tensor:
    """Per entry, the L2 norm of its tensors (gradients: -1 where none), float64 on their device:
    how far apart differing replicas are. Non-finite values give NaN or inf, as they are."""
    import torch

    if not layout_.tensors:
        return torch.zeros(0, dtype=torch.float64)
    device = layout_.tensors[0].device
    out = []
    for idx in layout_.groups:
        parts = []
        for i in idx:
            t = layout_.tensors[i]
            source = t.grad if grads else t
            if source is None:
                parts.append(torch.full((), -1.0, dtype=torch.float64, device=device))
                continue
            # In its own dtype (no float64 copy of a large tensor); a 16-bit one in float32, whose norm
            # would otherwise overflow its 65504 and read as non-finite.
            values = source.detach() if source.element_size() >= 4 else source.detach().float()
            parts.append(values.norm().to(device, torch.float64))
        out.append(torch.stack(parts).square().sum().sqrt() if len(parts) > 1 else parts[0])
    return torch.stack(out)


def settings(optimizer: Any) -> list[float]:
    """The optimizer's numeric settings, per group (MAX_GROUPS x SETTING_KEYS, UNKNOWN where absent),
    then the number of groups and of tensors per group: what every rank must have alike."""
    groups = list(getattr(optimizer, "param_groups", None) or [])
    out: list[float] = []
    for g in range(MAX_GROUPS):
        group = groups[g] if g < len(groups) else {}
        for key in SETTING_KEYS:
            out.append(_number(group, key) if group else UNKNOWN)
    out.append(float(len(groups)))
    out.extend(float(len(groups[g].get("params", []))) if g < len(groups) else UNKNOWN for g in range(MAX_GROUPS))
    return out


def settings_names() -> list[str]:
    """What each number of `settings` is, in its order."""
    names = [f"group {g} {key}" for g in range(MAX_GROUPS) for key in SETTING_KEYS]
    return names + ["param groups"] + [f"group {g} tensors" for g in range(MAX_GROUPS)]


def _number(group: dict[str, Any], key: str) -> float:
    if key in ("beta1", "beta2"):
        betas = group.get("betas")
        value = betas[0 if key == "beta1" else 1] if isinstance(betas, (tuple, list)) and len(betas) == 2 else None
    else:
        value = group.get(key)
    if value is None:
        return UNKNOWN
    if hasattr(value, "item"):  # a tensor setting (capturable optimizers)
        if getattr(value, "is_cuda", False):
            return UNKNOWN  # reading it would wait for the GPU
        value = value.item()
    try:
        number = float(value)
    except (TypeError, ValueError):
        return UNKNOWN
    return number if math.isfinite(number) else UNKNOWN


def finite_entries(values: Sequence[float]) -> list[bool]:
    """Per entry of a norms vector: finite (a -1 for a missing gradient counts as finite)."""
    return [math.isfinite(v) for v in values]


def named(entries: Iterable[Entry], indices: Iterable[int]) -> list[str]:
    """The tensor names of these entries, in order."""
    listed = list(entries)
    return [name for i in indices for name in listed[i].names]
