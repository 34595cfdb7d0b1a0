"""What the round protocol asks of a worker: the `Trainer` protocol, which worker.Replica implements.

A worker holds its model and optimizer, its steps, the NaN policy, its state, its share of a
validation, what it does when a round lands (its learning-rate schedule catches up) and at a
fit's start and end. The round loop (engine.Rounds) calls it; it never calls the loop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from ..types import Batch, Counters, StateDict, TrainingState


class OuterParameters(Protocol):
    """A worker's outer optimizer step (outer.OuterStep), as an overlapped landing needs it."""

    params: list[torch.Tensor]  # the parameters it moves


class WithOuter(Protocol):
    """A worker's parts (parts.Parts), as an overlapped landing needs them."""

    @property
    def outer(self) -> OuterParameters | None: ...


class Trainer(Protocol):
    """A worker's model, optimizer and steps (worker.Replica)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    local_steps: int  # optimizer steps this worker has taken

    @property
    def parts(self) -> WithOuter:
        """Its parts: the parameters its outer optimizer moves, if it has one."""

    @property
    def validates(self) -> bool:
        """It has validation data."""

    def train_step(self, epoch: int, index: int, batch: Batch) -> tuple[torch.Tensor, int]:
        """AVERAGING: one whole local step; (loss·n, n)."""

    def accumulate(self, epoch: int, index: int, batch: Batch) -> tuple[torch.Tensor, int]:
        """SHARED_GRADIENTS: forward and backward into .grad; (loss·n, n)."""

    def step(self) -> None:
        """SHARED_GRADIENTS: the optimizer step on the averaged gradients."""

    def checked_loss(self, losses: list[torch.Tensor], first_step: int, epoch: int) -> tuple[float, bool]:
        """Σ loss·n of a round, and whether the NaN policy drops it."""

    def saved_state(self, writes: bool) -> TrainingState | None:
        """What a checkpoint holds, on the process that `writes` it (None elsewhere); every
        process of the group calls it (a pipeline's stages gather their parts)."""

    def own_state(self) -> StateDict:
        """This worker's own state for a checkpoint (its RNG's, its loss scale's)."""

    def load_own_state(self, own: StateDict) -> None:
        """Take its part of `own` (a checkpoint's, or a kept round's) as its own state."""

    def fit_starts(self) -> None:
        """A fit's rounds are about to run."""

    def fit_ends(self) -> None:
        """Every round of the fit has landed (not called when it failed or was stopped)."""

    def averaged(self, averages: Mapping[int, torch.Tensor] | None = None) -> None:
        """AVERAGING: the round's average has landed, in the model or in `averages` by
        id(parameter) (the outer optimizer steps from it, into it)."""

    def rounds_changed(self, before: int, after: int) -> None:
        """The policy's rounds go from `before` local steps to `after` from the next round on."""

    def at_step(self, step: int) -> None:
        """The next optimizer step is global step `step` (a per-step schedule goes on to it)."""

    def landed(self, counters: Counters, score: float, epoch_done: bool) -> None:
        """A round has landed: `counters` and `score` are the same on every worker."""

    def validation_sums(self, rank: int, world_size: int) -> tuple[dict[str, float], int] | None:
        """This worker's share of the validation metrics (Σ metric·n, Σ n); None: no validation."""

    def after_validation(self, metrics: dict[str, float]) -> bool:
        """The combined metrics, the same on every worker: True to stop the fit (early stopping)."""
