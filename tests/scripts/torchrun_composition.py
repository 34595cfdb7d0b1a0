"""Trains with `.hierarchy("node")` and each other communication option in turn, under torchrun
with two processes per node, and saves each rank's final model per option:
`torchrun ... torchrun_composition.py OUT_DIR`. Used by tests/test_composition.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

from parallelwrapper import ParallelWrapper

OPTIONS = ("overlap", "outer", "bfloat16", "warmup", "replace", "auto")


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(22)]


def main(out: Path) -> None:
    for option in OPTIONS:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        builder = (
            ParallelWrapper.builder(net).optimizer(torch.optim.SGD, lr=0.1, momentum=0.9).averaging_frequency(2)
            .hierarchy("node").threads_per_worker(1)
        )  # fmt: skip
        if option == "overlap":
            builder = builder.overlap_averaging(True)
        elif option == "outer":
            builder = builder.outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        elif option == "bfloat16":
            builder = builder.payload_dtype(torch.bfloat16)
        elif option == "warmup":
            builder = builder.warmup_sync_steps(2)
        elif option == "replace":
            builder = builder.on_worker_failure("replace")  # torchrun restarts the group itself: a note
        else:  # a node's two ranks choose alike from the sums over both nodes and both ranks
            builder = builder.averaging_frequency("auto", k_min=1, k_max=4)
        with builder.build() as wrapper:
            history = wrapper.fit(data(), epochs=1)
            torch.save({"model": net.state_dict(), "iterations": wrapper.counters.iterations, "scores": [s.score for s in history.scores]},
                       out / f"{option}-rank{os.environ['RANK']}.pt")  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
