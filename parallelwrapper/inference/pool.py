"""The main process's side of the inference workers: one spawned process per device, and its shared-memory segments.

process.py is the other side. Each worker has a pipe for a few small messages and two shared-memory
segments that this process owns (slots.Segments): one its batches' inputs are written into, one the
worker writes their outputs into. A tensor never travels as a pickle: the pipe carries the segments'
names, dtypes and shapes.

A worker holds up to DEPTH batches: while it runs one, the next is written into its other pair
of segments and waits in its pipe, so it never waits for this process between two batches.

The process discipline is the training's (hosts/spawned.py): a `forkserver` context, a module-level
entry, daemons that give up when their parent is gone, a timeout on every wait, close by message,
join with a timeout, then kill. A worker that dies is started again under the same rank (its
segments are this process's and stay); one that fails while starting is not: it is `lost`.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch

from ..env import Placement
from ..feed.slots import Segments
from ..processes import START_TIMEOUT_S, exit_message, worker_context
from .process import Batch, Model, Order, Reply, serve, view
from .requests import Request

DEPTH = 2  # batches a worker holds at once: the one it runs and the next
_JOIN_TIMEOUT_S = 10.0


@dataclass(eq=False)
class HeldBatch:
    """A batch given to a worker: its requests, the pair of segments it uses, and where it lies once written."""

    requests: list[Request]
    seq: int
    slot: int
    sent: Batch | None = None


class InferenceWorker:
    """One worker as the main process sees it: its process and pipe, the batches it holds, and the
    model version it holds."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.process: BaseProcess | None = None
        self.conn: Connection[Model | Order, Reply] | None = None
        self.ready = False  # built (and not started again since)
        self.flights: list[HeldBatch] = []  # the batches it holds, oldest first
        self.version = 0  # the update_model version it holds or has been sent
        self.lost: str | None = None  # why it could not start: it is not started again

    @property
    def idle(self) -> bool:
        """It can take another batch."""
        return self.ready and len(self.flights) < DEPTH

    @property
    def requests(self) -> list[Request]:
        return [r for f in self.flights for r in f.requests]

    def flight(self, seq: int) -> HeldBatch | None:
        return next((f for f in self.flights if f.seq == seq), None)

    def take(self, requests: list[Request], seq: int) -> HeldBatch:
        """A new batch for this worker, in the pair of segments its other batch does not use."""
        used = {f.slot for f in self.flights}
        flight = HeldBatch(requests, seq, next(s for s in range(DEPTH) if s not in used))
        self.flights.append(flight)
        return flight

    def __str__(self) -> str:
        return f"inference worker {self.rank}"


