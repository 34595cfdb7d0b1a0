"""Trains slowly with checkpoints on and prints each score, so a test can press Ctrl-C mid-fit:
`python interrupt_train.py CHECKPOINT_DIR WORKERS`."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from parallelwrapper import ParallelWrapper, Score


def slow_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    time.sleep(0.05)
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def announce(score: Score) -> None:
    print(f"SCORE {score.round}", flush=True)


def main(directory: str, workers: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    data = [(torch.randn(16, 10), torch.randint(0, 3, (16,))) for _ in range(2000)]
    builder = (
        ParallelWrapper.builder(model).workers(workers).threads_per_worker(1).training_step(slow_step)
        .checkpoint(directory, every=10_000).listeners(announce)
    )
    with builder.build() as wrapper:
        wrapper.fit(data, epochs=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
