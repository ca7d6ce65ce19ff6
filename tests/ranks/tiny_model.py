"""A user's own model and batches, as `--model` and `--batch` take them (tests/ranks/test_scaling_e2e.py).

A small convolutional classifier: other parameter shapes, other gradient sizes and another
input than the built-in MLP, so a test can tell whose model a rank trained.
"""

import torch
from torch import nn

CLASSES = 7


def make_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def make_batch(batch_size: int):
    return torch.randn(batch_size, 3, 16, 16), torch.randint(0, CLASSES, (batch_size,))


def parameter_count() -> int:
    return sum(p.numel() for p in make_model().parameters())


def not_a_model():
    return "a string"


def wrong_batch(batch_size: int):
    return torch.randn(batch_size, 5)  # no targets
