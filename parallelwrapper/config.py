"""The options of a ParallelWrapper, each declared once, and the table of those that cannot go together.

Config is data: a frozen dataclass whose fields are the options (registry.option), validated on
construction, so it can be printed, compared and stored in a checkpoint. Runtime objects (the
model, the optimizer, the loss) travel beside it in a job.Job. What the config means on this
machine (devices, backend, threads) is env.resolve's to say. Imports only registry and autopilot.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from . import payloads
from .autopilot import Autopilot, Rung, in_config
from .registry import Declared, boolean, choice, count, declared, instance, option, positive, ruled, validate

E = TypeVar("E", bound=enum.Enum)


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
PAYLOAD_DTYPES = payloads.NAMES  # the averaging's wire format (payloads.py; and sparse:D)
FAILURE_POLICIES = ("raise", "replace")  # what a spawned worker's failure does (hosts/spawned.py)
FEEDS = ("auto", "queue")  # how spawned workers get a list of batches (feed/)
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "zbv")  # a pipeline's (pipeline/stage.py; "zbv": zero bubble, V)


def fleet_address(address: str) -> tuple[str, tuple[tuple[str, int], ...], str]:
    """(scheme, its (host, port)s, name) of a fleet's store: tcp://HOST:PORT[/NAME], a TCPStore,
    or etcd://HOST:PORT[,HOST:PORT...][/NAME], an etcd cluster's members (its v2 API); the name is
    "parallelwrapper" when none is given. Else a ValueError that says what is wrong."""
    scheme, _, rest = address.partition("://") if isinstance(address, str) else ("", "", "")
    where, _, name = rest.partition("/")
    hosts: list[tuple[str, int]] = []
    for part in where.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            hosts = []
            break
        hosts.append((host, int(port)))
    if scheme not in ("tcp", "etcd") or not hosts or (scheme == "tcp" and len(hosts) > 1):
        raise ValueError(
            f"fleet's store must be tcp://HOST:PORT[/NAME] or etcd://HOST:PORT[,HOST:PORT...][/NAME], e.g. "
            f"etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/run-7, got {address!r}"
        )
    return scheme, tuple(hosts), name or "parallelwrapper"


def fleet_address_problem(value: object) -> str | None:
    """What is wrong with a fleet's store address, as the end of "must be ...", or None when it is right."""
    try:
        fleet_address(value)  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError):
        return "tcp://HOST:PORT[/NAME] or etcd://HOST:PORT[,HOST:PORT...][/NAME] (or None)"
    return None


