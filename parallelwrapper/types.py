"""The records, sentinels and errors that several modules share: what a fit reports, counters, hooks, `WorkerError`.

What a fit reports (one record per event: `Score`, `EpochEnd`, `Validation`, `Replacement`), where
a worker is, the end of its epoch, and the errors a user can meet from a worker. Imports nothing
of the package."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

# The user's own values: the package carries them, walks them (batches.map_leaves) and hands them
# back to the user's code, and their types are the user's. Each is named once here.
Batch = Any  # a batch as the user's data yields it: a tensor, or tuples, lists and dicts of tensors and other leaves, nested
Output = Any  # what the user's model returns for a batch, as their loss function and metrics take it
Sample = Any  # an item of the user's map-style dataset, as their DataLoader's collate function takes a list of them
StateDict = dict[str, Any]  # a state_dict of the user's model, optimizer or schedule (or of torch's RNG, GradScaler), as torch types it


class EndOfEpoch:
    """The sentinel a batch source returns when this worker's share of the epoch is done."""


END = EndOfEpoch()


class BatchSource(Protocol):
    def next_batch(self) -> tuple[int, Batch] | EndOfEpoch:
        """(batch index in the epoch, batch) or END."""
        ...

    def epoch_length(self, epoch: int) -> int | None:
        """How many batches epoch `epoch` has over every rank, where every rank's source knows it
        before the epoch ends (a list, Epochs); else None. Every rank must answer the same: the
        autopilot cuts the epoch's last rounds by it (Pilot.steps)."""
        ...


@runtime_checkable
class Epochs(Protocol):
    """Epochs of batches read by index: what spawned workers are sent once per fit to read their
    shards from (feed/epochs.py: a list of batches, or a map-style DataLoader's sample indices)."""

    def length(self, epoch: int) -> int:
        """How many batches epoch `epoch` has."""
        ...

    def batch_at(self, epoch: int, index: int) -> Batch:
        """Batch `index` of epoch `epoch`, loaded."""
        ...


class Phase(enum.IntEnum):
    """Where a worker is, for the supervisor's stall watchdog."""

    IDLE = 0
    WAITING = 1  # for a batch
    TRAINING = 2
    AVERAGING = 3


@dataclass
class Counters:
    """Progress over the wrapper's life; identical on every worker after each round. Anything that
    must stay in step across workers (the averaging period, checkpoints) reads these."""

    rounds: int = 0  # averagings (SHARED_GRADIENTS: steps)
    iterations: int = 0  # batches trained, all workers
    samples: int = 0  # samples trained, all workers
    epoch: int = 0  # the epoch in progress (= epochs completed, between epochs)
    position: int = 0  # batches of `epoch` trained in completed rounds: where a resumed feed starts


@dataclass(frozen=True)
class InForce:
    """What a round ran with: k (1 in a gradient round; with the autopilot, an epoch's last round
    that took in a short tail says the steps it could take: Pilot.steps), the payload, every how
    many rounds the optimizer's state travelled (0: never), overlap and fragments; and, when the
    autopilot (`.averaging_frequency("auto")`) changed any of them after it, why."""

    k: int
    payload: str
    updaters_every: int
    overlap: bool = False
    fragments: int = 1
    why: str | None = None


@dataclass(frozen=True)
class EncodingStats:
    """Gradient encoding over a run of steps (`Builder.gradient_encoding`), the same on every worker."""

    threshold: float  # τ after the last of them: the next step's
    density: float  # the share of entries a worker that sent sent, the mean over the steps (NaN: nobody sent)
    bytes_sent: float  # bytes each worker sent in them, on average: its messages, the header, the buffers
    steps: int

    def __add__(self, later: EncodingStats) -> EncodingStats:
        """These steps, then `later`'s."""
        steps = self.steps + later.steps
        density = (self.density * self.steps + later.density * later.steps) / steps
        return EncodingStats(later.threshold, density, self.bytes_sent + later.bytes_sent, steps)


# What a fit reports: one record per event, built by the worker that saw it (a spawned worker's
# travel to the main process as they are) and kept in the fit's History (listeners.py). Each says
# where the wrapper's counters stand after it (`counters`), which the wrapper takes on.


