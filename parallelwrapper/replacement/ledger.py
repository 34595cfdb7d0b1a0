"""A replaceable worker's takes since its round started, in shared memory: what to feed again when it is lost.

The main process feeds them again when the worker is lost (`.on_worker_failure("replace")`).

Each entry is (tag, slot, epoch): the round the batch was taken for (a count of rounds over the
wrapper's life, the same on every worker), the shared-memory slot that still holds it, and its
epoch; an end of epoch is slot -1. A worker keeps its slots until the round they were taken for
has landed, instead of handing each back as soon as it has copied the batch out, so that a batch
can be fed again from where it lies. At each round's start (`cut`) the slots of landed rounds go
back to the feeder; an end of epoch is kept until the epoch is over, since the worker must take
it again if the round is redone.

The worker writes an entry and then the count, so that a worker killed between the two leaves no
half-written entry; the main process reads a ledger only once its worker is dead or parked.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.context import BaseContext

from ..feed.queue import END_SLOT

_FIELDS = 3


@dataclass(frozen=True)
class Entry:
    tag: int
    slot: int  # END_SLOT: the end of the epoch
    epoch: int


class Ledger:
    """One worker's entries of the rounds not landed yet: at most `capacity` (a round's batches,
    two rounds' with overlap_averaging, the one taken ahead for the next round, and an end of
    epoch)."""

    def __init__(self, ctx: BaseContext, capacity: int) -> None:
        self._array = ctx.Array("q", 1 + capacity * _FIELDS, lock=False)
        self._capacity = capacity
        self.tag = 0  # the round in progress, which a take is for unless retagged (worker side)
        self.epoch = 0

    # -- in the worker ---------------------------------------------------------------------------

    def take(self, slot: int) -> None:
        n = int(self._array[0])
        if n >= self._capacity:
            raise RuntimeError(f"the replacement ledger is full ({self._capacity} entries): a round took more batches than it can hold")
        o = 1 + n * _FIELDS
        self._array[o : o + _FIELDS] = [self.tag, slot, self.epoch]
        self._array[0] = n + 1

    def retag_last(self, tag: int) -> None:
        """The last take is for round `tag`, a later one than the round in progress."""
        n = int(self._array[0])
        assert n > 0, "retag_last without a take"
        self._array[1 + (n - 1) * _FIELDS] = tag

    def cut(self, tag: int, epoch: int, finished: bool, landed: int) -> list[int]:
        """Round `tag` of `epoch` starts, rounds up to `landed` have landed: drop their entries
        (and the ends of past epochs), and return their slots, which the feeder may reuse."""
        self.tag, self.epoch = tag, epoch
        kept: list[Entry] = []
        released: list[int] = []
        for e in self.entries():
            if e.slot == END_SLOT:
                if finished and e.epoch == epoch:
                    kept.append(e)
            elif e.tag > landed:
                kept.append(e)
            else:
                released.append(e.slot)
        self._write(kept)
        return released

    # -- in the main process, with the worker dead or parked -------------------------------------

    def entries(self) -> list[Entry]:
        a = self._array
        n = int(a[0])
        return [Entry(*(int(v) for v in a[1 + i * _FIELDS : 1 + (i + 1) * _FIELDS])) for i in range(n)]

    def clear(self) -> None:
        self._array[0] = 0

    def _write(self, entries: list[Entry]) -> None:
        self._array[0] = 0
        for i, e in enumerate(entries):
            o = 1 + i * _FIELDS
            self._array[o : o + _FIELDS] = [e.tag, e.slot, e.epoch]
        self._array[0] = len(entries)


def split(entries: list[Entry], tag: int, epoch: int) -> tuple[list[Entry], list[int]]:
    """For a redo of round `tag` of `epoch`: the entries to feed again (taken for that round or
    later, and that epoch's ends), and the slots of the rest (landed in the average), to free."""
    again: list[Entry] = []
    free: list[int] = []
    for e in entries:
        if e.slot == END_SLOT:
            if e.epoch == epoch:
                again.append(e)
        elif e.tag >= tag:
            again.append(e)
        else:
            free.append(e.slot)
    return again, free
