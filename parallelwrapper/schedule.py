"""Learning-rate schedules in lockstep: every worker's scheduler is stepped by one counter that all
workers agree on, at the moments when they all hold the same state.

The rule (README, "Learning-rate schedules"):
- interval "epoch": the counter is the number of completed epochs; the scheduler steps at each
  epoch's end, as in pytorch/examples.
- interval "step": the counter is ceil(I / N), where I is the number of batches that all N workers
  trained in the rounds that have landed, over the wrapper's life: the steps each of N synchronous
  (DDP) ranks would have taken for those batches. An end-of-epoch round with fewer batches counts
  for fewer steps. After each landed round the scheduler steps until it reaches the counter, so
  the learning rate of a local step is the schedule at the counter of every round landed before
  it: constant within a round of k steps, exact per step with k = 1 and in SHARED_GRADIENTS (where
  every round is one step of N batches). With overlap_averaging the round in flight is not counted
  until it lands.
- ReduceLROnPlateau steps on a metric instead: `monitor` of each validation, or, without
  validation data, the averaged score of each epoch ("epoch") or of each round ("step").

Every worker sees the same counters and metrics after a round, and param groups' hyperparameters
are not averaged, so every worker's learning rates stay equal without any communication.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from .config import SchedulerSpec
from .types import Counters

Scheduler = torch.optim.lr_scheduler.LRScheduler
Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau


class Schedule:
    """One worker's (or the wrapper's) scheduler and the count of steps it has taken."""

    def __init__(self, scheduler: Scheduler, interval: str, monitor: str | None, world_size: int) -> None:
        self.scheduler, self.interval, self.world_size = scheduler, interval, world_size
        self.monitor = monitor
        self.steps = 0  # scheduler steps taken by the counter (a plateau: by metrics)

    @property
    def plateau(self) -> bool:
        return isinstance(self.scheduler, Plateau)

    def target(self, counters: Counters) -> int:
        """The counter the scheduler must have reached once these counters' rounds have landed."""
        if self.interval == "epoch":
            return counters.epoch
        return math.ceil(counters.iterations / self.world_size)

    def landed(self, counters: Counters, score: float, epoch_done: bool, validates: bool) -> None:
        """After a landed round: step to the counter; a plateau without validation data steps on
        the averaged score (the epoch's at its end with interval "epoch", else the round's)."""
        if not self.plateau:
            while self.steps < self.target(counters):
                self._step()
        elif not validates and (epoch_done or self.interval == "step") and math.isfinite(score):
            self._step(score)

    def validated(self, metrics: dict[str, float]) -> None:
        """After a validation: a plateau steps on its monitored metric."""
        if self.plateau:
            name = self.monitor or "val_loss"
            if name not in metrics:
                raise KeyError(f"ReduceLROnPlateau monitors {name!r}, but validation reports only {sorted(metrics)}")
            self._step(metrics[name])

    def _step(self, metric: float = math.nan) -> None:
        # A worker that took no step yet (its round was empty) steps by the agreed counter all the
        # same: torch's warning about the order of scheduler and optimizer steps is not for it.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            if isinstance(self.scheduler, Plateau):
                self.scheduler.step(metric)
            else:
                self.scheduler.step()
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]


def make_schedule(spec: SchedulerSpec | None, optimizer: torch.optim.Optimizer, world_size: int) -> Schedule | None:
    """The schedule `.lr_scheduler(...)` asks for, on `optimizer`; None without one."""
    if spec is None:
        return None
    return Schedule(spec.build(optimizer), spec.interval, spec.monitor, world_size)


__all__ = ["Schedule", "make_schedule"]