def check_int(name: str, value: object, minimum: int = 1, hint: str = "") -> None:
    """A ValueError naming the option unless `value` is an int (not a bool) >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}" + (f"; {hint}" if hint else ""))


def check_devices(devices: tuple[str, ...] | None) -> None:
    """A ValueError naming the first of `devices` that is not a torch device (training's and serving's)."""
    for d in devices or ():
        try:
            torch.device(d)
        except RuntimeError as e:
            raise ValueError(f"devices: {d!r} is not a torch device ({e})") from None


@dataclass(frozen=True)
class GradientEncoding:
    """`.gradient_encoding(...)`: SHARED_GRADIENTS' updates sent threshold-encoded, DL4J's way
    (Strom, 2015; threshold.py). Validated on construction, the fix in the message."""

    threshold: float = option(
        1e-3, "Shared gradients threshold-encoded (DL4J, Strom 2015): only entries of lr x gradient past this τ are sent, τ then adapting.",
        positive(), "gradient_encoding", keyword="threshold", example=1e-2, flag="--gradient-threshold")  # in parameter units
    adaptive: bool = True  # τ steered so that each step sends between min_density and max_density of the entries
    min_density: float = 1e-4
    max_density: float = 1e-2
    residual_clip: float | None = 5.0  # every 5 steps the residual is clipped to ±residual_clip·τ (None: never)

    def __post_init__(self) -> None:
        validate(self, "gradient_encoding")
        fix = "e.g. .gradient_encoding(threshold=1e-3, min_density=1e-4, max_density=1e-2, residual_clip=5.0)"
        if not 0 < self.min_density <= self.max_density <= 1:
            raise ValueError(f"gradient_encoding: need 0 < min_density <= max_density <= 1, got {self.min_density!r} and {self.max_density!r}; {fix}")
        if self.residual_clip is not None and not 1 <= self.residual_clip < math.inf:
            raise ValueError(f"gradient_encoding: residual_clip must be a number >= 1 (in units of τ) or None, got {self.residual_clip!r}; {fix}")


@dataclass(frozen=True)
class Pipeline:
    """`.pipeline(...)`: each worker as `stages` processes, each holding a part of the model (pipeline/)."""

    stages: int = option(
        2, "Model parallelism: each worker a pipeline of N stage processes, each holding about 1/N of the model and its optimizer "
           "state, averaged stage by stage.",
        count(2), "pipeline", keyword="stages", example=4, flag="--stages")
    split: tuple[str, ...] | None = option(
        None, "The submodules at which stages 1.. begin (None: about equal parameter counts).",
        instance(tuple, optional=True), "pipeline", keyword="split", example=("conv2",))
    microbatches: int = option(
        1, "Each batch cut into M microbatches, fed through the stages by the schedule (1F1B runs GPipe when M < stages).",
        count(1), "pipeline", keyword="microbatches", example=4, flag="--microbatches")
    schedule: str = option(
        "1f1b", "The pipeline's schedule; zbv (zero bubble, V) has each stage hold two pieces of the model and fills the bubbles "
                "with weight gradients.",
        choice(*PIPELINE_SCHEDULES), "pipeline", keyword="schedule", example="gpipe", flag="--pipeline-schedule")

    def __post_init__(self) -> None:
        validate(self, "pipeline")


@dataclass(frozen=True)
class Config:
    """Every option of a ParallelWrapper, each declared once (registry.option): its default, what it
    does, what a value must be, the builder's setter, pw-fit's flag, and whether a checkpoint's
    fingerprint holds it. Validated on construction: each value, then CONFLICTS."""

    workers: int = option(
        2, "Workers, one process and device each; one worker on the CPU trains in this process.",
        count(1), "workers", example=1, flag="--workers", fingerprint=True)
    prefetch_buffer: int = option(
        24, "Batches read ahead into the spawned workers' shared queue.",
        count(1), "prefetch_buffer", example=48, flag="--prefetch-buffer")
    averaging_frequency: int = option(
        1, "Local iterations per worker between averagings.",
        count(1), "averaging_frequency", example=8, flag="--averaging-frequency", fingerprint=True)
    autopilot: Autopilot | None = option(
        None, "averaging_frequency('auto'): k, the payload and the optimizer state's period chosen each round from measured times.",
        instance(Autopilot, optional=True), "averaging_frequency", example="auto", fingerprint=True)
    report_score_after_averaging: bool = option(
        True, "Report the averaged score after every averaging, or once per epoch.",
        boolean(), "report_score_after_averaging", example=False, flag="--report-score-after-averaging", fingerprint=False)
    average_updaters: bool = option(
        True, "Average optimizer state (momentum, Adam moments) with the parameters.",
        boolean(), "average_updaters", example=False, flag="--average-updaters", fingerprint=True)
    average_updaters_every: int = option(
        1, "With average_updaters: the optimizer state travels every M-th round only (DES-LOC), and at every epoch's end, "
           "checkpoint, validation and stop; each worker keeps its own in between.",
        count(1), "average_updaters", keyword="every", example=4, flag="--average-updaters-every", fingerprint=True)
    overlap_averaging: bool = option(
        False, "Run each averaging in the background during the next round's steps.",
        boolean(), "overlap_averaging", example=True, flag="--overlap-averaging", fingerprint=True)
    fragments: int = option(
        1, "With overlap_averaging: the state averaged in N fragments of about equal bytes, each sent at its own point "
           "of the round and landed a round later.",
        count(1), "fragments", example=2, flag="--fragments")
    training_mode: TrainingMode = option(
        TrainingMode.AVERAGING, "averaging: local steps, then average; shared-gradients: average gradients every step.",
        instance(TrainingMode), "training_mode", example=TrainingMode.SHARED_GRADIENTS, flag="--training-mode", fingerprint=True)
    deterministic: bool = option(
        False, "Deal batch i to worker i mod N: the same run gives the same model, and a resumed run ends as an uninterrupted one.",
        boolean(), "deterministic", example=True, flag="--deterministic", fingerprint=True)
    feed: str = option(
        "auto", "How spawned workers get a list of batches: auto, each worker reads its share itself; queue, the main process feeds every batch.",
        choice(*FEEDS), "feed", example="queue")
    seed: int = option(
        0, "Worker i seeds its RNGs with seed + i.",
        count(None), "seed", example=123, flag="--seed")
    devices: tuple[str, ...] | None = option(
        None, "One device per worker (None: a GPU per worker when there are GPUs, shared round-robin when the workers outnumber them, else the CPU).",
        instance(tuple, optional=True), "devices", example=("cpu", "cpu"))
    backend: str = option(
        "auto", "auto: NCCL when every worker has a GPU of its own, else gloo.",
        choice(*BACKENDS), "backend", example="gloo")
    stall_timeout: float = option(
        300.0, "Seconds a spawned worker may go without progress before fit() fails, naming it.",
        positive(), "stall_timeout", example=60.0)
    checkpoint_dir: str | None = option(
        None, "Save a checkpoint here every checkpoint_every rounds, at each epoch's end and on Ctrl-C.",
        instance(str, optional=True), "checkpoint", example="checkpoints", flag="--checkpoint-dir")
    checkpoint_every: int = option(
        50, "Rounds between checkpoints.",
        count(1), "checkpoint", keyword="every", example=100, flag="--checkpoint-every")
    nan_policy: NanPolicy = option(
        NanPolicy.RAISE, "raise: a non-finite loss fails fit(); skip: that worker's round is dropped.",
        instance(NanPolicy), "nan_policy", example=NanPolicy.SKIP)
    threads_per_worker: int | None = option(
        None, "torch threads in each worker (None: the machine's cores shared out among the workers).",
        count(1, optional=True), "threads_per_worker", example=1)
    gradient_clipping: float | None = option(
        None, "Clip each step's gradients to this total norm (None: no clipping).",
        positive(optional=True), "gradient_clipping", example=1.0, flag="--gradient-clipping")
    accumulate: int = option(
        1, "Each batch is one optimizer step, computed as N micro-batches (its samples cut in N along dim 0), each's "
           "gradients added before the step: the same step in less memory.",
        count(1), "accumulate", example=2, flag="--accumulate")
    precision: str = option(
        "32", "bf16-mixed: forward and loss under autocast to bfloat16 (16-mixed: float16, loss scaled); weights and averaging stay float32.",
        choice(*PRECISIONS), "precision", example="bf16-mixed", flag="--precision")
    validation_every: int | None = option(
        50, "With .validation(data): averagings between validations (None: at epoch ends only).",
        count(1, optional=True), "validation", keyword="every", example=10, flag="--validation-every")
    warmup_sync_steps: int = option(
        0, "Post-local SGD: share gradients every step for the first N steps, then average every averaging_frequency.",
        count(0), "warmup_sync_steps", example=200, flag="--warmup-sync-steps", fingerprint=True)
    payload_dtype: str = option(
        "float32", "What an averaging sends: bfloat16/float16 the change since the last average cast, int8/int4 block-quantized "
                   "(a scale per 256 numbers), sparse the largest 64 of each 4096 at 2 bits (sparse:D: a density D in (0, 0.25], e.g. "
                   "sparse:0.03125, 128 of each 4096); what is not sent goes with the next round.",
        ruled(payloads.problem, *PAYLOAD_DTYPES, "sparse:D"), "payload_dtype", example="int8", flag="--payload-dtype")
    hierarchy: str = option(
        "none", "node: under torchrun, a node's ranks share gradients every step and nodes average every k steps.",
        choice("none", "node"), "hierarchy", example="node")
    on_worker_failure: str = option(
        "raise", "raise: a worker's failure fails fit(); replace: a fresh process takes its place from the last average.",
        choice(*FAILURE_POLICIES), "on_worker_failure", example="replace")
    max_replacements: int = option(
        3, "With on_worker_failure('replace'): replacements over the wrapper's life before a failure raises.",
        count(0), "on_worker_failure", keyword="max_replacements", example=5, flag="--max-replacements")
    auto_resume: bool = option(
        True, "Under torchrun with checkpoints: a restarted group resumes from the last checkpoint.",
        boolean(), "auto_resume", example=False)
    fleet: str | None = option(
        None, "A fleet: processes launched apart (a torchrun on each machine) form one group in this store (tcp://HOST:PORT[/NAME], "
              "or etcd://HOST:PORT,...[/NAME]); "
              "with on_worker_failure('replace') the survivors of a lost machine go on from the last average.",
        ruled(fleet_address_problem, "tcp://10.0.0.1:29400", optional=True), "fleet", example="tcp://10.0.0.1:29400")
    fleet_processes: int = option(
        1, "With fleet(store): the processes that form its first group, on every machine together.",
        count(1), "fleet", keyword="processes", example=4)
    fleet_rescale: bool = option(
        True, "With fleet(store): a round of n live processes, fewer than planned, moves the model n/N of the way to their average, "
              "so that a sample weighs what it does in the planned fleet; False: to the average.",
        boolean(), "fleet", keyword="rescale", example=False)
    peer_timeout: float = option(
        30.0, "Under torchrun: seconds a rank may hear nothing from a peer before it exits, naming it.",
        positive(), "peer_timeout", example=10.0)
    gradient_encoding: GradientEncoding | None = option(
        None, "SHARED_GRADIENTS' updates sent threshold-encoded (None: dense).",
        instance(GradientEncoding, optional=True), "gradient_encoding", example=GradientEncoding(), fingerprint=True)
    pipeline: Pipeline | None = option(
        None, "Each worker a pipeline of stage processes (None: none).",
        instance(Pipeline, optional=True), "pipeline", example=Pipeline())  # its stages are in the fingerprint (checkpoint.py)

    def __post_init__(self) -> None:
        validate(self)
        if self.autopilot is not None:
            self.autopilot.check_payloads()
        check_devices(self.devices)  # how many there must be is env.resolve's to check
        refuse(self)

    def planned_workers(self, world_size: int) -> int:
        """The workers this run is planned for, by which a per-step schedule counts its global steps
        and a round's share of the model's move is weighed: a fleet's `processes` (its group shrinks
        and grows about them), else the group's `world_size`."""
        return self.fleet_processes if self.fleet is not None else world_size


