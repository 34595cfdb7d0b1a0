"""The errors a user can meet from a worker: `WorkerError`, `TrainingError`, `Stopped`, `FleetEnded`, and the `Where` they name.

Apart from the records (types.py) so that every layer can raise them and name where a worker was,
from the bottom of the module map: this imports nothing of the package."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Where:
    """Where a worker was: `batch` is -1 between batches; `shape` describes the batch, when known."""

    epoch: int
    batch: int
    local_step: int
    shape: str = ""

    def __str__(self) -> str:
        if self.batch < 0:
            return f"in epoch {self.epoch} (local step {self.local_step})"
        shape = f" {self.shape}" if self.shape else ""
        return f"while training on batch {self.batch} of epoch {self.epoch}{shape} (local step {self.local_step})"


class TrainingError(RuntimeError):
    """A worker could not train on a batch: the message says why, `where` says where."""

    def __init__(self, message: str, where: Where | None = None) -> None:
        super().__init__(message)
        self.where = where


class Stopped(Exception):
    """Training stopped early, at a round boundary, because a worker's host asked."""


_TRACEBACK = "Traceback (most recent call last):"
_SUMMARY_CHARS = 300  # the first line of an error: the rest is in the traceback below it


class FleetEnded(RuntimeError):
    """A fleet's process came after the fleet had finished: every member of its last group has
    left, so there is nothing to join and nothing left to train (replacement/fleet.py). Its fit
    trained nothing and its model is not the fleet's: a machine's script that may come back late
    ends quietly on it (docs/guides/many-machines.md)."""


class GroupChanges(BaseException):
    """A fleet's group changes at the start of this round, which no member has trained yet (a
    process joins: replacement/fleet.py). Not an Exception, so that no handler of a step's or
    a round's failures takes it for one: it unwinds the fit to its host, which forms the group."""


class WorkerError(RuntimeError):
    """A worker failed, under any host (spawned, in-process, torchrun).

    `rank` names it; `where` says the epoch, batch and local step when known. The message reads
    first things first: who failed where, and what happened (the worker's exception type and
    message), on its first line; one line for each peer that failed because of it (`echoes`);
    then the worker's traceback (`details`), once, so that on a terminal it ends, as any Python
    traceback does, with the worker's own exception."""

    def __init__(
        self, rank: int, summary: str, details: str = "", where: Where | None = None, at: float | None = None, stage: int | None = None, echoes: tuple[str, ...] = ()
    ) -> None:
        place = f" {where}" if where is not None else ""
        who = f"worker {rank}" + ("" if stage is None else f" stage {stage}")  # `stage`: of a pipeline (pipeline/)
        head = "\n".join((f"{who} failed{place}: {summary}", *echoes))
        tail = details.rstrip()
        if tail.startswith(_TRACEBACK):  # told apart from the main process's, which a terminal shows above it
            tail = f"Traceback in {who} (most recent call last):{tail[len(_TRACEBACK) :]}"
        super().__init__(head + (f"\n\n{tail}" if tail.strip() else ""))
        self.rank, self.summary, self.details, self.where, self.stage, self.echoes = rank, summary, details, where, stage, tuple(echoes)
        self.at = time.monotonic() if at is None else at  # when it failed (system-wide clock): the first is the cause

    @property
    def epoch(self) -> int | None:
        """The epoch the worker was in, or None when it failed outside one."""
        return None if self.where is None else self.where.epoch

    @property
    def batch(self) -> int | None:
        """The index in its epoch of the batch the worker was on, or None when it held none."""
        return None if self.where is None or self.where.batch < 0 else self.where.batch

    @property
    def local_step(self) -> int | None:
        """The worker's local step in its round, or None when it failed outside one."""
        return None if self.where is None else self.where.local_step

    def __reduce__(self) -> tuple[type[WorkerError], tuple[object, ...]]:  # travels from a spawned worker as a value
        return (WorkerError, (self.rank, self.summary, self.details, self.where, self.at, self.stage, self.echoes))

    def with_echoes(self, echoes: dict[int, str], stages: int = 1) -> WorkerError:
        """This error, and one short line each, under its first, for the peers that failed because
        of it (a lost connection, mostly: the collective library's source locations are left out).
        `echoes` is by process: rank·stages + stage, with pipelines of `stages` processes."""
        me = self.rank * stages + (self.stage or 0)
        lines = tuple(f"(also {_who(p, stages)}: {_echo(line)})" for p, line in sorted(echoes.items()) if p != me)
        return WorkerError(self.rank, self.summary, self.details, self.where, self.at, self.stage, self.echoes + lines)


def summary(error: BaseException) -> str:
    """One line that says what happened: the exception's type and the first line of its message."""
    text = str(error) if isinstance(error, TrainingError) else f"{type(error).__name__}: {error}"
    line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return line if len(line) <= _SUMMARY_CHARS else line[:_SUMMARY_CHARS] + "..."


def _who(process: int, stages: int) -> str:
    """A process named as its worker, and its stage in a pipeline."""
    return f"worker {process}" if stages == 1 else f"worker {process // stages} stage {process % stages}"


def _echo(line: str, limit: int = 160) -> str:
    """A peer's summary, without gloo's and NCCL's `[file.cc:123]` source locations, cut at `limit`."""
    line = re.sub(r"\[[^\]]*\.(?:cc|cpp|cu|h|hpp):\d+\]\s*", "", line).strip()
    return line if len(line) <= limit else line[:limit] + "..."


__all__ = ["FleetEnded", "GroupChanges", "Stopped", "TrainingError", "Where", "WorkerError", "summary"]