@dataclass(frozen=True)
class Score:
    """The averaged score after one averaging (or, in SHARED_GRADIENTS, every k steps)."""

    round: int  # averagings so far, over the wrapper's life
    iteration: int  # batches trained so far, all workers together
    samples: int  # samples trained so far, all workers together
    epoch: int
    score: float  # sample-weighted mean loss over the round's batches, all workers
    seconds: float  # since this fit() started
    skipped: int = 0  # workers dropped from this round by NanPolicy.SKIP
    position: int = 0  # batches of `epoch` trained so far (a resumed fit() starts past 0)
    encoding: EncodingStats | None = None  # with gradient encoding: τ after these steps, their density and bytes sent
    lr: float = math.nan  # the learning rate of the round's last local step (the first parameter group's, on rank 0)
    # Where the reporting worker's time went since the last score: its local steps, and the
    # exchanges (sending, waiting for the others and the network, applying the average).
    training_s: float = math.nan
    exchange_s: float = math.nan
    # What the round ran with (the last of them, when a score covers several; InForce): k, the
    # payload, every how many rounds the optimizer's state travelled (0: never), overlap,
    # fragments; the reporting worker's seconds per local step and per exchange over them; and,
    # when `.averaging_frequency("auto")` changed the choice after them, why.
    k: int = 0
    payload: str = "float32"
    updaters_every: int = 1
    overlap: bool = False
    fragments: int = 1
    step_s: float = math.nan
    link_s: float = math.nan
    why: str | None = None

    @property
    def counters(self) -> Counters:
        """The counters after this round: its round, iteration, samples, epoch and position."""
        return Counters(self.round, self.iteration, self.samples, self.epoch, self.position)


@dataclass(frozen=True)
class EpochEnd:
    """The end of an epoch, or of the part of it a fit trained when early stopping ended it there."""

    epoch: int
    iteration: int
    samples: int
    score: float  # sample-weighted mean loss over the epoch (over its rounds in this fit)
    seconds: float  # since this fit() started
    complete: bool = True  # False: early stopping stopped the fit partway through the epoch
    counters: Counters = dataclasses.field(kw_only=True)  # after it: where the next fit() starts


@dataclass(frozen=True)
class Validation:
    """The averaged model's metrics on the validation data (`Builder.validation`), all workers'
    shares together."""

    round: int
    iteration: int
    samples: int
    epoch: int  # the epoch of the batches trained so far (at an epoch's end: the one that ended)
    metrics: dict[str, float]  # val_loss and val_accuracy, or what the validation step returns
    seconds: float  # since this fit() started
    counters: Counters = dataclasses.field(kw_only=True)  # when it was scored


@dataclass(frozen=True)
class Replacement:
    """A spawned worker failed and a fresh process took its rank (`.on_worker_failure("replace")`);
    every worker went back to the average before round `lost_round`, which was trained again."""

    rank: int
    reason: WorkerError  # the failure, with its traceback
    lost_round: int
    seconds: float  # since this fit() started
    counters: Counters = dataclasses.field(kw_only=True)  # those the workers went back to


Report = Score | EpochEnd | Validation | Replacement  # what a worker reports
Reporter = Callable[[Report], None]

@dataclass(frozen=True)
class TrainingState:
    """What a fit() starts from and ends with, the same on every worker: state_dicts of the model,
    the optimizer and, when configured, the schedule (schedule.Schedule) and the outer optimizer."""

    model: StateDict
    optimizer: StateDict
    lr_scheduler: StateDict | None = None
    outer_optimizer: StateDict | None = None


@dataclass(frozen=True)
class DataOrder:
    """What keeps the training data's order across a resume (feed/order.py): the checkpoint
    directory where the process that draws the epochs keeps each one's order (None: it keeps
    none), and the orders a resumed run read from there, by epoch."""

    keep_in: str | None = None
    kept: dict[int, StateDict] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class FitCommand:
    """What every worker starts a fit() from: the wrapper's state, the counters, and (resuming
    from a checkpoint) each rank's own state: its RNG's, and its GradScaler's with 16-mixed; and
    when the fit() began, which the records' seconds count from."""

    until_epoch: int
    counters: Counters
    state: TrainingState
    rng: list[StateDict] | None  # per rank, when resuming from a checkpoint
    start: float  # when the fit() began, by time.monotonic(): system-wide on one machine, and under torchrun rank 0's own (it reports)
    shards: Epochs | None = None  # spawned workers that read their shards: the fit's epochs, sent once (feed/epochs.shards_of); None: fed through the queue
    claims: str | None = None  # with shards: the store key every worker claims its batches from (feed/claims.py); None: dealt
    order: DataOrder = DataOrder()  # where the epochs' orders are kept, and those a resume read (feed/order.py)


