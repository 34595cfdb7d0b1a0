"""A spawned worker's process: join the group, run the fits the main process sends, report; or wait as a standby.

hosts/spawned.py starts it. It runs the fit commands that come from the main process until told to
close, and reports through the result queue, the board and the shared events. A standby (a process
spawned ahead, for `.on_worker_failure("replace")`) waits with its imports done until told which
rank it takes."""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
from torch.distributed.distributed_c10d import _set_pg_timeout

from ..checkpoint import make_checkpointer
from ..claims import StoreCounter, source_for
from ..config import Config
from ..env import Placement, collective_timeout
from ..feed import Item, QueueSource
from ..job import Job
from ..processes import adopt_environment, main_process_gone
from ..slots import SlotReader
from ..types import BatchSource, CheckpointWriter, EpochEnd, FitCommand, Hooks, Phase, Report, Stopped, WorkerError
from .ledger import Ledger
from .recovery import FORM_S, Keeper, Regroup, assemble
from .runtime import Worker, claim_device, stage_worker, summary
from .supervisor import Message, ProgressBoard

# What the main process puts on a worker's command queue, in this order: to a standby, (the rank
# it takes, its generation); the job's pickle (jobs.shared_pickle); then a fit (FitCommand), a
# replacement's Regroup, or None: close.
Command = tuple[int, int] | torch.Tensor | FitCommand | Regroup | None
T = TypeVar("T")

_REPORT_S = 0.25  # how long rank 0 may hold scores back to send them together


class _SpawnedHooks(Hooks):
    """Progress on the shared board (the supervisor's stall watchdog reads it); a stop when the
    main process sets the shared event (Ctrl-C)."""

    def __init__(self, board: ProgressBoard, rank: int, stop: Event, checkpointer: CheckpointWriter | None) -> None:
        super().__init__(checkpointer)
        self._board, self._rank, self._stop = board, rank, stop
        self.keeper: Keeper | None = None  # with on_worker_failure("replace")

    def progress(self, phase: Phase, epoch: int, index: int, step: int) -> None:
        super().progress(phase, epoch, index, step)
        self._board.write(self._rank, phase, epoch, index, step)

    def stop_requested(self) -> bool:
        return bool(self._stop.is_set())

    def took_ahead(self, tag: int) -> None:
        if self.keeper is not None:
            self.keeper.took_ahead(tag)

    def round_starts(self, tag: int, epoch: int, finished: bool, landed: int) -> None:
        if self.keeper is not None:
            self.keeper.round_starts(tag, epoch, finished, landed)

    @property
    def keeps_averages(self) -> bool:
        return self.keeper is not None

    def at_average(self) -> None:
        if self.keeper is not None:
            self.keeper.worker.hold_average()


@dataclass(frozen=True)
class Channels:
    """What a spawned worker shares with the main process."""

    data: list[Queue[Item]]  # the queues of batches: rank r takes from data[r % len(data)]
    free_slots: Queue[int]
    commands: Queue[Command]
    results: Queue[Message]
    stop: Event  # Ctrl-C: finish the round, checkpoint, stop
    board: ProgressBoard
    abort: Event  # a peer failed: leave the wait for a batch
    ledgers: list[Ledger] | None  # with on_worker_failure("replace"): rank r's is ledgers[r]


