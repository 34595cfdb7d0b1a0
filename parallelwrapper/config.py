"""Configuration of a ParallelWrapper: a frozen dataclass, validated on construction.

Config is data. Runtime objects (the model, the optimizer class, the loss function, listeners)
are handed to the builder (wrapper.Builder) and travel beside the config in a `Job`, never inside
it, so a config can be printed, compared and stored in a checkpoint. What the config means on this
machine (devices, backend, threads) is env.resolve's to say. Imports only naming and autopilot.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .autopilot import Autopilot, refusal
from .naming import describe, qualified, short


class TrainingMode(enum.Enum):
    """How the workers stay in step.

    AVERAGING: each worker trains on its own for `averaging_frequency` iterations, then
    parameters, buffers and (optionally) optimizer state are averaged (local SGD).
    SHARED_GRADIENTS: gradients are averaged every iteration (synchronous data parallelism).
    """

    AVERAGING = "averaging"
    SHARED_GRADIENTS = "shared-gradients"


class NanPolicy(enum.Enum):
    """What a worker does when its loss is NaN or infinite."""

    RAISE = "raise"  # fail fit(), naming the worker and the step
    SKIP = "skip"  # drop this worker's contribution from the round; it receives the average


BACKENDS = ("auto", "gloo", "nccl")
# bf16-mixed: forward and loss under autocast; 16-mixed: float16 with a GradScaler. Params, grads, optimizer state and the averaging stay float32.
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
PAYLOAD_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")  # the averaging's wire format (codec.py)
FAILURE_POLICIES = ("raise", "replace")  # what a spawned worker's failure does (hosts/spawned.py)
FEEDS = ("auto", "queue")  # how spawned workers get a list of batches (feed.py)
INTERVALS = ("epoch", "step")  # when a learning-rate scheduler steps (schedule.py)
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "zbv")  # a pipeline's (pipeline/stage.py; "zbv": zero bubble, V)


@dataclass(frozen=True)
class GradientEncoding:
    """`.gradient_encoding(...)`: SHARED_GRADIENTS' updates sent threshold-encoded, DL4J's way
    (Strom, 2015; threshold.py). Validated on construction, the fix in the message."""

    threshold: float = 1e-3  # τ at the start, in parameter units: an entry of lr × gradient past it is sent
    adaptive: bool = True  # τ steered so that each step sends between min_density and max_density of the entries
    min_density: float = 1e-4
    max_density: float = 1e-2
    residual_clip: float | None = 5.0  # every 5 steps the residual is clipped to ±residual_clip·τ (None: never)

    def __post_init__(self) -> None:
        fix = "e.g. .gradient_encoding(threshold=1e-3, min_density=1e-4, max_density=1e-2, residual_clip=5.0)"
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not 0 < self.threshold < math.inf:
            raise ValueError(f"gradient_encoding: threshold must be a positive number, got {self.threshold!r}; {fix}")
        if not 0 < self.min_density <= self.max_density <= 1:
            raise ValueError(f"gradient_encoding: need 0 < min_density <= max_density <= 1, got {self.min_density!r} and {self.max_density!r}; {fix}")
        if self.residual_clip is not None and not 1 <= self.residual_clip < math.inf:
            raise ValueError(f"gradient_encoding: residual_clip must be a number >= 1 (in units of τ) or None, got {self.residual_clip!r}; {fix}")


@dataclass(frozen=True)
class Pipeline:
    """`.pipeline(...)`: each worker as `stages` processes, each holding a part of the model (pipeline/)."""

    stages: int = 2
    split: tuple[str, ...] | None = None  # the submodules at which stages 1.. begin; None: about equal parameter counts
    microbatches: int = 1  # each batch cut into these, fed through the stages by the schedule
    schedule: str = "1f1b"  # or "gpipe", or "zbv" (zero bubble, V: two pieces of the model a stage)

    def __post_init__(self) -> None:
        check_int("stages", self.stages, 2, "a pipeline has 2 stages or more, e.g. .pipeline(stages=2)")
        check_int("microbatches", self.microbatches, 1, "e.g. .pipeline(stages=2, microbatches=4)")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline: schedule must be '1f1b', 'gpipe' or 'zbv', got {self.schedule!r}; e.g. .pipeline(stages=2, schedule='gpipe')")


@dataclass(frozen=True)
class Config:
    """Every option of a ParallelWrapper, with its default. Validated on construction."""

    workers: int = 2
    prefetch_buffer: int = 24
    averaging_frequency: int = 1
    report_score_after_averaging: bool = True
    average_updaters: bool = True
    average_updaters_every: int = 1  # with average_updaters: the optimizer state travels every m-th round (DES-LOC), and where replicas must be equal
    overlap_averaging: bool = False  # average in the background during the next round's steps
    fragments: int = 1  # with overlap: the state in n fragments, each averaged at its own point of the round
    training_mode: TrainingMode = TrainingMode.AVERAGING
    deterministic: bool = False
    feed: str = "auto"  # auto: spawned workers read a list or tuple of batches in shards; queue: the main process feeds every batch
    seed: int = 0
    devices: tuple[str, ...] | None = None  # None: a GPU per worker when there are GPUs, else the CPU (env.resolve)
    backend: str = "auto"  # auto: NCCL when every worker has a GPU of its own, else gloo (env.resolve)
    stall_timeout_s: float = 300.0  # a worker without progress this long fails fit(), named
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50  # rounds; a checkpoint is also saved at every epoch's end
    nan_policy: NanPolicy = NanPolicy.RAISE
    threads_per_worker: int | None = None  # None: the machine's cores shared out among workers
    gradient_clip_norm: float | None = None  # clip_grad_norm_ of each step's gradients to this
    precision: str = "32"  # or "bf16-mixed", "16-mixed"
    validation_every: int | None = 50  # averagings between validations (None: epoch ends only), with .validation(data)
    warmup_sync_steps: int = 0  # post-local SGD: steps of SHARED_GRADIENTS before the averaging rounds
    payload_dtype: str = "float32"  # or "bfloat16", "float16", "int8", "int4": what an averaging's floats travel as
    hierarchy: str = "none"  # or "node": under torchrun, a node's ranks share gradients each step, nodes average
    on_worker_failure: str = "raise"  # or "replace": a spawned worker that fails is replaced from the last average
    max_replacements: int = 3  # with "replace": replacements over the wrapper's life before a failure raises
    auto_resume: bool = True  # under torchrun with checkpoints: a restarted group resumes from the last checkpoint
    peer_timeout_s: float = 30.0  # under torchrun: a rank that hears nothing from a peer this long exits, naming it
    gradient_encoding: GradientEncoding | None = None  # SHARED_GRADIENTS: updates sent threshold-encoded (None: dense)
    pipeline: Pipeline | None = None  # .pipeline(...): each worker a pipeline of stage processes (pipeline/)
    autopilot: Autopilot | None = None  # .averaging_frequency("auto"): k, payload and optimizer-state period chosen each round

    @property
    def wire_dtype(self) -> str | None:
        """The codec an averaging's floats travel in (codec.py), when not float32."""
        return None if self.payload_dtype == "float32" else self.payload_dtype

    def __post_init__(self) -> None:
        check_int("workers", self.workers, 1, "ParallelWrapper.builder(model).workers(2)")
        check_int("prefetch_buffer", self.prefetch_buffer, 1, "a few batches per worker, e.g. .prefetch_buffer(24)")
        check_int("averaging_frequency", self.averaging_frequency, 1, "1 averages after every iteration, e.g. .averaging_frequency(3)")
        if not isinstance(self.training_mode, TrainingMode):
            raise ValueError(f"training_mode must be a TrainingMode, got {self.training_mode!r}; use one of {[m.name for m in TrainingMode]}, e.g. .training_mode(TrainingMode.AVERAGING)")
        if self.overlap_averaging and self.training_mode is TrainingMode.SHARED_GRADIENTS:
            raise ValueError("overlap_averaging applies to TrainingMode.AVERAGING only: with SHARED_GRADIENTS every step "
                             "needs the averaged gradients before it can be taken; drop .overlap_averaging(True)")
        if not isinstance(self.nan_policy, NanPolicy):
            raise ValueError(f"nan_policy must be one of {[p.value for p in NanPolicy]}, got {self.nan_policy!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0 seconds, got {self.stall_timeout_s}")
        check_int("checkpoint_every", self.checkpoint_every, 1, "the rounds between checkpoints, e.g. .checkpoint(dir, every=50)")
        if self.threads_per_worker is not None:
            check_int("threads_per_worker", self.threads_per_worker, 1, "or leave it unset to share the cores out")
        if self.gradient_clip_norm is not None and not (isinstance(self.gradient_clip_norm, (int, float)) and 0 < self.gradient_clip_norm < float("inf")):
            raise ValueError(f"gradient_clip_norm must be a positive number, got {self.gradient_clip_norm!r}; e.g. .gradient_clipping(max_norm=1.0)")
        if self.validation_every is not None:
            check_int("validation_every", self.validation_every, 1, "e.g. .validation(data, every=50), or every=None for epoch ends only")
        check_int("warmup_sync_steps", self.warmup_sync_steps, 0, "the synchronous steps before averaging, e.g. .warmup_sync_steps(200)")
        if self.warmup_sync_steps and self.training_mode is not TrainingMode.AVERAGING:
            raise ValueError("warmup_sync_steps switches from shared gradients to averaging rounds: it needs TrainingMode.AVERAGING; "
                             "drop .warmup_sync_steps() or .training_mode(TrainingMode.SHARED_GRADIENTS)")
        check_int("fragments", self.fragments, 1, "a few, e.g. .fragments(4); 1 averages the state whole")
        if self.fragments > 1 and not self.overlap_averaging:
            raise ValueError(f"fragments({self.fragments}) spreads each round's averaging through the next round's steps, fragment by fragment: it needs .overlap_averaging(True)")
        if self.fragments > 1 and self.on_worker_failure == "replace":
            raise ValueError(f'on_worker_failure("replace") restarts every worker from one landed average, which fragments({self.fragments}) '
                             "reach only at an epoch's end, a checkpoint or a validation: drop one of them")
        if self.payload_dtype not in PAYLOAD_DTYPES:
            raise ValueError(f"payload_dtype must be one of {list(PAYLOAD_DTYPES)}, got {self.payload_dtype!r}")
        if self.hierarchy not in ("none", "node"):
            raise ValueError(f"hierarchy must be 'none' or 'node', got {self.hierarchy!r}")
        if self.hierarchy == "node" and self.training_mode is not TrainingMode.AVERAGING:
            raise ValueError("hierarchy('node') averages gradients within a node and the state across nodes: it needs "
                             "TrainingMode.AVERAGING (SHARED_GRADIENTS averages gradients over every rank already); drop one")
        if self.feed not in FEEDS:
            raise ValueError(f"feed must be one of {list(FEEDS)}, got {self.feed!r}")
        if self.on_worker_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_worker_failure must be one of {list(FAILURE_POLICIES)}, got {self.on_worker_failure!r}")
        check_int("max_replacements", self.max_replacements, 0, 'e.g. .on_worker_failure("replace", max_replacements=3)')
        if not self.peer_timeout_s > 0:
            raise ValueError(f"peer_timeout_s must be > 0 seconds, got {self.peer_timeout_s}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.gradient_encoding is not None:
            _check_encoding(self)
        check_int("average_updaters(every=...)", self.average_updaters_every, 1, "how many rounds apart the optimizer state travels, e.g. .average_updaters(every=4)")
        if self.average_updaters_every > 1:
            _check_updaters_every(self)
        if self.autopilot is not None and (refused := refusal(self.autopilot, self, PAYLOAD_DTYPES)):
            raise ValueError(refused)
        for d in self.devices or ():  # how many there must be is env.resolve's to check
            try:
                torch.device(d)
            except RuntimeError as e:
                raise ValueError(f"devices: {d!r} is not a torch device ({e})") from None


def _check_encoding(config: Config) -> None:
    """Gradient encoding has a meaning in SHARED_GRADIENTS, on its own wire, in float32 or bf16."""
    for bad, fix in (
        (config.training_mode is not TrainingMode.SHARED_GRADIENTS,
         "the training_mode: it encodes each step's update, which only TrainingMode.SHARED_GRADIENTS shares; add .training_mode(TrainingMode.SHARED_GRADIENTS)"),
        (config.payload_dtype != "float32", "payload_dtype, which casts averagings (the encoded updates are signs already): drop .payload_dtype()"),
        (config.precision == "16-mixed", "precision 16-mixed, whose loss scale would go into each worker's residual: use .precision('bf16-mixed')"),
        (config.on_worker_failure == "replace", "on_worker_failure('replace'): a worker's residual (what it has not sent yet) is lost with it; use .checkpoint(dir) and resume"),
    ):  # fmt: skip
        if bad:
            raise ValueError(f"gradient_encoding does not go with {fix}")


def _check_updaters_every(config: Config) -> None:
    """`.average_updaters(every=m)` sends the optimizer state in buffers of its own, landed at once; the options that carry it with the parameters refuse it."""
    m = config.average_updaters_every
    for bad, why in (
        (not config.average_updaters, "average_updaters(False), which never sends the optimizer state: drop every="),
        (config.overlap_averaging, "overlap_averaging, whose rounds average the whole state in the background a round later: drop one"),
        (config.wire_dtype is not None, f"payload_dtype {config.payload_dtype!r}, which codes the optimizer state with the parameters, one residual for both: use float32 or every=1"),
        (config.hierarchy == "node", "hierarchy('node'), whose shards carry the optimizer state with the parameters: drop one"),
        (config.on_worker_failure == "replace", "on_worker_failure('replace'), which redoes a round from any survivor's copy: between averagings the workers' optimizer states differ; drop one"),
        (config.pipeline is not None, "a pipeline, which this version does not run it with: drop one"),
    ):  # fmt: skip
        if bad:
            raise ValueError(f"average_updaters(every={m}) does not go with {why}")


def check_int(name: str, value: object, minimum: int = 1, hint: str = "") -> None:
    """A ValueError naming the option unless `value` is an int (not a bool) >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}" + (f"; {hint}" if hint else ""))


LossFn = Callable[[torch.Tensor, Any], torch.Tensor]
TrainingStep = Callable[[torch.nn.Module, Any], torch.Tensor]
OptimizerFn = Callable[[torch.nn.Module], torch.optim.Optimizer]
BeforeStep = Callable[[torch.nn.Module, torch.optim.Optimizer], None]
ValidationStep = Callable[[torch.nn.Module, Any], dict[str, Any]]


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
        qualname = getattr(self.factory, "__qualname__", type(self.factory).__name__)
        return short(f"{qualname}(optimizer, **{describe(self.kwargs)}) per {self.interval}")


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
            return short(f"{qualified(self.optimizer_fn)}(model)")
        return short(f"{qualified(self.optimizer_cls)}({describe(self.optimizer_kwargs)})")


def check_job(job: Job, config: Config, world_size: int) -> list[str]:
    """A ValueError naming the fix for a job that cannot train (an optimizer that fails or trains
    another model, parts that need what the config or job lacks); the warnings for one that
    trains but loses something on the way (parameter hooks). What a spawned worker cannot
    receive is sendable.py's to say."""
    if job.outer_optimizer is not None and config.training_mode is not TrainingMode.AVERAGING:
        raise ValueError("outer_optimizer steps on each round's average, which SHARED_GRADIENTS has not: use TrainingMode.AVERAGING")
    if job.early_stopping is not None and job.validation_data is None:
        raise ValueError("EarlyStopping stops on validation metrics: add .validation(data, every=...)")
    if job.validation_data is not None and job.validation_step is None and job.loss_fn is None:
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


def parse_enum(cls: type[enum.Enum], value: Any, name: str) -> Any:
    """An option given as an enum member or its value, or a ValueError naming the choices."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {[m.value for m in cls]} or a {cls.__name__}, got {value!r}") from None


def describe_config(config: Config) -> dict[str, Any]:
    """The config as JSON-ready data (enums by value), for checkpoints, summaries and people."""
    out = dataclasses.asdict(config)
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in out.items()}


__all__ = ["Config", "GradientEncoding", "Job", "NanPolicy", "OuterSpec", "PIPELINE_SCHEDULES", "Pipeline", "SchedulerSpec", "TrainingMode", "check_int", "check_job", "describe_config", "parse_enum"]
