"""Trains under torchrun with `.hierarchy("node")` and saves each rank's final state and counters:
`torchrun ... torchrun_hierarchy.py OUT_DIR`. Used by tests/test_torchrun.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

from parallelwrapper import ParallelWrapper


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(16)]


def main(out: Path) -> None:
    net = model()
    builder = (
        ParallelWrapper.builder(net).optimizer(torch.optim.SGD, lr=0.1, momentum=0.9).averaging_frequency(2)
        .hierarchy("node").deterministic(True).threads_per_worker(1)
    )  # fmt: skip
    with builder.build() as wrapper:
        wrapper.fit(data(), epochs=2)
        state = {"model": net.state_dict(), "optimizer": wrapper.optimizer.state_dict(), "iterations": wrapper.counters.iterations}
        torch.save(state, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
