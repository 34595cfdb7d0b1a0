"""What goes back into the queues for a lost round's redo: what the feeder put from its first batch on, in the feeder's order.

The main process puts it back in front of every queue (the feeder paused, every worker parked or
dead), whoever took it: from the feeder's record of what it put (feed/queue.Unput), not from what the
workers took or the queues held. The workers' ledgers (ledger.py) say which slots hold batches
that landed in the average: those go back to the feeder.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from multiprocessing.synchronize import BoundedSemaphore, Lock
from typing import Protocol, cast

from ..feed.queue import EndMark, Item, Put, Unput
from ..types import Counters
from .ledger import Ledger, split

_SETTLE_S = 0.01  # a queue emptied by refeed: nothing more has come for this long (the workers are parked: the queue's thread is not kept waiting)


def refeed(ledgers: Sequence[Ledger], seq: int, counters: Counters, unput: Unput, queues: Sequence[Queue[Item]], free_slots: Queue[int]) -> list[Put]:
    """Empty the queues (the feed is paused, every worker parked or dead) and return what goes
    back into them for a redo of round `seq`, which starts at batch `counters.position` of epoch
    `counters.epoch`: everything the feeder put from that batch on, from what it put (`unput`),
    not from what the workers took or the queues held. Queue by queue, epoch by epoch, the
    batches (by batch number), then the epoch's ends, which is the order the feeder put them in.
    - A worker killed between its take and its ledger's record of it took a batch no ledger names.
    - One killed in the middle of a take may have left a message's bytes in the pipe without its
      length, after which the queue no longer reads (`_discard`).
    - A previous refeed's batches that the feeder had still to put are among them, in their place.
    The feeder's next item (`unput.current`) it puts itself, after these. The ledgers say which
    slots hold landed batches: those go back to the feeder, and every ledger is cleared."""
    for ledger in ledgers:
        _, free = split(ledger.entries(), seq, counters.epoch)
        ledger.clear()
        for slot in free:
            free_slots.put(slot)
    for each in queues:
        _discard(each)
    first = (counters.epoch, counters.position)
    front: list[Put] = []
    for q, queue_ in enumerate(queues):
        current = unput.current[1] if unput.current is not None and unput.current[0] == q else None
        put_next = current[1][0] if isinstance(current, tuple) else None  # its slot
        batches = sorted(
            (epoch, item[0], item)
            for slot, (epoch, target, item) in unput.sent.items()
            if target == q and (epoch, item[0]) >= first and slot != put_next
        )  # fmt: skip
        # No worker can have taken an end of a later epoch: none has landed this epoch's last round.
        epochs = sorted({epoch for epoch, _, _ in batches} | {epoch for target, epoch in unput.ends if target == q and epoch >= counters.epoch})
        for epoch in epochs:
            front += [(queue_, item) for e, _, item in batches if e == epoch]
            front += [(queue_, EndMark(epoch))] * (unput.ends[q, epoch] - (current == EndMark(epoch)))
    return front


class _QueueInsides(Protocol):
    """What `_discard` uses of a multiprocessing Queue's private parts (CPython's queues.py)."""

    _rlock: Lock
    _buffer: collections.deque[object]
    _reader: Connection[object, object]
    _sem: BoundedSemaphore


def _discard(queue_: Queue[Item]) -> None:
    """Empty `q` (a multiprocessing Queue) without reading its items: a worker killed in the middle
    of a get may have read a message's length and not its bytes (a SIGSTOP, then the kill: the
    next get raised EOFError), so its bytes are read off the pipe as they are, until none has come
    for a while (what the feeder put just before its pause may still be flushing), and its count
    of items goes back to none. Its read lock, held by a worker killed while it waited, is
    released: with every worker parked or dead, a lock held is a dead worker's. (multiprocessing
    keeps no public handle on the lock, the pipe or the count.)"""
    q = cast(_QueueInsides, queue_)
    lock = q._rlock
    lock.acquire(False)  # free: now ours; held: by a dead worker. Released either way.
    lock.release()
    while q._buffer:  # the queue's own thread has yet to write these into the pipe
        time.sleep(0.001)
    reader, quiet = q._reader, time.monotonic()
    while time.monotonic() - quiet < _SETTLE_S:
        if reader.poll(_SETTLE_S / 5):
            os.read(reader.fileno(), 1 << 16)
            quiet = time.monotonic()
    while True:  # every item put took one from the count; a get gives it back
        try:
            q._sem.release()
        except ValueError:  # back to the queue's size: empty
            return


__all__ = ["refeed"]
