"""What a round asks of ranks that train as one worker, each step taken together: the `Lockstep` protocol, which hierarchy/ implements.

Under `.hierarchy("node")` a node's ranks are such a group: each local step is taken on their
gradients averaged over the group, so their replicas stay equal, and the round protocol runs
across the groups, each one worker of it, its ranks splitting the state's exchange between them
(averaging.Shards). The engine (engine.py) asks a group's rank its part in a round's local work
(`Steps.run`), and the rest of a round is the same as any worker's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..averaging import Shards
from ..types import Batch
from .trainer import Trainer


@dataclass
class StepsTaken:
    """What a group of ranks did in a round's local work, the same on each of its ranks."""

    samples: int = 0
    loss_sum: float = 0.0
    batches: int = 0
    steps: int = 0  # the steps the group took together (each of up to its ranks' batches)
    finished: bool = False  # no rank of the group had a batch left in the epoch


class Steps(Protocol):
    """One rank's side of its group's steps in a round's local work."""

    def run(self, steps: int, first_step: int, epoch: int, next_batch: Callable[[], tuple[int, Batch] | None], finished: Callable[[], bool]) -> StepsTaken:
        """Up to `steps` steps together, global steps `first_step` on, this rank's batches from
        `next_batch` (None: none left in the round), `finished` saying whether its feed's epoch
        has ended; the group's work."""
        ...

    def release(self) -> None:
        """The fit is over: its buffers go."""


class Lockstep(Protocol):
    """A group of ranks that trains as one worker of the round protocol, as one rank of it sees it."""

    @property
    def size(self) -> int:
        """Its ranks."""
        ...

    @property
    def shards(self) -> Shards:
        """How its ranks split the state's exchange with the other groups."""
        ...

    def steps(self, trainer: Trainer, device: torch.device) -> Steps:
        """This rank's side of the group's steps, for `trainer` on `device`."""
        ...


__all__ = ["Lockstep", "Steps", "StepsTaken"]
