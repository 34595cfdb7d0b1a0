"""A spawned worker's process: join the group, run the fits the main process sends, report; or wait as a standby.

hosts/spawned.py starts it. It runs the fit commands that come from the main process until told to
close, and reports through the result queue, the board and the shared events. A standby (a process
spawned ahead, for a replacement's fresh process) waits with its imports done until told which
rank it takes. With `.on_worker_failure("replace")` the worker has a part that outlives a loss
(replacement/), which this process asks through `Failover` and `Survivor` only."""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from .. import feed
from ..config import Config
from ..env import Placement, claim_device, collective_timeout
from ..errors import Stopped, WorkerError, summary
from ..feature import Feature
from ..feed.claims import StoreCounter
from ..feed.queue import Item, QueueSource, Taking
from ..feed.slots import SlotReader
from ..hooks import Hooks, Phase, RoundObserver
from ..job import Job
from ..messages import FitCommand, Message
from ..processes import adopt_environment, end_with_main_process
from ..types import EpochEnd, Report
from .runtime import Worker
from .supervisor import ProgressBoard

# What the main process puts on a worker's command queue, in this order: to a standby, the rank it
# takes; the job's pickle (jobs.shared_pickle); then a fit (FitCommand), a command that the
# worker's Survivor makes a fit of (a replacement's regroup), or None: close.
Command = int | torch.Tensor | FitCommand | object | None

# How this process joins a process group: over this store, with this collective timeout.
Join = Callable[[Store, datetime.timedelta], None]

_REPORT_S = 0.25  # how long rank 0 may hold scores back to send them together


class _SpawnedHooks(Hooks):
    """Progress on the shared board (the supervisor's stall watchdog reads it); a stop when the
    main process sets the shared event (Ctrl-C)."""

    def __init__(self, board: ProgressBoard, rank: int, stop: Event) -> None:
        super().__init__()
        self._board, self._rank, self._stop = board, rank, stop

    def progress(self, phase: Phase, epoch: int, index: int, step: int) -> None:
        super().progress(phase, epoch, index, step)
        self._board.write(self._rank, phase, epoch, index, step)

    def stop_requested(self) -> bool:
        return bool(self._stop.is_set())


class Survivor(RoundObserver, Protocol):
    """A worker's part that outlives a loss (a replacement's keeper: replacement/): the round loop
    tells it where each round starts (RoundObserver), and this process asks it the rest."""

    def fit_of(self, command: object) -> FitCommand:
        """The fit that a fit or a command of the part's own stands for."""
        ...

    def started(self) -> None:
        """The fit has loaded its state."""

    def lost(self, error: WorkerError) -> None:
        """This worker failed, and waits for the main process's word (it is idle meanwhile)."""

    def fit_ended(self) -> None:
        """Every round of the fit landed."""

    def report(self, report: Report) -> None:
        """What a worker other than rank 0 does with its reports."""


class Failover(Protocol):
    """What the main process gives every worker's process for a worker's loss (Channels.failover):
    what records this worker's takes from its queue, and its Survivor."""

    def taking(self, rank: int) -> Taking: ...

    def survivor(self, rank: int, worker: Worker, source: QueueSource, results: Queue[Message], store: Store, into: Join) -> Survivor: ...


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
    failover: Failover | None  # with on_worker_failure("replace") (replacement/)


