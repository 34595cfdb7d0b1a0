"""The job: what a worker rebuilds besides the config, and the checks that it can train.

Its parts are the model, the optimizer, the loss or training step, the schedule, the outer
optimizer and the validation.

A Job holds runtime objects, so it is never stored or compared; a checkpoint's fingerprint names
its parts (`optimizer_name`, the specs' `name`). Imports only naming.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .naming import describe, qualified, short

INTERVALS = ("epoch", "step")  # when a learning-rate scheduler steps (schedule.py)
# The builder's setters of the job's parts (the rest set config.Config's options, declared there).
PARTS = ("optimizer", "lr_scheduler", "outer_optimizer", "before_step", "loss_fn", "loss_from_output", "training_step", "validation", "listeners")
LossFn = Callable[[torch.Tensor, Any], torch.Tensor]
TrainingStep = Callable[[torch.nn.Module, Any], torch.Tensor]
OptimizerFn = Callable[[torch.nn.Module], torch.optim.Optimizer]
BeforeStep = Callable[[torch.nn.Module, torch.optim.Optimizer], None]
ValidationStep = Callable[[torch.nn.Module, Any], dict[str, Any]]


@dataclass(frozen=True)
class OutputLoss:
    """`.loss_from_output(key)`: the training step of a model that computes its own loss, as a
    Hugging Face model does when the batch holds its labels. The model is called on the batch
    (`model(**batch)` for a mapping, `model(*batch)` for a tuple or list, else `model(batch)`) and
    the loss is the output's `key` (an item or attribute: `output.loss`), or its first element
    where the model returns a tuple (return_dict=False)."""

    key: str = "loss"

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return self.loss(self.outputs(model, batch))

    @staticmethod
    def outputs(model: torch.nn.Module, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return model(**batch)
        return model(*batch) if isinstance(batch, (list, tuple)) else model(batch)

    def loss(self, output: Any) -> torch.Tensor:
        found = self.get(output, self.key)
        if found is None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            found = output[0]  # return_dict=False: the loss comes first
        if not isinstance(found, torch.Tensor):
            raise ValueError(
                f"loss_from_output: the model returned a {type(output).__name__} with no {self.key!r} tensor; a Hugging Face "
                f"model computes its loss only when the batch holds its labels ('labels'), or name the output's loss with "
                f".loss_from_output(key=...)"
            )
        return found

    @staticmethod
    def get(output: Any, key: str) -> Any:
        """The output's `key`, as an item of a mapping (a ModelOutput is one) or an attribute; None without it."""
        if isinstance(output, Mapping):
            return output.get(key)
        return getattr(output, key, None)


@dataclass(frozen=True)
class SchedulerSpec:
    """`.lr_scheduler(...)`: a torch.optim.lr_scheduler class and its keyword arguments, or a
    function optimizer -> scheduler (kwargs empty), which each worker calls on its own optimizer;
    when it steps (INTERVALS), and the metric a ReduceLROnPlateau watches."""

    factory: Callable[..., Any]
    kwargs: dict[str, Any]
    interval: str = "epoch"
    monitor: str | None = None

    def build(self, optimizer: torch.optim.Optimizer) -> Any:
        return self.factory(optimizer, **self.kwargs)

    @property
    def name(self) -> str:
        """The scheduler as a checkpoint's fingerprint and error messages name it."""
        if isinstance(self.factory, functools.partial):  # with its arguments: a change of them is a change
            factory = describe(self.factory)
        else:
            factory = getattr(self.factory, "__qualname__", type(self.factory).__name__)
        return short(f"{factory}(optimizer, **{describe(self.kwargs)}) per {self.interval}")


@dataclass(frozen=True)
class OuterSpec:
    """`.outer_optimizer(cls, **kwargs)`: the optimizer that steps on each round's pseudo-gradient
    (outer.py), built on copies of the trainable parameters."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)

    @property
    def name(self) -> str:
        return short(f"{qualified(self.cls)}({describe(self.kwargs)})")


@dataclass(frozen=True)
class Job:
    """What a worker needs besides the config: the objects it rebuilds in its own process. The
    optimizer is a class and its keyword arguments, or `optimizer_fn(model) -> optimizer` (for
    parameter groups), which each worker calls on its own copy of the model."""

    model: torch.nn.Module
    optimizer_cls: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    loss_fn: LossFn | None
    training_step: TrainingStep | None
    optimizer_fn: OptimizerFn | None = None
    before_step: BeforeStep | None = None  # fn(model, optimizer) between backward and step
    validation_data: Any = None  # batches (or a function returning them) the averaged model is scored on
    validation_step: ValidationStep | None = None  # fn(model, batch) -> {name: batch mean}
    early_stopping: Any = None  # a listeners.EarlyStopping, which every worker applies to its validations
    lr_scheduler: SchedulerSpec | None = None
    outer_optimizer: OuterSpec | None = None  # DiLoCo / SlowMo

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return self.optimizer_fn(model) if self.optimizer_fn is not None else self.optimizer_cls(model.parameters(), **self.optimizer_kwargs)

    @property
    def optimizer_name(self) -> str:
        """The optimizer as a checkpoint's fingerprint and error messages name it."""
        if self.optimizer_fn is not None:
            # A partial by its function and arguments: resumed with another learning rate, it is another optimizer.
            fn = describe(self.optimizer_fn) if isinstance(self.optimizer_fn, functools.partial) else qualified(self.optimizer_fn)
            return short(f"{fn}(model)")
        return short(f"{qualified(self.optimizer_cls)}({describe(self.optimizer_kwargs)})")