OPTIONS: dict[str, Declared] = {d.name: d for d in declared(Config)}  # every option, by name, as declared


class JobParts(Protocol):
    """What CONFLICTS reads of a job.Job: which of its parts are set."""

    @property
    def outer_optimizer(self) -> object: ...
    @property
    def loss_fn(self) -> object: ...
    @property
    def training_step(self) -> object: ...
    @property
    def before_step(self) -> object: ...
    @property
    def validation_step(self) -> object: ...


@dataclass(frozen=True)
class Conflict:
    """Options that cannot go together (or one that needs another), and why.

    Args:
        options: the two it names, the one whose message it is first.
        when: whether a config (and a job: None before build(), where the rows on its parts are false) has them together.
        message: the error, naming both and the fix; `{c}` in it is the config.
        example: the builder calls that make it (the tests run them).
    """

    options: tuple[str, str]
    when: Callable[[Config, JobParts | None], bool]
    message: str
    example: str


def _shared(c: Config) -> bool:
    return c.training_mode is TrainingMode.SHARED_GRADIENTS


_AUTO = "averaging_frequency('auto') does not go with "
_EVERY = "average_updaters(every={c.average_updaters_every}) does not go with "
_CODED = "gradient_encoding does not go with "
_STAGES = "pipeline(stages={c.pipeline.stages}) does not go with "
_FLEET = "fleet(...) does not go with "
CONFLICTS: tuple[Conflict, ...] = (
    Conflict(("overlap_averaging", "training_mode"), lambda c, j: c.overlap_averaging and _shared(c),
             "overlap_averaging applies to TrainingMode.AVERAGING only: with SHARED_GRADIENTS every step needs the averaged "
             "gradients before it can be taken; drop .overlap_averaging(True)",
             ".training_mode('shared-gradients').overlap_averaging(True)"),
    Conflict(("warmup_sync_steps", "training_mode"), lambda c, j: c.warmup_sync_steps > 0 and _shared(c),
             "warmup_sync_steps switches from shared gradients to averaging rounds: it needs TrainingMode.AVERAGING; "
             "drop .warmup_sync_steps() or .training_mode(TrainingMode.SHARED_GRADIENTS)",
             ".training_mode('shared-gradients').warmup_sync_steps(10)"),
    Conflict(("hierarchy", "training_mode"), lambda c, j: c.hierarchy == "node" and _shared(c),
             "hierarchy('node') averages gradients within a node and the state across nodes: it needs "
             "TrainingMode.AVERAGING (SHARED_GRADIENTS averages gradients over every rank already); drop one",
             ".training_mode('shared-gradients').hierarchy('node')"),
    Conflict(("outer_optimizer", "training_mode"), lambda c, j: j is not None and j.outer_optimizer is not None and _shared(c),
             "outer_optimizer steps on each round's average, which SHARED_GRADIENTS has not: use TrainingMode.AVERAGING",
             ".training_mode('shared-gradients').outer_optimizer(torch.optim.SGD, lr=0.7)"),
    Conflict(("fragments", "overlap_averaging"), lambda c, j: c.fragments > 1 and not c.overlap_averaging,
             "fragments({c.fragments}) spreads each round's averaging through the next round's steps, fragment by fragment: "
             "it needs .overlap_averaging(True)",
             ".fragments(2)"),
    Conflict(("fragments", "on_worker_failure"), lambda c, j: c.fragments > 1 and c.on_worker_failure == "replace",
             'on_worker_failure("replace") restarts every worker from one landed average, which fragments({c.fragments}) '
             "reach only at an epoch's end, a checkpoint or a validation: drop one of them",
             ".overlap_averaging(True).fragments(2).on_worker_failure('replace')"),
    Conflict(("gradient_encoding", "training_mode"), lambda c, j: c.gradient_encoding is not None and not _shared(c),
             _CODED + "the training_mode: it encodes each step's update, which only TrainingMode.SHARED_GRADIENTS shares; "
             "add .training_mode(TrainingMode.SHARED_GRADIENTS)",
             ".gradient_encoding()"),
    Conflict(("gradient_encoding", "payload_dtype"), lambda c, j: c.gradient_encoding is not None and c.payload_dtype != "float32",
             _CODED + "payload_dtype, which casts averagings (the encoded updates are signs already): drop .payload_dtype()",
             ".training_mode('shared-gradients').gradient_encoding().payload_dtype('int8')"),
    Conflict(("gradient_encoding", "precision"), lambda c, j: c.gradient_encoding is not None and c.precision == "16-mixed",
             _CODED + "precision 16-mixed, whose loss scale would go into each worker's residual: use .precision('bf16-mixed')",
             ".training_mode('shared-gradients').gradient_encoding().precision('16-mixed')"),
    Conflict(("gradient_encoding", "on_worker_failure"), lambda c, j: c.gradient_encoding is not None and c.on_worker_failure == "replace",
             _CODED + "on_worker_failure('replace'): a worker's residual (what it has not sent yet) is lost with it; "
             "use .checkpoint(dir) and resume",
             ".training_mode('shared-gradients').gradient_encoding().on_worker_failure('replace')"),
    Conflict(("average_updaters_every", "average_updaters"), lambda c, j: c.average_updaters_every > 1 and not c.average_updaters,
             _EVERY + "average_updaters(False), which never sends the optimizer state: drop every=",
             ".average_updaters(False, every=4)"),
    Conflict(("average_updaters_every", "overlap_averaging"), lambda c, j: c.average_updaters_every > 1 and c.overlap_averaging,
             _EVERY + "overlap_averaging, whose rounds average the whole state in the background a round later: drop one",
             ".average_updaters(every=4).overlap_averaging(True)"),
    Conflict(("average_updaters_every", "payload_dtype"), lambda c, j: c.average_updaters_every > 1 and c.payload_dtype != "float32",
             _EVERY + "payload_dtype {c.payload_dtype!r}, which codes the optimizer state with the parameters, one residual for "
             "both: use float32 or every=1",
             ".average_updaters(every=4).payload_dtype('int8')"),
    Conflict(("payload_dtype", "average_updaters"), lambda c, j: payloads.is_sparse(c.payload_dtype) and c.average_updaters,
             "payload_dtype({c.payload_dtype!r}) sends the largest entries (1.56% by default) of each 4096 numbers of a change, which suits the parameters but "
             "not the optimizer's state (Adam's second moments, coded so, go astray: a loss 2.4x higher on a small job): add "
             ".average_updaters(False) (pw-fit: --no-average-updaters), each worker keeping its own, as DiLoCo does",
             ".payload_dtype('sparse')"),
    Conflict(("average_updaters_every", "hierarchy"), lambda c, j: c.average_updaters_every > 1 and c.hierarchy == "node",
             _EVERY + "hierarchy('node'), whose shards carry the optimizer state with the parameters: drop one",
             ".average_updaters(every=4).hierarchy('node')"),
    Conflict(("average_updaters_every", "on_worker_failure"), lambda c, j: c.average_updaters_every > 1 and c.on_worker_failure == "replace",
             _EVERY + "on_worker_failure('replace'), which redoes a round from any survivor's copy: between averagings the "
             "workers' optimizer states differ; drop one",
             ".average_updaters(every=4).on_worker_failure('replace')"),
    Conflict(("average_updaters_every", "pipeline"), lambda c, j: c.average_updaters_every > 1 and c.pipeline is not None,
             _EVERY + "a pipeline, which this version does not run it with: drop one",
             ".average_updaters(every=4).pipeline(stages=2)"),
    Conflict(("autopilot", "training_mode"), lambda c, j: c.autopilot is not None and _shared(c),
             _AUTO + "TrainingMode.SHARED_GRADIENTS, which averages every step: there is no k to choose",
             ".averaging_frequency('auto').training_mode('shared-gradients')"),
    Conflict(("autopilot", "deterministic"), lambda c, j: c.autopilot is not None and c.deterministic,
             _AUTO + "deterministic(True): it chooses from measured times, which differ from run to run; set a fixed k",
             ".averaging_frequency('auto').deterministic(True)"),
    Conflict(("autopilot", "overlap_averaging"), lambda c, j: c.autopilot is not None and c.overlap_averaging,
             _AUTO + "overlap_averaging(True): it turns overlap on itself, as its last resort where k_max and the fewest "
             "bytes leave exchanges above its share of the time (overlap_averaging(False) keeps it off); to overlap "
             "from the first round, set a fixed k",
             ".averaging_frequency('auto').overlap_averaging(True)"),
    Conflict(("fleet", "on_worker_failure"), lambda c, j: c.fleet is not None and c.on_worker_failure != "replace",
             _FLEET + "on_worker_failure('raise'): a fleet's processes go on without a lost one; set .on_worker_failure('replace') "
             "with it, or, for a group that stops at a loss, launch one torchrun across the machines",
             ".fleet('tcp://10.0.0.1:29400', processes=4)"),
    Conflict(("fleet", "deterministic"), lambda c, j: c.fleet is not None and c.deterministic,
             _FLEET + "deterministic(True): it deals batch i to rank i mod N, and a fleet's N and ranks change as processes go "
             "and come; drop one",
             ".fleet('tcp://10.0.0.1:29400', processes=4).on_worker_failure('replace').deterministic(True)"),
    Conflict(("fleet", "training_mode"), lambda c, j: c.fleet is not None and _shared(c),
             _FLEET + "TrainingMode.SHARED_GRADIENTS: its ranks read dealt shards, which a group that changes would deal "
             "anew mid-epoch; use averaging",
             ".fleet('tcp://10.0.0.1:29400', processes=4).on_worker_failure('replace').training_mode('shared-gradients')"),
    Conflict(("fleet", "feed"), lambda c, j: c.fleet is not None and c.feed != "auto",
             _FLEET + "feed('queue'): a fleet's processes claim their batches from its store; drop .feed('queue')",
             ".fleet('tcp://10.0.0.1:29400', processes=4).on_worker_failure('replace').feed('queue')"),
    Conflict(("fleet", "pipeline"), lambda c, j: c.fleet is not None and c.pipeline is not None,
             _FLEET + "a pipeline in this version: a lost stage takes its pipeline with it, and stages step in lockstep; drop one",
             ".fleet('tcp://10.0.0.1:29400', processes=4).on_worker_failure('replace').pipeline(stages=2)"),
    Conflict(("fleet", "hierarchy"), lambda c, j: c.fleet is not None and c.hierarchy != "none",
             _FLEET + "hierarchy('node') in this version: its nodes are torchrun's, which a fleet's group is not; drop one",
             ".fleet('tcp://10.0.0.1:29400', processes=4).on_worker_failure('replace').hierarchy('node')"),
    Conflict(("pipeline", "on_worker_failure"), lambda c, j: c.pipeline is not None and c.on_worker_failure == "replace",
             _STAGES + "on_worker_failure(\"replace\"): a lost stage would take its whole pipeline with it; drop it",
             ".pipeline(stages=2).on_worker_failure('replace')"),
    Conflict(("pipeline", "precision"), lambda c, j: c.pipeline is not None and c.precision == "16-mixed",
             _STAGES + "precision('16-mixed'): its loss scaling needs the loss before the backward, which the pipeline's "
             "schedule runs itself; use .precision('bf16-mixed')",
             ".pipeline(stages=2).precision('16-mixed')"),
    Conflict(("pipeline", "hierarchy"), lambda c, j: c.pipeline is not None and c.hierarchy != "none",
             _STAGES + "hierarchy: its node groups are not stage groups; drop .hierarchy()",
             ".pipeline(stages=2).hierarchy('node')"),
    Conflict(("pipeline", "validation"), lambda c, j: j is not None and c.pipeline is not None and j.validation_step is not None,
             _STAGES + "validation(step=fn): fn(model, batch) takes the whole model, which no stage holds; drop step= for "
             "val_loss and val_accuracy",
             ".pipeline(stages=2).validation(data, step=fn)"),
    Conflict(("pipeline", "training_step"), lambda c, j: j is not None and c.pipeline is not None and (j.training_step is not None or j.loss_fn is None),
             _STAGES + "training_step: the last stage computes the loss from (inputs, targets) batches; use .loss_fn(fn)",
             ".pipeline(stages=2).training_step(fn)"),
    Conflict(("pipeline", "accumulate"), lambda c, j: c.pipeline is not None and c.accumulate > 1,
             _STAGES + "accumulate({c.accumulate}): a pipeline cuts each batch into micro-batches itself; use "
             ".pipeline(stages={c.pipeline.stages}, microbatches={c.accumulate}) instead",
             ".pipeline(stages=2).accumulate(2)"),
    Conflict(("pipeline", "before_step"), lambda c, j: j is not None and c.pipeline is not None and j.before_step is not None,
             _STAGES + "before_step: each stage holds only a part of the model; drop .before_step(fn)",
             ".pipeline(stages=2).before_step(fn)"),
)  # fmt: skip