def worker_entry(rank: int | None, config: Config, placement: Placement, store_port: int, channels: Channels, generation: int, environ: dict[str, str]) -> None:
    """A spawned worker: join the group, then run fit commands until told to close. A standby
    (rank None) has its imports done and waits to be told the rank it takes and its generation.
    `environ`: the main process's environment when it started this worker, which it takes.

    Once its work is done and what it sent is flushed, the process ends at once (os._exit), as a
    forked child does: the interpreter's own teardown of torch takes a third of a second, at
    every close() of every worker, and nothing of a worker's is left for it to save. So
    `atexit` handlers do not run in a worker."""
    adopt_environment(environ)
    _serve(rank, config, placement, store_port, channels, generation)
    for q in (channels.results, channels.free_slots):  # what this worker put in them reaches the pipe
        q.close()
        q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(rank: int | None, config: Config, placement: Placement, store_port: int, c: Channels, generation: int) -> None:
    world = placement.world_size
    # Ctrl-C in a terminal reaches every process of the group: the main process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if rank is None:
        called = _get(c.commands)
        if called is None:
            return
        rank, generation = cast("tuple[int, int]", called)  # a standby's first command
    try:
        claim_device(placement, rank, config.deterministic)
        store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=collective_timeout(config))

        def join(generation: int) -> None:  # a replacement starts a new group under a new prefix
            prefixed = PrefixStore(f"generation-{generation}", store)
            timeout = collective_timeout(config)
            if generation == 0:
                dist.init_process_group(placement.backend, store=prefixed, rank=rank, world_size=placement.processes, timeout=timeout)
                return
            # A regroup: every member has come (or the main process gave the generation up), so the
            # rendezvous that follows waits on live processes only, and for FORM_S at most (a member
            # lost in it), after which the collectives get their own timeout again.
            assemble(prefixed, placement.processes, generation)
            dist.init_process_group(placement.backend, store=prefixed, rank=rank, world_size=placement.processes, timeout=min(timeout, datetime.timedelta(seconds=FORM_S)))
            _set_pg_timeout(timeout)

        if generation == 0:
            join(0)  # the first members; a replacement joins at the Regroup that follows its start
        job = _unpickle_job(cast(torch.Tensor, _get(c.commands)))  # the second
        hooks = _SpawnedHooks(c.board, rank, c.stop, make_checkpointer(config, job, world))
        worker, relay = (Worker(job, config, placement, rank, rank, hooks=hooks, own_model=True), _as_is) if config.pipeline is None else stage_worker(job, config, placement, rank, rank, hooks, True)
        del job  # a stage's process holds its own layers only
        me = worker.rank  # the worker this process is (one of its stages, with a pipeline)
        ledger = None if c.ledgers is None else c.ledgers[rank]
        source = QueueSource(c.data[me % len(c.data)], SlotReader(c.free_slots), c.abort, ledger)
        keeper = hooks.keeper = None if ledger is None else Keeper(worker, source, ledger)
        report = _Reports(c.results, rank) if rank == 0 else _ignore if keeper is None else _EpochEnds(c.results, rank)
        c.results.put(("ready", rank, (os.getpid(), None)))  # (pid, nothing), as a park's
        while True:
            command = cast("FitCommand | Regroup | None", _get(c.commands))  # and every one after
            if command is None:
                break
            stopped = False
            try:
                if isinstance(command, Regroup):
                    assert keeper is not None
                    command = keeper.regroup(command, rank, join)
                counters = command.counters
                counter = None if command.claims is None else StoreCounter(store, command.claims)
                fed = relay(source if command.shards is None else source_for(command.shards, me, world, counters, command.until_epoch, counter))
                until_epoch = worker.start(command)
                if keeper is not None:
                    keeper.started()
                command = None  # loaded: its shared memory goes back now, not at the fit's end
                worker.train(until_epoch, fed, report)
            except Stopped:
                stopped = True
            except WorkerError as e:
                if keeper is None:
                    raise
                # Parked, it trains on no batch: a death from now on is not one on its last batch
                # (which would count that batch as failed: Recovery.admit).
                c.board.write(rank, Phase.IDLE, -1, -1, 0)
                keeper.park(rank, e, c.results)
                continue
            finally:
                if isinstance(report, _Reports):  # the last reports, before the word that the fit ended
                    report.flush()
            if keeper is not None:
                keeper.fit_ended()
            # Worker 0's state (each of its stages') moves into shared memory and goes as it is:
            # it is trained on again only after the next fit's is loaded.
            done = None if stopped or me != 0 else worker.replica.shipped_state()
            c.results.put(("stopped" if stopped else "done", rank, done))
            done = None  # the queue holds it until it is sent; the main process owns it then
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the main process
        stage = rank % placement.stages if placement.stages > 1 else None
        error = e if isinstance(e, WorkerError) else WorkerError(rank // placement.stages, summary(e) + " (while starting)", traceback.format_exc(), stage=stage)
        c.results.put(("error", rank, error))
        # Flush before the process group goes down: the peers' "connection closed" errors must
        # reach the main process after this worker's own.
        c.results.close()
        c.results.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _as_is(source: BatchSource) -> BatchSource:
    return source


def _unpickle_job(payload: torch.Tensor) -> Job:
    """The job, from the pickle the main process wrote into shared memory once for every worker
    (spawned.py); its model is this process's own. The shared pages go when `payload` does."""
    job: Job = pickle.loads(payload.numpy().data)
    return job


def _ignore(report: Report) -> None:
    """Only rank 0 reports: every worker holds the same totals."""


class _EpochEnds:
    """A replaceable worker other than rank 0 sends its epochs' ends too (the main process passes
    on the first of each): rank 0 lost after an epoch's last round landed, before its report left,
    would take the epoch's end with it, and the epoch is not redone."""

    def __init__(self, results: Queue[Message], rank: int) -> None:
        self._results, self._rank = results, rank

    def __call__(self, report: Report) -> None:
        if isinstance(report, EpochEnd):
            reports: list[Report] = [report]
            self._results.put(("reports", self._rank, reports))


class _Reports:
    """Rank 0's reports, sent in batches at most every `_REPORT_S`: every message wakes the
    main process, which then takes a core from a worker for a moment (and with few cores, a
    worker held up holds every worker up at the next averaging). An epoch's end goes at once."""

    def __init__(self, results: Queue[Message], rank: int) -> None:
        self._results, self._rank = results, rank
        self._pending: list[Report] = []
        self._last = time.monotonic()

    def __call__(self, report: Report) -> None:
        self._pending.append(report)
        if isinstance(report, EpochEnd) or time.monotonic() - self._last > _REPORT_S:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._results.put(("reports", self._rank, self._pending))
            self._pending = []
        self._last = time.monotonic()


def _get(q: Queue[T]) -> T | None:
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if main_process_gone():
                return None
