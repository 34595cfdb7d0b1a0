"""The small model and random batches that several test modules train (10 features, 3 classes),
what their resume tests compare, and how their scripts leave a file for a test that polls for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def make_batches(n: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 10, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def write_whole(path: Path, text: str) -> None:
    """`text` into `path`, whole or not at all: written beside it, then renamed into place, for a
    test that reads the file as soon as its name appears."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.rename(path)


def weights_and_outer_momenta(wrapper: Any) -> list[torch.Tensor]:
    """A wrapper's parameters after fit(), then its outer optimizer's momentum buffers."""
    assert wrapper.outer_optimizer is not None
    momenta = [s["momentum_buffer"] for s in wrapper.outer_optimizer.state_dict()["state"].values()]
    return [p.detach().clone() for p in wrapper.model.parameters()] + momenta