@dataclass(frozen=True)
class Where:
    """Where a worker was: `batch` is -1 between batches; `shape` describes the batch, when known."""

    epoch: int
    batch: int
    local_step: int
    shape: str = ""

    def __str__(self) -> str:
        if self.batch < 0:
            return f"in epoch {self.epoch} (local step {self.local_step})"
        shape = f" {self.shape}" if self.shape else ""
        return f"while training on batch {self.batch} of epoch {self.epoch}{shape} (local step {self.local_step})"


class CheckpointWriter(Protocol):
    """Writes a round's state to disk (checkpoint.Checkpointer); rank 0 calls it."""

    def due(self, rounds: int) -> bool: ...

    def save(self, state: TrainingState, counters: Counters, rng: list[StateDict]) -> None: ...


class RoundObserver(Protocol):
    """Who follows one worker's rounds as its round loop runs them, besides the loop itself: a
    part that its host gives it (Hooks.observer), such as one that keeps what a redo of a lost
    round would start from. Rounds are tagged by a count over the worker's life, the same on
    every worker."""

    @property
    def wants_averages(self) -> bool:
        """Whether `average_landed` is to be called: an overlapped landing then holds the average
        in the replica for a moment, which costs a pass over the state."""
        ...

    def round_starts(self, tag: int, epoch: int, finished: bool, landed: int) -> None:
        """Round `tag` of `epoch` starts; `finished`: this worker has had its end of the epoch;
        rounds up to `landed` have landed: `tag - 1`, when the worker starts from their average,
        or `tag - 2`, when round `tag - 1` is still being averaged (overlap_averaging)."""

    def held_for(self, tag: int) -> None:
        """The batch just taken from the source is held for a later round, `tag` (a take is for
        the round in progress otherwise)."""

    def average_landed(self) -> None:
        """An overlapped round has landed and, for this call only, the replica holds its average
        (the steps taken since are put back after it)."""


class Hooks:
    """What the round protocol may ask of the host it runs under, and who follows its rounds
    (`observer`). The defaults report nothing, never stop, and checkpoint only when given a
    writer (hosts/runtime.Worker gives it the one `.checkpoint(directory)` asks for)."""

    def __init__(self) -> None:
        self.checkpointer: CheckpointWriter | None = None
        self.observer: RoundObserver | None = None
        self._at: tuple[int, int, int] = (0, -1, 0)

    def progress(self, phase: Phase, epoch: int, index: int, step: int) -> None:
        """Called on every change of phase: keep it cheap (a host may write shared memory)."""
        self._at = (epoch, index, step)

    @property
    def where(self) -> Where:
        """Where the worker was at its last change of phase, for error messages."""
        return Where(*self._at)

    def stop_requested(self) -> bool:
        """True when the host wants training to stop after the current round."""
        return False

    def checkpoint_due(self, rounds: int) -> bool:
        """Whether a periodic checkpoint falls at the end of round number `rounds`."""
        return self.checkpointer is not None and self.checkpointer.due(rounds)


class TrainingError(RuntimeError):
    """A worker could not train on a batch: the message says why, `where` says where."""

    def __init__(self, message: str, where: Where | None = None) -> None:
        super().__init__(message)
        self.where = where


class Stopped(Exception):
    """Training stopped early, at a round boundary, because a worker's host asked."""


_TRACEBACK = "Traceback (most recent call last):"