def check_job(job: Job, world_size: int) -> list[str]:
    """A ValueError naming the fix for a job that cannot train (an optimizer that fails or trains
    another model, parts that need what the job lacks); the warnings for one that trains but
    loses something on the way (parameter hooks). Which parts do not go with which options is
    config.CONFLICTS' to say, what a spawned worker cannot receive sendable.py's."""
    if job.early_stopping is not None and job.validation_data is None:
        raise ValueError("EarlyStopping stops on validation metrics: add .validation(data, every=...)")
    if job.validation_data is not None and job.validation_step is None and job.loss_fn is None and not isinstance(job.training_step, OutputLoss):
        raise ValueError("validation: with .training_step(fn) the default metrics (val_loss, val_accuracy) have no "
                         "loss to use; pass .validation(data, step=fn) with fn(model, batch) -> {name: value}")
    optimizer = _check_optimizer(job)
    if job.lr_scheduler is not None:
        _check_scheduler(job.lr_scheduler, optimizer, job.validation_data is not None, world_size)
    if job.outer_optimizer is not None:
        try:
            job.outer_optimizer.build([torch.nn.Parameter(torch.zeros(1))])
        except Exception as e:  # noqa: BLE001 - any failure here is a bad outer optimizer argument
            cause = (str(e).strip().splitlines() or [""])[0][:300]
            raise ValueError(f"outer_optimizer: {job.outer_optimizer.name} failed: {type(e).__name__}: {cause}") from None
    notes = []
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left_out = [name for name, p in job.model.named_parameters() if p.requires_grad and id(p) not in held]
    if left_out:
        notes.append(f"optimizer: {len(left_out)} trainable parameters are in no param group ({_names(left_out)}): they never "
                     f"move, and are treated as frozen (not averaged); add them to a group, or set requires_grad=False")
    hooked = [name for name, p in job.model.named_parameters() if getattr(p, "_backward_hooks", None)]
    if hooked:
        notes.append(f"parameters {_names(hooked)} carry hooks (Parameter.register_hook), which do not reach the workers' "
                     f"copies of the model; do that gradient work in .before_step(fn) with fn(model, optimizer) instead")
    return notes


def _names(names: list[str]) -> str:
    """The first three names, then how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _check_optimizer(job: Job) -> torch.optim.Optimizer:
    """The optimizer builds, and optimizes the model it was given: a function that reached for
    another model (a global, a closure) would train nothing on the workers."""
    name = job.optimizer_name
    try:
        optimizer = job.make_optimizer(job.model)
    except Exception as e:  # noqa: BLE001 - any failure here is a bad optimizer argument
        cause = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"optimizer: {name} failed: {type(e).__name__}: {cause}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer: {name} returned a {type(optimizer).__name__}, not a torch optimizer")
    own = {id(p) for p in job.model.parameters()}
    foreign = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ValueError(f"optimizer: {name} optimizes {foreign} tensors that are not the parameters of the model it was given; build the groups from its `model` argument")
    return optimizer


def _check_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer, validates: bool, world_size: int) -> None:
    """The scheduler builds on the optimizer it is given, and has what it steps on."""
    if spec.interval not in INTERVALS:
        raise ValueError(f"lr_scheduler: interval must be one of {list(INTERVALS)}, got {spec.interval!r}")
    try:
        scheduler = spec.build(optimizer)
    except Exception as e:  # noqa: BLE001 - any failure here is a bad scheduler argument
        cause = (str(e).strip().splitlines() or [""])[0][:300]
        n = world_size  # per step the count is the global step: a length sized for N workers is N times shorter
        split = f"; per step, each of {n} workers takes ceil(batches / {n}) steps an epoch (builder.steps_per_epoch(data)): too few here?" if spec.interval == "step" else ""
        raise ValueError(f"lr_scheduler: {spec.name} failed: {type(e).__name__}: {cause}{split}") from None
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ValueError(f"lr_scheduler: {spec.name} returned a {type(scheduler).__name__}, not a torch.optim.lr_scheduler scheduler")
    if scheduler.optimizer is not optimizer:
        raise ValueError(f"lr_scheduler: {spec.name} schedules another optimizer; build it on its `optimizer` argument")
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if spec.monitor is not None and not plateau:
        raise ValueError(f"lr_scheduler: monitor= is for ReduceLROnPlateau, which steps on a metric; {spec.name} steps by a counter")
    if spec.monitor is not None and not validates:
        raise ValueError(f"lr_scheduler: ReduceLROnPlateau monitors {spec.monitor!r}, a validation metric: add "
                         f".validation(data, every=...), or drop monitor= to step on the averaged training loss")


__all__ = ["INTERVALS", "PARTS", "BeforeStep", "Job", "LossFn", "OptimizerFn", "OuterSpec", "OutputLoss", "SchedulerSpec", "TrainingStep", "ValidationStep", "check_job"]
