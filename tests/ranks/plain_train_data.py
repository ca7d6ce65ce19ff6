"""The unedited script's own helper module, imported as a sibling (`sys.path[0]` must be the script's folder)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

BATCH = 32
BATCHES = 8  # per rank and epoch


def make_data(world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = BATCH * BATCHES * world
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 4, (n,), generator=g))
