"""Supervision of spawned workers from the main process: their messages, their deaths and their
stalls, each made one `WorkerError` that names the worker that caused it. A peer that failed
only because that worker was gone (a collective whose connection closed) adds one line to it."""

from __future__ import annotations

import queue
import signal
import time
from typing import Any

from ..types import Phase, Where, WorkerError

_POLL_S = 0.2  # the supervisor's poll: each wake-up takes a core from a worker for a moment
_ERROR_GRACE_S = 0.5  # after a first error, how long to wait for the one that caused it


class ProgressBoard:
    """Each worker's phase, place and the time it got there, in shared memory: the supervisor's
    stall watchdog reads it without asking the workers anything."""

    FIELDS = 5  # phase, epoch, batch index, local step, monotonic time (system-wide on Linux)

    def __init__(self, ctx: Any, workers: int) -> None:
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

    def __init__(self, processes: list[Any], results: Any, board: ProgressBoard, stall_timeout_s: float) -> None:
        self._processes, self._results, self._board, self._stall_s = processes, results, board, stall_timeout_s

    def next(self, stage: str) -> tuple[str, int, Any] | None:
        """The next message, or None after a short poll."""
        try:
            message = self._results.get(timeout=_POLL_S)
        except queue.Empty:
            self._raise_if_dead(stage)
            self._raise_if_stalled()
            return None
        kind, rank, payload = message
        if kind == "error":
            self._raise_root_cause(payload)
        return kind, rank, payload

    def _raise_if_dead(self, stage: str) -> None:
        for rank, p in enumerate(self._processes):
            if p.exitcode is not None:
                # It may have sent an error just before exiting; that says more than the exit code.
                self._raise_root_cause(self._death(rank, stage))

    def _death(self, rank: int, stage: str) -> WorkerError:
        phase, where, _ = self._board.read(rank)
        exitcode = self._processes[rank].exitcode or 0
        if phase is Phase.TRAINING:
            return WorkerError(rank, _exit_message(exitcode, ""), where=where)
        return WorkerError(rank, _exit_message(exitcode, stage))

    def _raise_if_stalled(self) -> None:
        """The worker that has been longest in one place, if that is longer than the stall
        timeout. Waiting at the averaging is not a stall of its own: it waits for the others."""
        now = time.monotonic()
        stuck = []
        for rank in range(len(self._processes)):
            phase, where, since = self._board.read(rank)
            if phase in (Phase.WAITING, Phase.TRAINING) and now - since > self._stall_s:
                # A worker stuck in its own step is the cause; the others then wait for it.
                stuck.append((phase is not Phase.TRAINING, since, rank, phase, where))
        if not stuck:
            return
        _, since, rank, phase, where = min(stuck)
        limit = f"the stall timeout is {self._stall_s:.0f} s (.stall_timeout(seconds) to change it)"
        if phase is Phase.TRAINING:
            raise WorkerError(rank, f"stalled: no progress for {now - since:.0f} s; {limit}", where=where)
        raise WorkerError(
            rank,
            f"stalled: no progress for {now - since:.0f} s while waiting for a batch in epoch {where.epoch}: "
            f"the training data produced none; {limit}",
        )

    def _raise_root_cause(self, error: WorkerError) -> None:
        """Wait briefly for the error that caused this one (a worker killed by a signal sends
        nothing, and its peers then report broken connections), then raise the root cause, with
        one line for each peer's echo of it."""
        errors = {error.rank: error}
        deadline = time.monotonic() + _ERROR_GRACE_S
        while time.monotonic() < deadline:
            try:
                kind, _, payload = self._results.get(timeout=_POLL_S)
                if kind == "error":
                    errors.setdefault(payload.rank, payload)
            except queue.Empty:
                pass
        killed = [r for r, p in enumerate(self._processes) if p.exitcode is not None and p.exitcode < 0]
        root = next((r for r in killed if r not in errors), None)
        if root is not None:
            errors[root] = self._death(root, "training")
        else:
            root = error.rank
        raise errors[root].with_echoes({r: e.summary for r, e in errors.items()})


def _exit_message(exitcode: int, stage: str) -> str:
    during = f" while {stage}" if stage else ""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the process was killed by {name}{during} (out of memory?)"
    hint = (
        "; its own error is on stderr above. A script that trains must guard its entry point with "
        "`if __name__ == '__main__':`, because each worker imports the main module"
        if stage == "starting"
        else ""
    )
    return f"the process exited with code {exitcode}{during}{hint}"
