"""The small model and random batches that several test modules train: 10 features, 3 classes."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def make_batches(n: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 10, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]
