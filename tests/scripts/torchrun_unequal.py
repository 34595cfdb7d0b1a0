"""Trains under torchrun with rank 1 three times slower, recording which rank trained which
sample: `torchrun ... torchrun_unequal.py OUT_DIR`. Used by tests/test_torchrun.py: the ranks
claim batches first-come from torchrun's store, so every sample is trained once an epoch and
the faster rank trains more of each round."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from parallelwrapper import ParallelWrapper


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]) -> torch.Tensor:
    x, y, ids, out = batch
    rank = dist.get_rank()
    time.sleep(0.03 if rank == 1 else 0.01)
    with open(Path(out) / f"ids{rank}.txt", "a") as f:
        f.write("".join(f"{i}\n" for i in ids.tolist()))
    return nn.functional.cross_entropy(model(x), y)


def main(out: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g), torch.arange(8 * i, 8 * i + 8), str(out)) for i in range(41)]
    builder = ParallelWrapper.builder(net).averaging_frequency(4).threads_per_worker(1).training_step(step)
    with builder.build() as wrapper:
        history = wrapper.fit(data, epochs=2)
        if wrapper.is_main:
            (out / "history.json").write_text(json.dumps({"iterations": [e.iteration for e in history.epochs]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
