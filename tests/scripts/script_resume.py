"""A recipe whose optimizer and schedule are functions of this script, as a user writes them:
`python script_resume.py CHECKPOINT_DIR EPOCHS OUT [--resume] [--one-group | --renamed] [--accept]`.

It trains 2 spawned workers (dealt, so that runs are reproducible) with checkpoints in
CHECKPOINT_DIR, optionally resuming from them, and saves the final parameters to OUT.
`--one-group` builds the optimizer with another function of one group (a real change),
`--renamed` with the same function under another name; `--accept` resumes across either with
`accept_changes=["optimizer"]`.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from parallelwrapper import ParallelWrapper
from parallelwrapper.naming import qualified


def decay(step: int, rate: float) -> float:
    return float(rate**step)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Weight decay on weights only: the parameter groups of a real recipe."""
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    others = [p for name, p in model.named_parameters() if not name.endswith("weight")]
    groups = [{"params": weights, "weight_decay": 5e-4}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)


def one_group(model: nn.Module) -> torch.optim.Optimizer:
    """A real change: one group, where the checkpoint's optimizer has two."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)


def renamed(model: nn.Module) -> torch.optim.Optimizer:
    """The same groups under another name, as after moving the function into a module."""
    return make_optimizer(model)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(decay, rate=0.98))


OPTIMIZERS = {"--one-group": one_group, "--renamed": renamed}


def main(directory: str, epochs: int, out: str, flags: set[str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(12)]
    wrapper = (
        ParallelWrapper.builder(model).workers(2).threads_per_worker(1).deterministic(True).averaging_frequency(2)
        .optimizer(next((OPTIMIZERS[flag] for flag in sorted(flags) if flag in OPTIMIZERS), make_optimizer))
        .lr_scheduler(make_scheduler, interval="step")
        .loss_fn(nn.functional.cross_entropy).checkpoint(directory, every=2).build()
    )
    resume = directory if "--resume" in flags else None
    accept = ["optimizer"] if "--accept" in flags else []
    with wrapper:
        wrapper.fit(data, epochs=epochs, resume=resume, accept_changes=accept)
    torch.save([p.detach().clone() for p in model.parameters()], out)
    print(f"NAMED {qualified(make_optimizer)}", flush=True)


if __name__ == "__main__":  # spawned workers import this script as __mp_main__
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], set(sys.argv[4:]))
