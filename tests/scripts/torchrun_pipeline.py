"""Trains LeNet under torchrun as pipelines of 2 stages (`.pipeline(stages=2)`: ranks 2w and
2w + 1 are worker w's stages, on one node), validating after every round, and saves each rank's
final whole state and validations:
`torchrun ... torchrun_pipeline.py OUT_DIR`. Used by tests/test_pipeline.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from parallelwrapper import ParallelWrapper
from parallelwrapper.app.models import LeNet
from parallelwrapper.wrapper import Builder


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(6)]


def validation_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """3 batches, the last of 3 samples: fewer than 4 microbatches would cut."""
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in (8, 8, 3)]


def builder(model: torch.nn.Module) -> Builder:
    """Validated after every round."""
    return (
        ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9).averaging_frequency(2)
        .deterministic(True).threads_per_worker(1).stall_timeout(60).validation(validation_data(), every=1)
    )  # fmt: skip


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = LeNet()
    with builder(model).pipeline(stages=2, microbatches=2).build() as wrapper:
        history = wrapper.fit(data())
        state = {
            "model": model.state_dict(), "placement": str(wrapper.placement), "world_size": wrapper.world_size,
            "validations": [v.metrics for v in history.validations],
        }  # fmt: skip
        torch.save(state, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
