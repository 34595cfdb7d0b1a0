"""The queue transport: a feeder thread in the main process puts batches into shared queues, through shared-memory slots.

Shared mode (default): one queue of `prefetch_buffer` batches; whichever worker is free first
takes the next batch, so a slow worker never holds the others up. Batches travel through
shared-memory slots (slots.py). The end of an epoch is one sentinel per worker; a worker that
takes its sentinel stops pulling until the epoch's last averaging, so it can never take a batch
of the next epoch (the feeder puts those after all N sentinels, and the queue is FIFO).

Deterministic mode: batch i goes to worker i mod N through a queue of its own, so the same data
gives the same model on every run.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Protocol, TypeAlias, TypeVar

from ..types import Batch, DataOrder
from .data import Batches, check_epoch_length, data_raised
from .order import EpochOrder
from .protocols import END, EndOfEpoch
from .slots import SlotReader, SlotWriter

T = TypeVar("T")


@dataclass(frozen=True)
class EndMark:
    """What ends a worker's epoch `epoch` in a queue (one per worker); batches travel as (index,
    batch). It names its epoch, so that a replacement can tell which epoch's ends a queue holds
    (replacement/refeed.py)."""

    epoch: int


Packed = tuple[int, str, object]  # a batch in a slot: (slot, segment name, skeleton), as SlotWriter.pack gives it
Item: TypeAlias = "tuple[int, Packed] | EndMark | CallAway"  # what travels in a data queue: (index, packed batch), an end, a call away
Put: TypeAlias = "tuple[Queue[Item], Item]"  # an item and the queue it goes into

END_SLOT = -1  # a ledger's slot for an end of epoch (replacement/ledger.py)
_POLL_S = 0.1  # how often blocked puts and gets look up to check for a stop
_PUT_S = 0.02  # the feeder's longest try at a full queue, holding its lock
_DRAIN_S = 0.05  # how long `drain` waits for one more item


@dataclass(frozen=True)
class Unput:
    """What a paused feeder has put (Feeder.take_back): `sent`, each slot's last batch as (epoch,
    queue, (index, packed)); `ends`, the ends of epochs it has put, by (queue, epoch); `current`,
    the (queue, item) it puts next, after any front it is given."""

    sent: dict[int, tuple[int, int, tuple[int, Packed]]]
    ends: collections.Counter[tuple[int, int]]
    current: tuple[int, Item] | None


class Feeder:
    """A daemon thread that puts epochs `first_epoch` to `until_epoch - 1` of batches into the
    workers' queues, skipping the first `skip` batches of the first (already trained, when
    resuming), drawn in the order kept for a resume (`order`, order.py). Indices keep counting
    from 0, so the deterministic deal is the same as it was."""

    def __init__(
        self,
        data: Batches,
        first_epoch: int,
        until_epoch: int,
        skip: int,
        queues: Sequence[Queue[Item]],
        workers: int,
        slots: SlotWriter,
        order: DataOrder | None = None,
    ) -> None:
        self._make_epoch = EpochOrder(data, first_epoch, order, trains_here=False)
        self._first_epoch, self._until_epoch, self._skip = first_epoch, until_epoch, skip
        self._queues, self._workers, self._slots = list(queues), workers, slots
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="parallelwrapper-feeder", daemon=True)
        # For the replacement of a lost worker (replacement/refeed.py): what the feeder has put, and a
        # pause during which the main process puts a lost round's batches back in front.
        self.sent: dict[int, tuple[int, int, tuple[int, Packed]]] = {}  # slot -> (epoch, queue, (index, packed)) of its last batch
        self.ends: collections.Counter[tuple[int, int]] = collections.Counter()  # (queue, epoch) -> ends put
        self._current: tuple[int, Item] | None = None  # (queue, item): the one being put, after the front
        self._front: collections.deque[Put] = collections.deque()  # (queue, item), before any other
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # resumed, or stopped: a paused or idle feeder goes on at once
        self._paused = False

    def start(self) -> Feeder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=5)

    def pause(self) -> None:
        """Put nothing more into the queues until `resume`; returns once no put is under way."""
        with self._lock:
            self._paused = True

    def take_back(self) -> Unput:
        """While paused: what the feeder has put so far; the front it had yet to put is dropped
        (replacement/refeed.py puts everything again from this: a second loss soon after a replacement
        finds the first one's lost round still partly there)."""
        with self._lock:
            assert self._paused, "take_back while the feeder runs"
            self._front.clear()
            return Unput(dict(self.sent), collections.Counter(self.ends), self._current)

    def resume(self, front: Sequence[Put] = ()) -> None:
        """Carry on, putting `front`'s (queue, item) pairs first, in their order, at once: the
        workers of a replacement's new group wait on them."""
        with self._changed:
            self._front.extend(front)
            self._paused = False
            self._changed.notify_all()

    def _put(self, put: Put | None) -> bool:
        """Put `put`'s item into its queue after every item of the front (None: only the front);
        False when stopped."""
        while not self._stop.is_set():
            if self._put_one(put):
                return True
        return False

    def _put_one(self, put: Put | None) -> bool:
        """One try, unless paused: the front's first item, or (the front empty) `put`'s; True
        when `put`'s went (or, None, when the front is empty)."""
        with self._changed:
            if self._paused:
                self._changed.wait(_POLL_S)
                return False
            front = bool(self._front)
            pair = self._front[0] if front else put
            if pair is None:
                return True
            target, thing = pair
            try:
                # Briefly: a pause (a worker lost) waits for this put, and the whole fleet for the pause.
                target.put(thing, timeout=_PUT_S)
            except queue.Full:
                return False
            if not front:
                self._current = None  # in the queue now: under the lock, so that take_back never sees it in both
                return True
            self._front.popleft()
            return False

    def _run(self) -> None:
        try:
            for epoch in range(self._first_epoch, self._until_epoch):
                count = 0
                skip = self._skip if epoch == self._first_epoch else 0
                try:
                    for index, batch in enumerate(self._make_epoch()):
                        count += 1
                        if index < skip:
                            continue
                        # Waiting for a slot, put what waits in front: a replacement's lost round
                        # may hold every slot there is (replacement/refeed.py).
                        packed = self._slots.pack(batch, lambda: self._put(None))
                        if packed is None:
                            return
                        q = index % len(self._queues)
                        with self._lock:
                            self.sent[packed[0]] = (epoch, q, (index, packed))
                            self._current = (q, (index, packed))
                        if not self._put((self._queues[q], (index, packed))):
                            return
                except Exception as e:
                    raise data_raised(e, epoch, count) from e
                check_epoch_length(count, skip, epoch)
                # One sentinel per worker: in shared mode all N go into the one queue.
                for rank in range(self._workers):
                    q, end = rank % len(self._queues), EndMark(epoch)
                    with self._lock:
                        self.ends[q, epoch] += 1
                        self._current = (q, end)
                    if not self._put((self._queues[q], end)):
                        return
            while self._put(None):  # a replacement may yet put a lost round in front
                with self._changed:
                    self._changed.wait(_POLL_S)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
            self.error = e


def drain(q: Queue[T], settle: bool) -> list[T]:
    """Every item left in `q`, taken until none comes for `_DRAIN_S` (what was put last may still
    be flushing through the queue's pipe). With `settle` false an empty queue is left at once: a
    fit that ended at an epoch's end left nothing, and costs no wait."""
    items: list[T] = []
    wait = _DRAIN_S if settle else 0.0
    while True:
        try:
            items.append(q.get(timeout=wait) if wait else q.get_nowait())
        except queue.Empty:
            return items
        wait = _DRAIN_S


class Aborted(RuntimeError):
    """The main process called the worker away from its wait for a batch: a peer failed."""


class CallAway:
    """Put into a queue by the main process when a peer failed (with the abort event set): a
    worker waiting for a batch takes it and leaves at once, not at its next look at the event."""

    def __reduce__(self) -> tuple[type[CallAway], tuple[()]]:
        return CallAway, ()


class Taking(Protocol):
    """What records a worker's takes (replacement/ledger.py)."""

    def take(self, slot: int) -> None: ...


class QueueSource:
    """A worker's view of its queue. Gives up if the parent process is gone, so that a worker
    never outlives the trainer that spawned it, and when `abort` is set. With a `ledger`
    (replacement/ledger.py) each take is recorded, and its slot kept until its round lands."""

    def __init__(self, q: Queue[Item], slots: SlotReader, abort: Event | None = None, ledger: Taking | None = None) -> None:
        self._queue, self._slots, self._abort, self.ledger = q, slots, abort, ledger

    def epoch_length(self, epoch: int) -> int | None:
        return None  # the feeder's batches come as they come

    def next_batch(self) -> tuple[int, Batch] | EndOfEpoch:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S * 10)
            except queue.Empty:
                if self._abort is not None and self._abort.is_set():
                    raise Aborted("called away from its wait for a batch: another worker failed") from None
                continue
            if isinstance(item, CallAway):
                raise Aborted("called away from its wait for a batch: another worker failed")
            keep = self.ledger is not None
            if self.ledger is not None:
                self.ledger.take(END_SLOT if isinstance(item, EndMark) else item[1][0])
            if isinstance(item, EndMark):
                return END
            index, (slot, name, skeleton) = item
            return index, self._slots.unpack(slot, name, skeleton, keep=keep)

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self._slots.release(slot)
