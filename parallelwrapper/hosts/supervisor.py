"""The main process's watch over spawned workers: their errors, deaths and stalls, each made one `WorkerError`.

Each `WorkerError` names the worker that caused it. A peer that failed only because that worker was
gone (a collective whose connection closed) adds one line to it."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import TypeVar, cast

from ..errors import Where, WorkerError
from ..hooks import Phase
from ..messages import Message
from ..processes import exit_message, stopped

P = TypeVar("P")  # a gathered message's payload

_POLL_S = 0.2  # the supervisor's poll: each wake-up takes a core from a worker for a moment
_LOOK_S = 0.1  # the most between two looks for a worker dead, stopped or stalled
STOPPED_S = 0.15  # a worker stopped by a signal this long is lost: the whole fleet waits on it, and it cannot answer
_SEEN_GAP_S = 1.0  # two sightings of a stopped worker further apart start the count again (the main process was stopped too)
_ERROR_GRACE_S = 2.0  # after a first error, the most to wait for the one that caused it (a killed worker's exit is seen late on a loaded machine)


class ProgressBoard:
    """Each worker's phase, place and the time it got there, in shared memory: the supervisor's
    stall watchdog reads it without asking the workers anything."""

    FIELDS = 5  # phase, epoch, batch index, local step, monotonic time (system-wide on Linux)

    def __init__(self, ctx: BaseContext, workers: int) -> None:
        self.array = ctx.Array("d", workers * self.FIELDS, lock=False)

    def write(self, rank: int, phase: Phase, epoch: int, index: int, step: int) -> None:
        o = rank * self.FIELDS
        self.array[o : o + self.FIELDS] = [float(phase), epoch, index, step, time.monotonic()]

    def read(self, rank: int) -> tuple[Phase, Where, float]:
        o = rank * self.FIELDS
        phase, epoch, index, step, since = self.array[o : o + self.FIELDS]
        return Phase(int(phase)), Where(int(epoch), int(index), int(step)), since


class Supervisor:
    """Reads the workers' result queue; raises a WorkerError for an error, a death or a stall."""

    def __init__(
        self, processes: list[BaseProcess], results: Queue[Message], board: ProgressBoard, stall_timeout: float, stages: int = 1, on_failure: Callable[[], None] | None = None
    ) -> None:
        """`stages`: each worker is a pipeline of that many processes, process p being stage
        p % stages of worker p // stages (pipeline/); messages and the board are by process.
        `on_failure`: called when a failure is first seen, before the wait for its echoes (a
        replacement calls every worker away from its wait for a batch, so that each speaks soon)."""
        self._processes, self._results, self._board, self._stall_s = processes, results, board, stall_timeout
        self._on_failure = on_failure
        self._stages = stages
        self._held: list[Message] = []  # read while waiting for errors, not yet returned
        self._stopped: dict[int, tuple[float, float]] = {}  # process -> when it was first and last seen stopped by a signal
        self._looked = 0.0  # when `next` last looked for a worker dead, stopped or stalled
        # Processes put down during a replacement and not replaced yet: dead, and already handled.
        self.gone: set[int] = set()

    def next(self, stage: str) -> Message | None:
        """The next message, or None after a short poll. Every `_LOOK_S` at most, messages or
        none, it looks for a worker dead, stopped or stalled (rank 0's reports come more often
        than the poll's end)."""
        try:
            message: Message | None = self._take()
        except queue.Empty:
            message = None
        if message is not None and message[0] == "error":
            # From None, here and below: what the main process was handling is not its context.
            raise self._root_cause(message[2]) from None
        now = time.monotonic()
        if message is None or now - self._looked >= _LOOK_S:
            self._looked = now
            if message is not None:
                self._held.insert(0, message)  # read again after a loss is handled, not lost with it
            self._raise_if_dead(stage)
            self._raise_if_stopped(range(len(self._processes)))
            self._raise_if_stalled()
            if message is not None:
                self._held.pop(0)
        return message

    def _take(self) -> Message:
        """A message held back while waiting for errors, else the next one (queue.Empty after a poll)."""
        return self._held.pop(0) if self._held else self._results.get(timeout=_POLL_S)

    def _raise_if_dead(self, stage: str) -> None:
        for rank, p in enumerate(self._processes):
            if p.exitcode is not None and rank not in self.gone:
                # It may have sent an error just before exiting; that says more than the exit code.
                raise self._root_cause(self._death(rank, stage)) from None

    def _death(self, rank: int, stage: str) -> WorkerError:
        phase, where, _ = self._board.read(rank)
        exitcode = self._processes[rank].exitcode or 0
        if phase is Phase.TRAINING:
            return self._error(rank, exit_message(exitcode, ""), where)
        return self._error(rank, exit_message(exitcode, stage))

    def _error(self, process: int, summary: str, where: Where | None = None) -> WorkerError:
        """A WorkerError naming process `process`'s worker, and its stage in a pipeline."""
        stage = None if self._stages == 1 else process % self._stages
        return WorkerError(process // self._stages, summary, where=where, stage=stage)

    def _process(self, error: WorkerError) -> int:
        return error.rank * self._stages + (error.stage or 0)

    def _raise_if_stopped(self, processes: Iterable[int]) -> None:
        """A worker process stopped by a signal (SIGSTOP) for STOPPED_S: lost, as if killed, so
        that a replacement takes its rank (it is killed then: a late SIGCONT finds nothing). The
        whole fleet waits on it meanwhile, so the wait is short. Sightings further apart than
        _SEEN_GAP_S count from the later: the main process, stopped with the whole job (Ctrl-Z),
        may look again before its workers have their SIGCONT."""
        now = time.monotonic()
        for rank in processes:
            pid = self._processes[rank].pid
            if pid is None or rank in self.gone or not stopped(pid):
                self._stopped.pop(rank, None)
                continue
            since, last = self._stopped.get(rank, (now, now))
            since = now if now - last > _SEEN_GAP_S else since
            self._stopped[rank] = (since, now)
            if now - since >= STOPPED_S:
                del self._stopped[rank]
                phase, where, _ = self._board.read(rank)
                raise self._error(
                    rank,
                    f"the process was stopped by a signal (SIGSTOP) for {now - since:.1f} s, while its peers waited on it: "
                    f"taken as lost (send SIGCONT within {STOPPED_S:g} s, or use .on_worker_failure('replace') to go on without it)",
                    where if phase is Phase.TRAINING else None,
                ) from None

    def _raise_if_stalled(self) -> None:
        """The worker that has been longest in one place, if that is longer than the stall
        timeout. Waiting at the averaging is not a stall of its own: it waits for the others."""
        now = time.monotonic()
        stuck = []
        for rank in range(len(self._processes)):
            phase, where, since = self._board.read(rank)
            if rank not in self.gone and phase in (Phase.WAITING, Phase.TRAINING) and now - since > self._stall_s:
                # A worker stuck in its own step is the cause; the others then wait for it.
                stuck.append((phase is not Phase.TRAINING, since, rank, phase, where))
        if not stuck:
            return
        _, since, rank, phase, where = min(stuck)
        limit = f"the stall timeout is {self._stall_s:.0f} s (.stall_timeout(seconds) to change it)"
        if phase is Phase.TRAINING:
            raise self._error(rank, f"stalled: no progress for {now - since:.0f} s; {limit}", where)
        raise self._error(
            rank,
            f"stalled: no progress for {now - since:.0f} s while waiting for a batch in epoch {where.epoch}: "
            f"the training data produced none; {limit}",
        )

    def _root_cause(self, error: WorkerError) -> WorkerError:
        """Wait briefly for the error that caused this one (a worker killed by a signal sends
        nothing, and its peers then report broken connections), then the root cause, with one line
        for each peer's echo of it, for the caller to raise (from None: the main process's own
        exceptions say nothing about the worker's)."""
        if self._on_failure is not None:
            self._on_failure()
        errors = {self._process(error): error}
        deadline = time.monotonic() + _ERROR_GRACE_S
        while time.monotonic() < deadline:
            heard = errors.keys() | {r for r, p in enumerate(self._processes) if p.exitcode is not None}
            if len(heard) == len(self._processes):
                break  # every worker has spoken or is gone: nothing more can come
            try:
                message = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if message[0] == "error":
                errors.setdefault(self._process(message[2]), message[2])
            else:
                self._held.append(message)
        killed = [r for r, p in enumerate(self._processes) if p.exitcode is not None and p.exitcode < 0 and r not in self.gone]
        root = next(iter(killed), None)  # a worker killed by a signal said nothing: its peers' errors are its echoes
        if root is not None:
            errors.setdefault(root, self._death(root, "training"))
        else:  # the first to fail; the others failed because it was gone
            root = self._process(min(errors.values(), key=lambda e: e.at))
        return errors[root].with_echoes({r: e.summary for r, e in errors.items()}, self._stages)

    def gather(
        self, kind: str, ranks: set[int], timeout_s: float, on_other: Callable[[Message], None], stage: str, echoes: bool = False, pid: bool = False,
        got: dict[int, P] | None = None,
    ) -> dict[int, P]:
        """The payloads of a `kind` message from each of `ranks`, within `timeout_s`, while `stage`;
        other messages go to `on_other`. An error raises, unless `echoes` (peers' echoes of a
        failure being handled: dropped); so do a death or a silence among `ranks`, naming the worker.
        With `pid`, a payload is (sender's pid, payload), and one from an earlier process of the
        rank (put down since, its message read late) goes to `on_other`. `got`: the payloads had
        already, which the gather adds to as they come, so that they outlive a raise."""
        got = {} if got is None else got
        deadline = time.monotonic() + timeout_s
        while not ranks <= got.keys():
            try:
                message = self._take()
            except queue.Empty:
                for rank in ranks - got.keys():
                    if self._processes[rank].exitcode is not None:
                        raise self._root_cause(self._death(rank, stage)) from None
                self._raise_if_stopped(ranks - got.keys())
                if time.monotonic() > deadline:
                    missing = sorted(ranks - got.keys())
                    raise self._error(missing[0], f"did not answer within {timeout_s:.0f} s while {stage}") from None  # the silence is the error, not the empty queue
                continue
            if message[0] == kind and message[1] in ranks and (not pid or _sender(message) == self._processes[message[1]].pid):
                got[message[1]] = cast(P, cast("tuple[int, object]", message[2])[1] if pid else message[2])  # `kind`'s payload
            elif message[0] == "error" and not echoes:
                raise self._root_cause(message[2]) from None
            elif message[0] != "error":
                on_other(message)
        return got


def _sender(message: Message) -> int:
    """The pid in a payload that carries one ("ready", "parked": Supervisor.gather's `pid`)."""
    return cast("tuple[int, object]", message[2])[0]
