"""Requests to spawned inference workers (BATCHED and SEQUENTIAL): a bounded queue, a batching thread, an answering thread.

The queue is in the caller's process; one thread sends each idle worker its next batch, and another
hears the workers and answers the futures.

Batching (BATCHED): while every worker is busy, requests wait in the queue. When a worker is
free, it takes the oldest request and those after it of the same dtype and sample shape, up to
`batch_limit` samples (a larger request goes alone); if that is fewer than `batch_limit`, it
waits for more until the oldest has waited `max_wait_ms`. SEQUENTIAL takes one request at a
time. Requests of other shapes wait for the next batch, so a wrong shape fails only its own.

Faults: a model that raises fails the requests of that forward pass, all of the same shape; a
worker that dies fails the requests it held, and is started again (pool.py) while the others
serve the queue; `close` fails what waits and, after a grace, what is still running. Nothing
is dropped in silence, and no caller waits for ever: `submit` blocks only while the queue is
full (`queue_limit`), until a worker takes a batch or the ParallelInference closes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from ..env import Placement
from ..shared_state import shared_copies
from .config import InferenceConfig, InferenceMode
from .pool import HeldBatch, InferenceWorker, Pool
from .process import Reply
from .requests import InferenceError, Request, answer, model_failed

_RECEIVE_POLL_S = 0.2
_JOIN_MARGIN_S = 2 * _RECEIVE_POLL_S  # past close()'s deadline, for the receiving thread to see it


class Dispatcher:
    """The request queue and the two threads over a Pool of workers."""

    def __init__(self, model: torch.nn.Module, config: InferenceConfig, placement: Placement) -> None:
        self._limit = 1 if config.inference_mode is InferenceMode.SEQUENTIAL else config.batch_limit
        self._one_each = config.inference_mode is InferenceMode.SEQUENTIAL
        self._wait_s = config.max_wait_ms / 1000.0
        self._queue_limit = config.queue_limit
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the batching thread waits here
        self._room = threading.Condition(self._lock)  # callers wait here while the queue is full
        self._queue: deque[Request] = deque()
        self._closing = False
        self._seq = 0  # batches sent so far
        self._deadline = float("inf")  # once closing: when the batches in flight are given up
        self.pool = Pool(model, placement)
        try:
            self.pool.await_ready()
        except BaseException:
            self.pool.close()
            raise
        self._threads = [
            threading.Thread(target=self._guarded, args=(self._batching,), name="parallelwrapper-inference-batching", daemon=True),
            threading.Thread(target=self._guarded, args=(self._receiving,), name="parallelwrapper-inference-receiving", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def put(self, request: Request) -> None:
        """Queue `request`, blocking while the queue is full."""
        with self._lock:
            while len(self._queue) >= self._queue_limit and not self._closing:
                self._room.wait()
            if self._closing:
                request.future.set_exception(_closed("submitted"))
                return
            self._queue.append(request)
            self._work.notify()

    def update(self, state: dict[str, torch.Tensor]) -> None:
        """Batches sent from now on run on `state`; each worker loads it before its next batch."""
        shared = shared_copies(state)
        with self._lock:
            self.pool.state, self.pool.version = shared, self.pool.version + 1

    def _guarded(self, loop: Callable[[], None]) -> None:
        """Run one of the two threads' loops; should it fail, no caller may wait for ever: every
        request queued or held fails, saying why, and no more are taken."""
        try:
            loop()
        except Exception as e:  # noqa: BLE001 - the error goes to every caller instead
            error = InferenceError(f"the ParallelInference stopped serving ({type(e).__name__}: {e}); close it and build a new one")
            with self._lock:
                self._closing = True
                self._fail_queue(error)
                self._fail_held(lambda w: error)
                self._work.notify_all()

    # -- the batching thread ---------------------------------------------------------------------

    def _batching(self) -> None:
        while self._next():
            pass

    def _next(self) -> bool:
        """Give the next batch to the next idle worker; False once closing."""
        with self._lock:
            while True:
                if self._closing:
                    return False
                w = min((w for w in self.pool.workers if w.idle), key=lambda w: len(w.flights), default=None)
                if self._queue and all(w.lost for w in self.pool.workers):
                    self._fail_queue(InferenceError(f"no inference worker is left: {self.pool.workers[0].lost}; build a new ParallelInference"))
                elif w is not None and self._queue:
                    batch, full = self._take()
                    # Wait for more only while another worker is busy: with every worker idle, a
                    # lone caller would wait max_wait_ms for nobody.
                    busy = any(other.flights for other in self.pool.workers)
                    wait = self._queue[0].at + self._wait_s - time.monotonic()
                    if full or self._one_each or not busy or wait <= 0:
                        if self._start(w, batch):
                            return True
                        continue  # every one of them was cancelled
                    self._work.wait(wait)
                    continue
                self._work.wait()

    def _take(self) -> tuple[list[Request], bool]:
        """The oldest request and those after it of its key, up to the batch limit; and whether that is full."""
        first = self._queue[0]
        batch, rows = [first], first.rows
        if rows < self._limit and not self._one_each:
            for r in list(self._queue)[1:]:
                if r.key == first.key and rows + r.rows <= self._limit:
                    batch.append(r)
                    rows += r.rows
                    if rows == self._limit:
                        break
        return batch, rows >= self._limit

    def _start(self, w: InferenceWorker, batch: list[Request]) -> bool:
        """Take `batch` out of the queue and send it to `w` (the requests cancelled meanwhile go),
        with the state it must load first where it does not hold the latest; False when every
        request was cancelled. Under the lock, from either thread: what a worker is sent, and in
        which order, is decided and sent at once, so no batch of requests submitted after an
        update_model() can reach a worker ahead of the new state."""
        taken = {id(r) for r in batch}
        self._queue = deque(r for r in self._queue if id(r) not in taken)
        self._room.notify_all()
        # A request queued again after its worker died is running already.
        running = [r for r in batch if r.future.running() or r.future.set_running_or_notify_cancel()]
        if not running:
            return False
        self._seq += 1
        flight = w.take(running, self._seq)
        load = self.pool.state if w.version != self.pool.version else None
        w.version = self.pool.version
        self.pool.send(w, w.conn, flight, load)
        return True

    def _fail_held(self, error: Callable[[InferenceWorker], BaseException]) -> None:
        """Fail the requests each worker holds with `error(worker)`."""
        for w in self.pool.workers:
            for r in w.requests:
                r.future.set_exception(error(w))
            w.flights = []

    def _fail_queue(self, error: BaseException) -> None:
        while self._queue:
            request = self._queue.popleft()
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(error)
        self._room.notify_all()

    # -- the receiving thread --------------------------------------------------------------------

    def _receiving(self) -> None:
        """Until closing, and then until no batch is in flight or the grace is over."""
        while True:
            for w, message in self.pool.receive(_RECEIVE_POLL_S):
                self._heard(w, message)
            with self._lock:
                if self._closing and (not any(w.flights for w in self.pool.workers) or time.monotonic() > self._deadline):
                    return

    def _heard(self, w: InferenceWorker, message: Reply | None) -> None:
        if message is None:
            self._died(w)
            return
        if message[0] == "ready":
            with self._lock:
                w.ready = True
                self._work.notify()
            return
        if message[0] == "failed":
            with self._lock:
                w.lost = message[2]
                self._work.notify()
            return
        flight = w.flight(message[1])
        if flight is None:
            return  # given up already (close)
        if message[0] == "grow":
            with self._lock:  # one writer at a time on a worker's pipe
                self.pool.grow(w, flight, message[2])
            return
        if message[0] == "error":
            self._release(w, flight)
            for r in flight.requests:
                r.future.set_exception(model_failed(r, str(w), message[2]))
            return
        # The outputs are copied out before the slot takes the next batch.
        outputs = self.pool.outputs(w, flight, *message[2]).clone()
        self._release(w, flight)
        answer(flight.requests, outputs, str(w))

    def _release(self, w: InferenceWorker, flight: HeldBatch) -> None:
        """`w` is done with `flight`: the requests that waited while it was busy go to it at once,
        from this thread (a wake-up of the batching thread would cost the time of a thread
        switch); with none waiting, the batching thread is told."""
        with self._lock:
            w.flights.remove(flight)
            if self._queue and not self._closing and self._start(w, self._take()[0]):
                return
            self._work.notify()

    def _died(self, w: InferenceWorker) -> None:
        """Fail the batch `w` was running, queue again the ones it held but had not begun (it runs
        them in order), and start it again (unless it never started, or we are closing)."""
        with self._lock:
            requests = w.flights[0].requests if w.flights else []
            self._queue.extendleft(reversed([r for f in w.flights[1:] for r in f.requests]))
            w.flights = []
            why = self.pool.died(w, "running a batch" if requests else "waiting for a batch")
            restart = w.lost is None and not self._closing
            if restart:
                self.pool.start(w)
            self._work.notify()
        shapes = sorted({r.shape() for r in requests})
        for r in requests:
            r.future.set_exception(
                InferenceError(
                    f"{why}, with {len(requests)} requests of shape {', '.join(shapes)} in its forward pass; they got no "
                    f"answer: submit them again ({'it is being started again' if restart else 'it is not started again'})"
                )
            )

    # -- close ------------------------------------------------------------------------------------

    def close(self, timeout: float) -> None:
        """Fail the queued requests, let those in flight finish (for up to `timeout` seconds), stop
        the threads and the workers; then fail whatever is left, and free the shared memory."""
        with self._lock:
            if self._closing:
                return
            self._closing, self._deadline = True, time.monotonic() + timeout
            self._fail_queue(_closed("waiting for a worker"))
            self._work.notify_all()
        for t in self._threads:  # the receiving thread ends once no worker holds a batch, or at the deadline
            t.join(timeout=timeout + _JOIN_MARGIN_S)
        self.pool.close()
        with self._lock:
            self._fail_held(lambda w: _closed(f"held by {w}"))

    @property
    def pids(self) -> list[int | None]:
        return [w.process.pid if w.process is not None else None for w in self.pool.workers]


def _closed(state: str) -> InferenceError:
    return InferenceError(f"the ParallelInference was closed with this request {state}: it got no answer; submit it to an open one")


__all__ = ["Dispatcher"]
