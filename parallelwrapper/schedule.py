"""Learning-rate schedules in lockstep: every worker's scheduler follows one step count that all workers agree on.

A per-step schedule moves at every local step, as in a one-process loop.

The rule (README, "Learning-rate schedules"):
- interval "epoch": the count is the number of completed epochs; the scheduler steps at each
  epoch's end, as in pytorch/examples.
- interval "step": the count is the global step, DDP's: the batches of an epoch are steps
  s + i // N, s the count when the epoch began and i a batch's index in it, the step that each
  of N synchronous ranks takes on it. A worker's scheduler goes to a batch's step before the
  optimizer steps on it (rounds/cut.py says which step that is), so with k local steps a
  round, local step j of round r runs at r·k + j, and a batch runs at the same learning rate
  whichever worker takes it (first-come, a faster worker takes more of a round's N·k batches
  and goes further through the round's steps). When a round lands, every worker's scheduler
  goes on to ceil(I / N), I the batches of every landed round: all workers agree after every
  round, and an end-of-epoch round with fewer batches counts for the steps its batches make. No
  batch is past that count, so a scheduler never steps beyond the run's total (a OneCycleLR
  refuses to), and never has to go back.
- ReduceLROnPlateau steps on a metric instead: `monitor` of each validation, or, without
  validation data, the averaged score of each epoch ("epoch") or of each round ("step").

Every worker sees the same counters and metrics after a round, and param groups' hyperparameters
are not averaged, so every worker's learning rates stay equal without any communication.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .job import SchedulerSpec
from .types import Counters, StateDict

Scheduler = torch.optim.lr_scheduler.LRScheduler
Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau


class Schedule:
    """One worker's (or the wrapper's) scheduler and the count of steps it has taken."""

    def __init__(self, scheduler: Scheduler, interval: str, monitor: str | None, world_size: int) -> None:
        self.scheduler, self.interval, self.world_size = scheduler, interval, world_size
        self.monitor = monitor
        self.steps = 0  # scheduler steps taken: the global step (per step), epochs, or metrics (a plateau)

    @property
    def plateau(self) -> bool:
        return isinstance(self.scheduler, Plateau)

    def target(self, counters: Counters) -> int:
        """The count the scheduler must have reached once these counters' rounds have landed."""
        if self.interval == "epoch":
            return counters.epoch
        return math.ceil(counters.iterations / self.world_size)

    def at_step(self, step: int) -> None:
        """Before an optimizer step at global step `step`: a per-step scheduler goes on to it."""
        if self.interval == "step" and not self.plateau:
            self._go_to(step)

    def landed(self, counters: Counters, score: float, epoch_done: bool, validates: bool) -> None:
        """After a landed round: go on to the agreed count; a plateau without validation data steps
        on the averaged score (the epoch's at its end with interval "epoch", else the round's)."""
        if not self.plateau:
            self._go_to(self.target(counters))
        elif not validates and (epoch_done or self.interval == "step") and math.isfinite(score):
            self._step(score)

    def validated(self, metrics: dict[str, float]) -> None:
        """After a validation: a plateau steps on its monitored metric."""
        if self.plateau:
            name = self.monitor or "val_loss"
            if name not in metrics:
                raise KeyError(f"ReduceLROnPlateau monitors {name!r}, but validation reports only {sorted(metrics)}")
            self._step(metrics[name])

    def _go_to(self, count: int) -> None:
        while self.steps < count:
            self._step()

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

    def state_dict(self) -> StateDict:
        return {"scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: StateDict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]


# The attribute that holds the length a scheduler of this kind is planned over: the run's whole
# length, as people size them. Warm-ups (LinearLR, ConstantLR) and periodic ones are not checked.
PLANNED_LENGTH = {"OneCycleLR": "total_steps", "CosineAnnealingLR": "T_max", "PolynomialLR": "total_iters"}
# The names a LambdaLR's or MultiplicativeLR's function gives the length it is planned over, as a
# functools.partial keyword or a closure variable: transformers' warm-up schedules (linear, cosine,
# polynomial: `get_*_schedule_with_warmup`) pass theirs as partial(..., num_training_steps=...).
LENGTH_NAMES = ("num_training_steps",)


def planned_length(scheduler: object) -> tuple[str, int] | None:
    """Where a scheduler's planned length is read from and that length, or None where it cannot be
    read: a torch scheduler's attribute of PLANNED_LENGTH, or a LambdaLR's or MultiplicativeLR's
    variable of LENGTH_NAMES (a partial's keyword or a closure variable), from the first of its
    functions (one per param group) that has one."""
    kind = type(scheduler).__name__
    if kind in PLANNED_LENGTH:
        return PLANNED_LENGTH[kind], int(getattr(scheduler, PLANNED_LENGTH[kind]))
    if not isinstance(scheduler, (torch.optim.lr_scheduler.LambdaLR, torch.optim.lr_scheduler.MultiplicativeLR)):
        return None
    for fn in scheduler.lr_lambdas:
        variables = _variables(fn)
        for name in LENGTH_NAMES:
            if isinstance(variables.get(name), int):
                return name, variables[name]
    return None


def _variables(fn: Callable[..., Any]) -> dict[str, Any]:
    """The values a function was given beside its argument: a partial's keywords, a closure's variables."""
    if isinstance(fn, functools.partial):
        return dict(fn.keywords)
    names, cells = getattr(getattr(fn, "__code__", None), "co_freevars", ()), getattr(fn, "__closure__", None) or ()
    variables = {}
    for name, cell in zip(names, cells, strict=False):
        try:
            variables[name] = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
    return variables


def steps_per_epoch(batches: int, world_size: int) -> int:
    """The global steps (each worker's) an epoch of `batches` batches takes on `world_size` workers."""
    return math.ceil(batches / world_size)


def sizing_warning(schedule: Schedule, iterations: int, batches: int) -> str | None:
    """What is wrong with a per-step schedule's planned length for a fit of `batches` batches that
    starts after `iterations` (over the wrapper's life), or None: a length it would step past, or
    one sized the plain loop's way (every batch a step) where N workers split the batches. A length
    between the two is taken as planned over this fit and later ones. Only a length that
    planned_length can read is checked."""
    length = planned_length(schedule.scheduler) if schedule.interval == "step" else None
    if length is None:
        return None
    kind, (attribute, total) = type(schedule.scheduler).__name__, length
    planned = total - schedule.steps  # what is left of it
    n = schedule.world_size
    taken = math.ceil((iterations + batches) / n) - schedule.steps
    why = f"this fit's {batches} batches split across {n} workers are {taken} global steps (each worker's)"
    if taken > planned:
        return (
            f"lr_scheduler: {kind} has {planned} steps left ({attribute}), but {why}: it would step past its end "
            f"(where a OneCycleLR raises and a cosine turns back up); size it as epochs * builder.steps_per_epoch(data)"
        )
    if n > 1 and planned == batches:
        return (
            f"lr_scheduler: {kind} has {planned} steps planned ({attribute}), one per batch as a one-process loop counts, "
            f"but {why}: it would end {taken / planned:.0%} of the way through. Size it as epochs * "
            f"builder.steps_per_epoch(data) = {taken} (docs/guides/schedules.md), or ignore this if later fit() calls continue it"
        )
    return None


def make_schedule(spec: SchedulerSpec | None, optimizer: torch.optim.Optimizer, world_size: int) -> Schedule | None:
    """The schedule `.lr_scheduler(...)` asks for, on `optimizer`; None without one."""
    if spec is None:
        return None
    return Schedule(spec.build(optimizer), spec.interval, spec.monitor, world_size)


__all__ = ["LENGTH_NAMES", "PLANNED_LENGTH", "Schedule", "make_schedule", "planned_length", "sizing_warning", "steps_per_epoch"]
