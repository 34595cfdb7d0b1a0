"""What the round protocol asks of the host it runs under, and who follows its rounds: `Hooks`, `RoundObserver`, `Phase`.

The host's side of one worker's round loop: where the worker is (for the supervisor's watchdog
and the errors), whether to stop or checkpoint, and the observer that a part such as replacement's
keeper hangs on the loop. Apart from the records (types.py), which the main process reads too:
these only a worker's process asks."""

from __future__ import annotations

import enum
from typing import Protocol

from .errors import Where
from .types import Counters, StateDict, TrainingState


class Phase(enum.IntEnum):
    """Where a worker is, for the supervisor's stall watchdog."""

    IDLE = 0
    WAITING = 1  # for a batch
    TRAINING = 2
    AVERAGING = 3


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


__all__ = ["CheckpointWriter", "Hooks", "Phase", "RoundObserver"]