def refuse(config: Config, job: JobParts | None = None) -> None:
    """A ValueError with the message of the first of CONFLICTS that `config` has (with `job`, the
    ones that need a job too)."""
    for conflict in CONFLICTS:
        if conflict.when(config, job):
            raise ValueError(conflict.message.format(c=config))


def steered(config: Config) -> Config:
    """`config` with the autopilot's levers narrowed to what the table lets a round run with: a
    payload, an optimizer-state period or overlap that CONFLICTS refuses beside the other options
    (e.g. the state every 4 rounds with a pipeline or replacement) is not one it may choose. It
    starts at its start among them (Autopilot.start); none left to send with is a ValueError."""
    spec = config.autopilot
    if spec is None:
        return config

    def runs(**fields: object) -> bool:
        try:
            dataclasses.replace(config, autopilot=None, **fields)  # type: ignore[arg-type]
        except ValueError:
            return False
        return True

    payloads_ = tuple(p for p in spec.payloads if runs(payload_dtype=p, **in_config(Rung(p, 0))))
    periods = tuple(m for m in spec.updater_periods if runs(payload_dtype="float32", **in_config(Rung("float32", m))))
    overlap = spec.overlap and runs(averaging_frequency=spec.k_max, overlap_averaging=True)
    narrowed = dataclasses.replace(spec, payloads=payloads_, updater_periods=periods, overlap=overlap)
    start = narrowed.start
    return dataclasses.replace(config, autopilot=narrowed, payload_dtype=start.payload, **in_config(start))


def parse_enum(cls: type[E], value: object, name: str) -> E:
    """An option given as an enum member or its value, or a ValueError naming the choices."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {[m.value for m in cls]} or a {cls.__name__}, got {value!r}") from None


def describe_config(config: Config) -> dict[str, object]:
    """The config as JSON-ready data (enums by value), for checkpoints, summaries and people."""
    out = dataclasses.asdict(config)
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in out.items()}


__all__ = [
    "CONFLICTS", "OPTIONS", "PAYLOAD_DTYPES", "PIPELINE_SCHEDULES", "PRECISIONS", "Config", "Conflict", "GradientEncoding", "NanPolicy",
    "Pipeline", "TrainingMode", "check_devices", "check_int", "describe_config", "parse_enum", "refuse", "steered",
]  # fmt: skip