class WorkerError(RuntimeError):
    """A worker failed, under any host (spawned, in-process, torchrun).

    `rank` names it; `where` says the epoch, batch and local step when known. The message reads
    first things first: who failed where, and what happened (the worker's exception type and
    message), on its first line; one line for each peer that failed because of it (`echoes`);
    then the worker's traceback (`details`), once, so that on a terminal it ends, as any Python
    traceback does, with the worker's own exception."""

    def __init__(
        self, rank: int, summary: str, details: str = "", where: Where | None = None, at: float | None = None, stage: int | None = None, echoes: tuple[str, ...] = ()
    ) -> None:
        place = f" {where}" if where is not None else ""
        who = f"worker {rank}" + ("" if stage is None else f" stage {stage}")  # `stage`: of a pipeline (pipeline/)
        head = "\n".join((f"{who} failed{place}: {summary}", *echoes))
        tail = details.rstrip()
        if tail.startswith(_TRACEBACK):  # told apart from the main process's, which a terminal shows above it
            tail = f"Traceback in {who} (most recent call last):{tail[len(_TRACEBACK) :]}"
        super().__init__(head + (f"\n\n{tail}" if tail.strip() else ""))
        self.rank, self.summary, self.details, self.where, self.stage, self.echoes = rank, summary, details, where, stage, tuple(echoes)
        self.at = time.monotonic() if at is None else at  # when it failed (system-wide clock): the first is the cause

    @property
    def epoch(self) -> int | None:
        """The epoch the worker was in, or None when it failed outside one."""
        return None if self.where is None else self.where.epoch

    @property
    def batch(self) -> int | None:
        """The index in its epoch of the batch the worker was on, or None when it held none."""
        return None if self.where is None or self.where.batch < 0 else self.where.batch

    @property
    def local_step(self) -> int | None:
        """The worker's local step in its round, or None when it failed outside one."""
        return None if self.where is None else self.where.local_step

    def __reduce__(self) -> tuple[type[WorkerError], tuple[object, ...]]:  # travels from a spawned worker as a value
        return (WorkerError, (self.rank, self.summary, self.details, self.where, self.at, self.stage, self.echoes))

    def with_echoes(self, echoes: dict[int, str], stages: int = 1) -> WorkerError:
        """This error, and one short line each, under its first, for the peers that failed because
        of it (a lost connection, mostly: the collective library's source locations are left out).
        `echoes` is by process: rank·stages + stage, with pipelines of `stages` processes."""
        me = self.rank * stages + (self.stage or 0)
        lines = tuple(f"(also {_who(p, stages)}: {_echo(line)})" for p, line in sorted(echoes.items()) if p != me)
        return WorkerError(self.rank, self.summary, self.details, self.where, self.at, self.stage, self.echoes + lines)


def _who(process: int, stages: int) -> str:
    """A process named as its worker, and its stage in a pipeline."""
    return f"worker {process}" if stages == 1 else f"worker {process // stages} stage {process % stages}"


def _echo(line: str, limit: int = 160) -> str:
    """A peer's summary, without gloo's and NCCL's `[file.cc:123]` source locations, cut at `limit`."""
    line = re.sub(r"\[[^\]]*\.(?:cc|cpp|cu|h|hpp):\d+\]\s*", "", line).strip()
    return line if len(line) <= limit else line[:limit] + "..."


# A worker's message to the main process, on the results queue: (kind, process, payload).
Message = (
    tuple[Literal["ready"], int, tuple[int, None]]  # started, or regrouped: (its pid, nothing)
    | tuple[Literal["parked"], int, tuple[int, tuple[int, Counters] | None]]  # after a loss: (its pid, the round it kept: (seq, counters)), replacement/keeper.py
    | tuple[Literal["done", "stopped"], int, TrainingState | None]  # a fit ended (stopped: by a stop request), worker 0's final state
    | tuple[Literal["error"], int, WorkerError]
    | tuple[Literal["reports"], int, list[Report]]
)


__all__ = [
    "END",
    "Batch",
    "BatchSource",
    "CheckpointWriter",
    "Counters",
    "EncodingStats",
    "EndOfEpoch",
    "Epochs",
    "EpochEnd",
    "DataOrder",
    "FitCommand",
    "Hooks",
    "Message",
    "Output",
    "Phase",
    "Replacement",
    "Reporter",
    "Report",
    "RoundObserver",
    "Sample",
    "Score",
    "StateDict",
    "Stopped",
    "TrainingError",
    "TrainingState",
    "Validation",
    "Where",
    "WorkerError",
]
