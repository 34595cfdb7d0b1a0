"""Replacing a lost spawned worker (`.on_worker_failure("replace")`), both sides of it.

A process group cannot take a new member, so a replacement starts a new one, `generation` g:
1. A worker that fails (or that a peer's failure reaches through a collective, or that the main
   process calls away from its wait for a batch) reports it, leaves the process group, which
   ends every peer's collective at once, and parks: it reports the round it kept the state of
   (`Keeper.park`). The main process kills the worker that failed first, whichever it was.
2. The main process pauses the feed and puts back in front of every queue the batches that any
   worker had taken for the round in progress, or later (their ledgers, ledger.py), and frees the
   slots of the landed ones (`refeed`); then it spawns a fresh process for the lost rank.
3. Every worker joins generation g. The survivor that kept the latest round sends its state to
   all (a survivor holds it: nothing goes through the disk or the main process), and every
   worker redoes that round from it (`Keeper.regroup`). So each batch counts once.
A batch on which two workers failed is not fed a third time: fit() raises naming it (`Recovery`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..feed import END_SLOT, QueueSource, drain
from ..types import Counters, FitCommand, WorkerError
from .ledger import Ledger, split
from .runtime import Worker


@dataclass(frozen=True)
class Regroup:
    """The main process's word to every worker after a replacement: join process group
    `generation`, take the kept state of worker `source`, and redo its round."""

    generation: int
    source: int
    until_epoch: int


class Keeper:
    """A replaceable worker's side: records its takes, keeps each round's starting state, parks
    after a failure and regroups (hosts call it through their Hooks)."""

    def __init__(self, worker: Worker, source: QueueSource, ledger: Ledger) -> None:
        self.worker, self.source, self.ledger = worker, source, ledger

    def took_ahead(self, tag: int) -> None:
        self.ledger.retag_last(tag)

    def round_starts(self, tag: int, epoch: int, finished: bool, landed: int) -> None:
        self.source.release(self.ledger.cut(tag, epoch, finished, landed))
        self.worker.keep(tag, landed)

    def fit_ended(self) -> None:
        """Every round of the fit landed: free what is still held (a batch taken ahead before an
        early stop; the ledger keeps no end of epoch past its fit)."""
        self.source.release([e.slot for e in self.ledger.entries() if e.slot != END_SLOT])
        self.ledger.clear()

    def park(self, rank: int, error: WorkerError, results: Any) -> None:
        """Report the failure, leave the process group (every peer's collective ends) and say
        which round's state this worker kept."""
        results.put(("error", rank, error))
        if dist.is_initialized():
            dist.destroy_process_group()
        kept = self.worker.kept
        results.put(("parked", rank, None if kept is None else (kept.seq, kept.counters)))

    def regroup(self, command: Regroup, rank: int, join: Callable[[int], None]) -> FitCommand:
        """Join generation `command.generation` (a new worker joined it when it started) and
        return the fit that redoes the source's kept round."""
        if not dist.is_initialized():
            join(command.generation)
        box = [self.worker.kept if rank == command.source else None]
        dist.broadcast_object_list(box, src=command.source)
        kept = box[0]
        assert kept is not None, "the source of a regroup kept a round"
        mine = self.worker.kept
        # A survivor that kept the same round goes back to its RNG from then; one whose last round
        # landed for the others only (the failure cut its collective) has the RNG it would have.
        own = mine.own if mine is not None and mine.seq == kept.seq else None
        return self.worker.redo(kept, command.until_epoch, own)


class Recovery:
    """The main process's account: replacements left, and the batches workers failed on."""

    def __init__(self, max_replacements: int) -> None:
        self.left = max_replacements
        self._failed: dict[tuple[int, int], WorkerError] = {}

    def admit(self, error: WorkerError) -> None:
        """Raise `error` when no replacement is left; raise a poison-batch error when this is the
        second failure on the same batch."""
        if error.batch is not None and error.epoch is not None:
            first = self._failed.setdefault((error.epoch, error.batch), error)
            if first is not error:
                raise WorkerError(
                    error.rank,
                    f"batch {error.batch} of epoch {error.epoch} failed on two workers in turn (first on worker "
                    f"{first.rank}: {first.summary}); it fails wherever it goes: fix or drop that batch. {error.summary}",
                    error.details,
                    error.where,
                )
        if self.left <= 0:
            raise error
        self.left -= 1


def newest(parked: dict[int, tuple[int, Counters] | None], error: WorkerError) -> tuple[int, int, Counters]:
    """(source rank, round, counters) of the latest round a survivor kept: the one every worker redoes."""
    kept = {r: v for r, v in parked.items() if v is not None}
    if not kept:
        raise error  # no survivor had started a round: nothing to go back to
    source = max(kept, key=lambda r: (kept[r][0], -r))
    seq, counters = kept[source]
    return source, seq, counters


def refeed(
    ledgers: Sequence[Ledger],
    seq: int,
    epoch: int,
    sent: dict[int, tuple[int, Any]],
    queues: Sequence[Any],
    free_slots: Any,
) -> list[tuple[Any, Any]]:
    """Empty the queues (the feed is paused, every worker parked or dead) and return what goes
    back into them, in order: the batches taken for round `seq` or later (by batch number), then
    the ends of the epoch taken, then what the queues held. The slots of landed batches go back
    to the feeder, and every ledger is cleared."""
    again: list[list[tuple[int, Any]]] = [[] for _ in queues]
    ends = [0 for _ in queues]
    for rank, ledger in enumerate(ledgers):
        entries, free = split(ledger.entries(), seq, epoch)
        ledger.clear()
        for slot in free:
            free_slots.put(slot)
        q = rank % len(queues)
        for e in entries:
            if e.slot == END_SLOT:
                ends[q] += 1
            else:
                again[q].append(sent[e.slot])
    front: list[tuple[Any, Any]] = []
    for q, items in enumerate(again):
        held = _drain(queues[q])
        front += [(queues[q], item) for item in sorted(items, key=lambda item: item[0])]
        front += [(queues[q], None)] * ends[q]  # None: the feed's end of an epoch
        front += [(queues[q], item) for item in held]
    return front


def _drain(q: Any) -> list[Any]:
    """Every item in `q`. A worker killed while waiting on it held its read lock (a semaphore of
    multiprocessing's Queue, which no one else would release): with every worker parked or dead,
    a lock held is a dead worker's."""
    lock = q._rlock  # multiprocessing.Queue keeps no public handle on it
    lock.acquire(False)  # free: now ours; held: by a dead worker. Released either way.
    lock.release()
    return drain(q, settle=True)  # what the feeder put just before its pause may still be flushing
