"""What the main process and a worker say to each other: the `FitCommand` a fit starts from, the `Message` a worker sends back.

The hosts' contract with their workers, which replacement speaks too without importing the hosts
(tests/test_feature_boundaries.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import WorkerError
from .feed.protocols import Epochs
from .types import Counters, DataOrder, Report, Resume, StateDict, TrainingState


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
    resume: Resume | None = None  # a fleet's round resumed without a lost peer: `state` is the round's start (its anchor), this the worker's own since


# A worker's message to the main process, on the results queue: (kind, process, payload).
Message = (
    tuple[Literal["ready"], int, tuple[int, None]]  # started, or regrouped: (its pid, nothing)
    | tuple[Literal["parked"], int, tuple[int, tuple[int, Counters] | None]]  # after a loss: (its pid, the round it kept: (seq, counters)), replacement/keeper.py
    | tuple[Literal["done", "stopped"], int, TrainingState | None]  # a fit ended (stopped: by a stop request), worker 0's final state
    | tuple[Literal["error"], int, WorkerError]
    | tuple[Literal["reports"], int, list[Report]]
)


__all__ = ["FitCommand", "Message"]
