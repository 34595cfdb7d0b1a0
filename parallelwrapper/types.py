"""The records that several modules share: what a fit reports, the counters, a training state, and the user's own values.

What a fit reports (one record per event: `Score`, `EpochEnd`, `Validation`, `Replacement`), the
counters every worker agrees on, the state a fit starts from and ends with, and the names of the
user's own values. The errors (errors.py), the feed's protocols (feed/protocols.py), the round
loop's hooks (hooks.py) and the hosts' messages (messages.py) live where they belong; this imports
only the errors, whose `WorkerError` a `Replacement` carries."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import WorkerError

# The user's own values: the package carries them, walks them (batches.map_leaves) and hands them
# back to the user's code, and their types are the user's. Each is named once here.
Batch = Any  # a batch as the user's data yields it: a tensor, or tuples, lists and dicts of tensors and other leaves, nested
Output = Any  # what the user's model returns for a batch, as their loss function and metrics take it
Sample = Any  # an item of the user's map-style dataset, as their DataLoader's collate function takes a list of them
StateDict = dict[str, Any]  # a state_dict of the user's model, optimizer or schedule (or of torch's RNG, GradScaler), as torch types it


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
    """A worker was lost (`.on_worker_failure("replace")`): a fresh process took a spawned worker's
    rank, or a fleet's survivors went on without it (`rank`: its rank in the group it left); every
    worker went back to the average before round `lost_round`, which was trained again, or a
    fleet's survivors resumed that round with what each had trained of it (types.Resume)."""

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
class Progress:
    """One worker's part of a round in flight (Rounds.progress), where a fleet's survivors may
    resume the round without a lost peer: its batches are claim numbers counted from the round's
    first batch (feed/claims.py)."""

    seq: int  # the round, over the worker's life (Rounds.seq)
    end: int  # the round's batches end before this index of its epoch
    trained: tuple[int, ...]  # the batches it trained in the round
    claimed: int  # one past the last claim it took (trained, or held for a later round)
    k: int
    samples: int
    losses: tuple[float, ...]  # loss·n per step
    first_step: int


@dataclass(frozen=True)
class Resume:
    """A round in flight that a fleet's survivors resume without a lost peer, instead of redoing it
    from its start: each keeps what it trained (`state`, its own as the loss left it; `progress`),
    and they claim first the round's batches that no survivor trained (`holes`, claim numbers from
    the round's first batch), then on from `then`. A coded round's change is taken from `starts`
    (Rounds.starts)."""

    progress: Progress
    holes: tuple[int, ...]
    then: int
    state: TrainingState
    starts: Any = None  # averaging.Starts | None, which this module does not import


@dataclass(frozen=True)
class DataOrder:
    """What keeps the training data's order across a resume (feed/order.py): the checkpoint
    directory where the process that draws the epochs keeps each one's order (None: it keeps
    none), and the orders a resumed run read from there, by epoch."""

    keep_in: str | None = None
    kept: dict[int, StateDict] = dataclasses.field(default_factory=dict)


__all__ = [
    "Batch",
    "Counters",
    "EncodingStats",
    "EpochEnd",
    "DataOrder",
    "Output",
    "Progress",
    "Replacement",
    "Reporter",
    "Report",
    "Resume",
    "Sample",
    "Score",
    "StateDict",
    "TrainingState",
    "Validation",
]