class Pool:
    """The worker processes, their segments and the state they serve."""

    def __init__(self, model: torch.nn.Module, placement: Placement) -> None:
        self._placement = placement
        self._ctx = worker_context()  # as training's: a worker (re)starts without importing torch
        # The model goes as its pickle's bytes in shared memory, kept to start a worker again.
        data = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)  # build() checked that it pickles
        self._payload: torch.Tensor = torch.empty(len(data), dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        self._payload.numpy().data[:] = data
        self.state: dict[str, torch.Tensor] | None = None  # update_model's last state, in shared memory
        self.version = 0
        # Worker r's inputs of slot s at 2 (DEPTH r + s), their outputs right after.
        self._segments = Segments(2 * DEPTH * len(placement.devices))
        self.workers = [InferenceWorker(rank) for rank in range(len(placement.devices))]
        try:
            for w in self.workers:
                self.start(w)
        except BaseException:
            self.close()
            raise

    @property
    def segment_names(self) -> list[str]:
        """The shared-memory segments this pool holds now (gone after `close`)."""
        return self._segments.names

    def start(self, w: InferenceWorker) -> None:
        """Start `w`'s process; it answers ("ready", None, None) once its replica is built."""
        ours, theirs = self._ctx.Pipe()
        w.process = self._ctx.Process(
            target=serve, args=(w.rank, self._placement, theirs, dict(os.environ)), name=f"parallelwrapper-inference-{w.rank}", daemon=True
        )
        w.process.start()
        theirs.close()
        w.conn, w.ready, w.flights, w.version = ours, False, [], self.version
        ours.send(("model", self._payload, self.state))

    def await_ready(self) -> None:
        """Wait until every worker is built; a ValueError naming the first that could not be."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(w.ready or w.lost for w in self.workers):
            if time.monotonic() > deadline:
                slow = next(w for w in self.workers if not (w.ready or w.lost))
                raise ValueError(f"{slow} did not start within {START_TIMEOUT_S:.0f} s; is the machine overloaded?")
            for w, message in self.receive(1.0):
                if message is None:
                    self.died(w, "starting")
                elif message[0] == "ready":
                    w.ready = True
                elif message[0] == "failed":
                    w.lost = message[2]
        lost = next((w for w in self.workers if w.lost), None)
        if lost is not None:
            raise ValueError(f"{lost} could not start: {lost.lost}")

    def died(self, w: InferenceWorker, stage: str) -> str:
        """`w`'s process has ended: what to tell the requests it held. One that never got ready is lost."""
        process = w.process
        assert process is not None, "a worker that died was started"
        process.join(timeout=_JOIN_TIMEOUT_S)
        why = exit_message(process.exitcode or 0, stage)
        if not w.ready:
            w.lost = w.lost or why
        w.ready = False
        return f"{w} died: {why}"

    def receive(self, timeout: float) -> list[tuple[InferenceWorker, Reply | None]]:
        """The messages that came within `timeout`, each with its worker; (worker, None) for a
        worker whose process has ended. A worker's messages come before its death."""
        live = [(w, w.process, w.conn) for w in self.workers if w.process is not None and w.conn is not None]
        pipes, sentinels = [conn for _, _, conn in live], [p.sentinel for _, p, _ in live]
        handles: dict[object, InferenceWorker] = {conn: w for w, _, conn in live} | {p.sentinel: w for w, p, _ in live}
        got: list[tuple[InferenceWorker, Reply | None]] = []
        dead: list[InferenceWorker] = []
        heard = wait([*pipes, *sentinels], timeout)  # every key of `handles`, in its order
        for ready in heard:
            w = handles[ready]
            if ready is w.conn:
                try:
                    got.append((w, w.conn.recv()))
                except (EOFError, OSError):
                    dead.append(w)
            elif w not in dead:
                dead.append(w)
        for w in dict.fromkeys(dead):
            got.append((w, None))
            if w.conn is not None:  # (it is: `live`)
                w.conn.close()
            w.conn = None
        return got

    def send(self, w: InferenceWorker, conn: Connection[Model | Order, Reply] | None, flight: HeldBatch, load: dict[str, torch.Tensor] | None) -> None:
        """Write the flight's inputs into its segment, one batch, and have `w` run it, on its pipe
        `conn` (a worker started again has another); first `load` that state, if any."""
        requests = flight.requests
        dtype, sample = requests[0].key
        shape = (sum(r.rows for r in requests), *sample)
        index = 2 * (DEPTH * w.rank + flight.slot)
        segment = self._segments.get(index, torch.Size(shape).numel() * dtype.itemsize)
        place = view(segment, dtype, shape)
        if len(requests) > 1:
            torch.cat([r.x.cpu() for r in requests], out=place)
        else:
            place.copy_(requests[0].x)
        del place  # no view of a segment may outlive its replacement by a larger one
        out = self._segments.get(index + 1, segment.size)  # the outputs' size is the model's: a guess, grown on demand
        flight.sent = Batch(flight.seq, flight.slot, segment.name, dtype, shape, out.name, out.size)
        if load is not None:
            self._post(conn, ("load", load))
        self._post(conn, ("run", flight.sent))

    def grow(self, w: InferenceWorker, flight: HeldBatch, nbytes: int) -> None:
        """The flight's outputs need `nbytes`: a larger output segment, and the same batch run again."""
        assert flight.sent is not None
        out = self._segments.get(2 * (DEPTH * w.rank + flight.slot) + 1, nbytes)
        flight.sent = dataclasses.replace(flight.sent, outputs=out.name, capacity=out.size)
        self._post(w.conn, ("run", flight.sent))

    def outputs(self, w: InferenceWorker, flight: HeldBatch, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the outputs `w` wrote for `flight`: let it go before its slot takes another batch."""
        return view(self._segments.get(2 * (DEPTH * w.rank + flight.slot) + 1, 0), dtype, shape)

    @staticmethod
    def _post(conn: Connection[Model | Order, Reply] | None, message: Model | Order) -> None:
        if conn is None:
            return  # found dead already
        try:
            conn.send(message)
        except OSError:
            pass  # its worker died, or was found dead: `receive` reports it, with what it held

    def close(self) -> None:
        """Tell every worker to stop, join them, kill the ones that do not stop (one still running
        a batch at once: close() gave it its time); free the segments."""
        for w in self.workers:
            if w.flights and w.process is not None and w.process.pid is not None:
                w.process.kill()
            if w.conn is not None:
                self._post(w.conn, None)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        started = [w.process for w in self.workers if w.process is not None and w.process.pid is not None]
        for p in started:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(timeout=_JOIN_TIMEOUT_S)
        for w in self.workers:
            if w.conn is not None:
                w.conn.close()
                w.conn = None
            w.ready = False
        self._segments.close()


__all__ = ["DEPTH", "HeldBatch", "Pool", "InferenceWorker"]