def worker_entry(
    rank: int | None, config: Config, placement: Placement, feature: Feature, store_port: int, channels: Channels, joins: bool, environ: dict[str, str]
) -> None:
    """A spawned worker: join the group (unless not `joins`: a replacement's fresh process joins
    the group its regroup forms), then run fit commands until told to close. A standby (rank None)
    has its imports done and waits to be told the rank it takes.
    `environ`: the main process's environment when it started this worker, which it takes;
    `feature`: the config's (features.of), which says what the worker's process trains.

    Once its work is done and what it sent is flushed, the process ends at once (os._exit), as a
    forked child does: the interpreter's own teardown of torch takes a third of a second, at
    every close() of every worker, and nothing of a worker's is left for it to save. So
    `atexit` handlers do not run in a worker."""
    adopt_environment(environ)
    end_with_main_process()
    _serve(rank, config, placement, feature, store_port, channels, joins)
    for q in (channels.results, channels.free_slots):  # what this worker put in them reaches the pipe
        q.close()
        q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(rank: int | None, config: Config, placement: Placement, feature: Feature, store_port: int, c: Channels, joins: bool) -> None:
    world = placement.world_size
    # Ctrl-C in a terminal reaches every process of the group: the main process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if rank is None:
        called = c.commands.get()
        if called is None:
            return
        rank = cast(int, called)  # a standby's first command
    try:
        claim_device(placement, rank, config.deterministic)
        store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=collective_timeout(config))

        def join(store: Store, timeout: datetime.timedelta) -> None:
            dist.init_process_group(placement.backend, store=store, rank=rank, world_size=placement.processes, timeout=timeout)

        if joins:  # the first group, under a prefix of its own: a replacement's regroups form later generations
            join(PrefixStore("generation-0", store), collective_timeout(config))
        hooks = _SpawnedHooks(c.board, rank, c.stop)
        # The job is the second command; the worker keeps what it trains of it (a stage's process, its own layers only).
        worker = Worker(_unpickle_job(cast(torch.Tensor, c.commands.get())), config, placement, rank, rank, hooks=hooks, feature=feature, own_model=True)
        me = worker.rank  # the worker this process is (one of its stages, with a pipeline)
        failover = c.failover
        source = QueueSource(c.data[me % len(c.data)], SlotReader(c.free_slots), c.abort, None if failover is None else failover.taking(rank))
        survivor = hooks.observer = None if failover is None else failover.survivor(rank, worker, source, c.results, store, join)
        report = _Reports(c.results, rank) if rank == 0 else _ignore if survivor is None else survivor.report
        c.results.put(("ready", rank, (os.getpid(), None)))  # (pid, nothing), as a park's
        while True:
            command = c.commands.get()  # and every one after
            if command is None:
                break
            stopped = False
            try:
                fit = cast(FitCommand, command) if survivor is None else survivor.fit_of(command)
                command = None
                counters = fit.counters
                counter = None if fit.claims is None else StoreCounter(store, fit.claims)
                fed = feed.source(source if fit.shards is None else fit.shards, me, world, counters, fit.until_epoch, counter)
                until_epoch = worker.start(fit)
                if survivor is not None:
                    survivor.started()
                del fit  # loaded: its shared memory goes back now, not at the fit's end
                worker.train(until_epoch, fed, report)
            except Stopped:
                stopped = True
            except WorkerError as e:
                if survivor is None:
                    raise
                # Idle, it trains on no batch: a death from now on is not one on its last batch
                # (which would count that batch as failed: replacement's Account.admit).
                c.board.write(rank, Phase.IDLE, -1, -1, 0)
                survivor.lost(e)
                continue
            finally:
                if isinstance(report, _Reports):  # the last reports, before the word that the fit ended
                    report.flush()
            if survivor is not None:
                survivor.fit_ended()
            # Worker 0's state (each of its stages') moves into shared memory and goes as it is:
            # it is trained on again only after the next fit's is loaded.
            done = None if stopped or me != 0 else worker.replica.shipped_state()
            c.results.put(("stopped" if stopped else "done", rank, done))
            done = None  # the queue holds it until it is sent; the main process owns it then
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the main process
        stage = rank % placement.per_worker if placement.per_worker > 1 else None
        error = e if isinstance(e, WorkerError) else WorkerError(rank // placement.per_worker, summary(e) + " (while starting)", traceback.format_exc(), stage=stage)
        c.results.put(("error", rank, error))
        # Flush before the process group goes down: the peers' "connection closed" errors must
        # reach the main process after this worker's own.
        c.results.close()
        c.results.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _unpickle_job(payload: torch.Tensor) -> Job:
    """The job, from the pickle the main process wrote into shared memory once for every worker
    (spawned.py); its model is this process's own. The shared pages go when `payload` does."""
    job: Job = pickle.loads(payload.numpy().data)
    return job


def _ignore(report: Report) -> None:
    """Only rank 0 reports: every worker holds the same totals."""


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
