"""Every rank starts from rank 0's state: `torchrun ... torchrun_same_start.py OUT_DIR`.

Each rank seeds itself differently on purpose and builds an unseeded model, so the ranks' initial
weights differ; it saves them to OUT_DIR/initial{r}.pt, fits at lr 0 with SGD, and saves its model
after fit() to OUT_DIR/final{r}.pt. Used by tests/test_torchrun.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

from parallelwrapper import ParallelWrapper

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny import make_batches


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(100 + rank)  # each rank draws its own weights
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    torch.save(net.state_dict(), out / f"initial{rank}.pt")
    builder = ParallelWrapper.builder(net).optimizer(torch.optim.SGD, lr=0.0).averaging_frequency(2).threads_per_worker(1)
    with builder.build() as wrapper:
        wrapper.fit(make_batches(8), epochs=1)
        torch.save(net.state_dict(), out / f"final{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
