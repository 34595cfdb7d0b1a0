"""Which of an epoch's batches a round trains, and the global step of each.

A round is the epoch's batches with indices in [start, start + N·k) (SHARED_GRADIENTS: N), its
start the last round's end, so every run, with either feed, cuts an epoch into the same rounds:
N·k·m batches are m rounds. A worker takes batches until the one that comes is past the round's
end; that one it holds for its round. So the round that trains a worker's last batch has seen
its end of the epoch, and the epoch ends with it, not one more round of zeros. Dealt, each
worker has its k of a round; from the first-come queue, which gives batches in index order, a
faster worker takes more. (Stopping after k and then looking one batch ahead, as before, took
at an epoch's end a batch that another worker still needed: 256 batches at k = 32 on 2 workers
ended in five rounds, the last of one batch.)

The global step is DDP's: the epoch's batch i is step s + (i − p) // N, where s is the step
count ⌈I / N⌉ when the epoch began (I: the batches of every landed round, over the wrapper's
life) and p the epoch's first index (a resumed epoch starts past 0). A per-step schedule runs
each batch at its step (schedule.py). N is the workers the run is planned for: a fleet's
`processes`, whatever its group's size now, so that its steps neither jump when a machine goes
nor stand still when it comes back (Config.planned_workers).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..feed.protocols import END, BatchSource
from ..types import Batch, Counters


class RoundCut:
    """One worker's view of the epoch's batches, round by round."""

    def __init__(self, ranks: int, planned: int) -> None:
        self.ranks = ranks  # every rank that takes batches (with a hierarchy: of every node)
        self.planned = planned  # the ranks a global step counts: `ranks`, or a fleet's planned processes
        self.start = self.end = 0  # the round being trained: the epoch's batches [start, end)
        self.finished = False  # this worker has had its end of the epoch
        self._epoch = 0  # the epoch being cut
        self._first = (0, 0)  # (the global step, the index) of the epoch's first batch
        self._held: tuple[int, Batch] | None = None  # a batch taken for a later round
        self._source: BatchSource | None = None

    def fit_starts(self, source: BatchSource) -> None:
        """A batch held before a stop is not trained: the next fit() starts afresh."""
        self._source, self._held = source, None

    def epoch_starts(self, counters: Counters) -> None:
        self.finished, self.end, self._epoch = False, counters.position, counters.epoch
        self._first = (math.ceil(counters.iterations / self.planned), counters.position)

    @property
    def source(self) -> BatchSource | None:
        return self._source

    def held(self) -> int | None:
        """The index of a batch taken for a later round, not trained yet."""
        return None if self._held is None else self._held[0]

    def claim_of(self, epoch: int, index: int) -> int:
        """Batch `index` of `epoch` (this one or the next) as a claim number counted from the
        round's first batch (feed/claims.py)."""
        if epoch == self._epoch:
            return index - self.start
        length = self._length()
        assert epoch == self._epoch + 1 and length is not None, "a claim two epochs ahead, or of an epoch of unknown length"
        return length - self.start + index

    def round_starts(self, batches: int) -> None:
        self.start, self.end = self.end, self.end + batches

    def steps(self) -> int | None:
        """Each worker's steps in the whole epoch (its batches over the ranks, rounded up), where
        the source knows the epoch's length; else None."""
        length = self._length()
        return None if length is None else -(-length // self.ranks)

    def steps_left(self) -> int | None:
        """Each worker's steps left in the epoch after the last round (its batches over the
        ranks, rounded up), where the source knows the epoch's length; else None."""
        length = self._length()
        return None if length is None else max(0, -(-(length - self.end) // self.ranks))

    def _length(self) -> int | None:
        """The epoch's batches, where the source knows them."""
        assert self._source is not None
        return self._source.epoch_length(self._epoch)

    def step_of(self, index: int) -> int:
        step, first = self._first
        return step + (index - first) // self.planned

    def next(self, waiting: Callable[[], None], held_for: Callable[[int], None]) -> tuple[int, Batch] | None:
        """The round's next batch for this worker, or None: at its end of the epoch, or when the
        batch that came is past the round's end. `waiting` is called before a wait for the
        feed; `held_for(rounds)` when a batch is held for the round `rounds` after this one."""
        if self._held is not None:
            if self._held[0] >= self.end:
                return None  # still a later round's
            held, self._held = self._held, None
            return held
        if self.finished:
            return None
        assert self._source is not None
        waiting()
        item = self._source.next_batch()
        if item is END:
            self.finished = True
            return None
        assert isinstance(item, tuple)
        if item[0] >= self.end:
            self._held = item
            held_for(1 + (item[0] - self.end) // (self.end - self.start))
            return None
        return item


__all__ = ["RoundCut"]
