"""Spawned workers: N local processes that live as long as the wrapper, fed from one shared queue,
and supervised, so that an error, a death or a stall becomes a `WorkerError` naming the worker.

Process discipline (after Lightning Fabric and torchft): a `spawn` context, never a global start
method; a module-level worker entry; a timeout on every wait; worker errors sent back as values
and re-raised with the rank; shutdown by a close message, join with a timeout, then kill.
Workers are daemons, and each gives up when its parent is gone, so none outlives the trainer.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from ..checkpoint import make_checkpointer
from ..config import Config, Job
from ..env import Placement, collective_timeout, resolve
from ..feed import Batches, Feeder, QueueSource
from ..rounds import RoundBudget
from ..slots import SlotReader, SlotWriter
from ..types import EpochReport, FitCommand, Hooks, Phase, ReplacementReport, Report, Reporter, Stopped, TrainingState, WorkerError
from .ledger import Ledger
from .recovery import Keeper, Recovery, Regroup, newest, refeed
from .runtime import Worker, claim_device, summary
from .supervisor import ProgressBoard, Supervisor

_START_TIMEOUT_S = 180.0  # importing torch in a fresh process on a loaded 2-core machine is slow
_JOIN_TIMEOUT_S = 10.0
_REPORT_S = 0.25  # how long rank 0 may hold scores back to send them together
_STOP_GRACE_S = 15.0  # after Ctrl-C, how long workers get to finish the round and checkpoint
_DRAIN_S = 0.05  # a queue left with batches may still be flushing: wait this long for one more


# -- in the worker process -----------------------------------------------------------------------


class _SpawnedHooks(Hooks):
    """Progress on the shared board (the supervisor's stall watchdog reads it); a stop when the
    main process sets the shared event (Ctrl-C)."""

    def __init__(self, board: ProgressBoard, rank: int, stop: Any, checkpointer: Any) -> None:
        super().__init__(checkpointer)
        self._board, self._rank, self._stop = board, rank, stop
        self.keeper: Keeper | None = None  # with on_worker_failure("replace")

    def progress(self, phase: Phase, epoch: int, index: int, step: int) -> None:
        super().progress(phase, epoch, index, step)
        self._board.write(self._rank, phase, epoch, index, step)

    def stop_requested(self) -> bool:
        return bool(self._stop.is_set())

    def taking(self, tag: int) -> None:
        if self.keeper is not None:
            self.keeper.taking(tag)

    def round_starts(self, tag: int, epoch: int, finished: bool) -> None:
        if self.keeper is not None:
            self.keeper.round_starts(tag, epoch, finished)


@dataclass(frozen=True)
class _Channels:
    """What a spawned worker shares with the main process."""

    data: Any  # its queue of batches
    free_slots: Any
    commands: Any
    results: Any
    stop: Any  # Ctrl-C: finish the round, checkpoint, stop
    board: ProgressBoard
    budget: RoundBudget | None
    abort: Any  # a peer failed: leave the wait for a batch
    ledger: Ledger | None  # with on_worker_failure("replace")


def _worker_entry(rank: int, config: Config, placement: Placement, store_port: int, channels: _Channels, parent_pid: int, generation: int) -> None:
    """A spawned worker: join the group, then run fit commands until told to close."""
    c = channels
    world = placement.world_size
    # Ctrl-C in a terminal reaches every process of the group: the main process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        claim_device(placement, rank)
        store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=collective_timeout(config))

        def join(generation: int) -> None:  # a replacement starts a new group under a new prefix
            prefixed = PrefixStore(f"generation-{generation}", store)
            dist.init_process_group(placement.backend, store=prefixed, rank=rank, world_size=world, timeout=collective_timeout(config))

        join(generation)
        job: Job = pickle.loads(_get(c.commands, parent_pid))
        hooks = _SpawnedHooks(c.board, rank, c.stop, make_checkpointer(config, job, world))
        worker = Worker(job, config, placement, rank, rank, hooks=hooks, budget=c.budget)
        source = QueueSource(c.data, SlotReader(c.free_slots), parent_pid, c.abort, c.ledger)
        keeper = hooks.keeper = None if c.ledger is None else Keeper(worker, source, c.ledger)
        report = _Reports(c.results, rank) if rank == 0 else _ignore
        c.results.put(("ready", rank, None))
        while True:
            command: FitCommand | Regroup | None = _get(c.commands, parent_pid)
            if command is None:
                break
            stopped = False
            try:
                if isinstance(command, Regroup):
                    assert keeper is not None
                    command = keeper.regroup(command, rank, join)
                worker.fit(command, source, report)
            except Stopped:
                stopped = True
            except WorkerError as e:
                if keeper is None:
                    raise
                keeper.park(rank, e, c.results)
                continue
            finally:
                if isinstance(report, _Reports):  # the last reports, before the word that the fit ended
                    report.flush()
            if keeper is not None:
                keeper.fit_ended()
            done = None if stopped or rank != 0 else worker.replica.state_dicts()
            c.results.put(("stopped" if stopped else "done", rank, done))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the main process
        error = e if isinstance(e, WorkerError) else WorkerError(rank, summary(e) + " (while starting)", traceback.format_exc())
        c.results.put(("error", rank, error))
        # Flush before the process group goes down: the peers' "connection closed" errors must
        # reach the main process after this worker's own.
        c.results.close()
        c.results.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ignore(report: Report) -> None:
    """Only rank 0 reports: every worker holds the same totals."""


class _Reports:
    """Rank 0's reports, sent in batches at most every `_REPORT_S`: every message wakes the
    main process, which then takes a core from a worker for a moment (and with few cores, a
    worker held up holds every worker up at the next averaging). An epoch's end goes at once."""

    def __init__(self, results: Any, rank: int) -> None:
        self._results, self._rank = results, rank
        self._pending: list[Report] = []
        self._last = time.monotonic()

    def __call__(self, report: Report) -> None:
        self._pending.append(report)
        if isinstance(report, EpochReport) or time.monotonic() - self._last > _REPORT_S:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._results.put(("reports", self._rank, self._pending))
            self._pending = []
        self._last = time.monotonic()


def _get(q: Any, parent_pid: int) -> Any:
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None


# -- in the main process -------------------------------------------------------------------------


class WorkerPool:
    """N spawned workers, their queues and their supervision."""

    def __init__(self, config: Config, job: Job, placement: Placement | None = None) -> None:
        self.config = config
        self._placement = placement = placement or resolve(config)
        n = placement.world_size
        ctx = self._ctx = mp.get_context("spawn")
        # Plain pickle copies tensors by value. Handed to Process() as objects, they would go
        # through torch's reducers instead, which move the user's model into shared memory that
        # every worker then trains in place, all at once. And the job goes through the command
        # queue, not Process(): a spawn writes its arguments into a pipe, and a large write
        # blocks for ever when the child dies while starting (a script without a main guard).
        self._job_bytes = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        # The main process serves the rendezvous store: port 0 lets the OS choose a free port,
        # so pools running side by side (tests, several trainers) never collide.
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=collective_timeout(config))
        if config.deterministic:
            per_worker = max(1, config.prefetch_buffer // n)
            self.data_queues = [ctx.Queue(maxsize=per_worker) for _ in range(n)]
        else:
            self.data_queues = [ctx.Queue(maxsize=config.prefetch_buffer)]
        replaces = config.on_worker_failure == "replace"
        # A replaceable worker keeps a round's slots until it lands (ledger.py): each may hold a
        # round's batches, the one taken ahead and an end of epoch, beyond the prefetched ones.
        held = config.averaging_frequency + 2
        self._free_slots = ctx.Queue()
        self.slots = SlotWriter(self._free_slots, config.prefetch_buffer + (n * held if replaces else 0))
        self._ledgers = [Ledger(ctx, held + 1) for _ in range(n)] if replaces else None
        self._recovery = Recovery(config.max_replacements) if replaces else None
        self._generation = 0
        self._commands = [ctx.Queue() for _ in range(n)]
        self._results = ctx.Queue()
        self._stop = ctx.Event()
        self._abort = ctx.Event()
        self._board = ProgressBoard(ctx, n)
        # First-come rounds of N·k batches in all only where a worker does not wait for the others
        # at each round's end anyway, and batches are not dealt by number.
        first_come = config.overlap_averaging and not config.deterministic
        self._budget = RoundBudget(ctx, n * config.averaging_frequency) if first_come else None
        self._processes: list[Any] = [None] * n
        self._supervisor = Supervisor(self._processes, self._results, self._board, config.stall_timeout_s)
        try:
            for rank in range(n):
                self._spawn(rank)
            self._supervisor.gather("ready", set(range(n)), _START_TIMEOUT_S, lambda message: None, "starting")
        except BaseException:
            self.kill()
            raise

    def _spawn(self, rank: int) -> None:
        """Start the worker of `rank` (anew, after a failure: with a command queue of its own)."""
        self._commands[rank] = self._ctx.Queue()
        channels = _Channels(
            self.data_queues[rank % len(self.data_queues)], self._free_slots, self._commands[rank], self._results,
            self._stop, self._board, self._budget, self._abort, None if self._ledgers is None else self._ledgers[rank],
        )  # fmt: skip
        process = self._ctx.Process(
            target=_worker_entry,
            args=(rank, self.config, self._placement, self._store.port, channels, os.getpid(), self._generation),
            name=f"parallelwrapper-worker-{rank}",
            daemon=True,
        )
        self._commands[rank].put(self._job_bytes)
        self._processes[rank] = process
        process.start()

    def fit(self, command: FitCommand, data: Batches, on_report: Reporter) -> TrainingState:
        """Run one fit on all workers, fed from `data`; return rank 0's final state (model, optimizer, schedule).

        Ctrl-C: with checkpoints on, the workers finish the round and save it (for up to
        `_STOP_GRACE_S`), then KeyboardInterrupt propagates; without, it propagates at once.
        With on_worker_failure("replace"), a worker's failure replaces it (recovery.py).
        """
        self._stop.clear()
        if self._budget is not None:
            self._budget.clear()
        c = command.counters
        feeder = Feeder(data, c.epoch, command.until_epoch, c.position, self.data_queues, len(self._processes), self.slots)
        for q in self._commands:
            q.put(command)
        feeder.start()
        done: set[int] = set()
        final: TrainingState | None = None
        try:
            while len(done) < len(self._processes):
                if feeder.error is not None:
                    raise feeder.error
                try:
                    message = self._receive("training", on_report)
                except KeyboardInterrupt:
                    if self.config.checkpoint_dir is None:
                        raise
                    self._stop_gracefully(on_report)
                    raise
                except WorkerError as error:
                    if self._recovery is None or done:
                        raise
                    self._replace(error, feeder, command.until_epoch, on_report)
                    continue
                if message is not None and message[0] == "done":
                    done.add(message[1])
                    final = message[2] if message[1] == 0 else final
        finally:
            feeder.stop()
        self._drain()
        assert final is not None
        return final

    def _replace(self, error: WorkerError, feeder: Feeder, until_epoch: int, on_report: Reporter) -> None:
        """Replace the worker that failed first, and have every worker redo the round (recovery.py)."""
        assert self._recovery is not None and self._ledgers is not None
        self._recovery.admit(error)
        lost = error.rank
        self._abort.set()
        feeder.pause()
        if self._processes[lost].is_alive():
            self._processes[lost].kill()
        self._processes[lost].join(timeout=_JOIN_TIMEOUT_S)
        others = set(range(len(self._processes))) - {lost}
        recovering = f"recovering from worker {lost}'s failure"
        parked = self._supervisor.gather("parked", others, self.config.stall_timeout_s, lambda m: self._pass_on(m, on_report), recovering, echoes=True)
        source, seq, counters = newest(parked, error)
        front = refeed(self._ledgers, seq, counters.epoch, feeder.sent, self.data_queues, self._free_slots)
        self._generation += 1
        self._board.write(lost, Phase.IDLE, counters.epoch, -1, 0)
        self._spawn(lost)
        self._abort.clear()
        for q in self._commands:
            q.put(Regroup(self._generation, source, until_epoch))
        feeder.resume(front)
        self._supervisor.gather("ready", {lost}, _START_TIMEOUT_S, lambda m: self._pass_on(m, on_report), "starting")
        on_report(ReplacementReport(counters, lost, error, counters.rounds + 1))

    def _drain(self) -> None:
        """Batches fed but not taken (early stopping ends a fit mid-epoch): the next fit() must
        not find them, and their slots go back to the feeder."""
        for q in self.data_queues:
            wait = 0.0  # a fit that ended at an epoch's end left nothing: it costs no wait
            while True:
                try:
                    item = q.get(timeout=wait) if wait else q.get_nowait()
                except queue.Empty:
                    break
                wait = _DRAIN_S
                if item is not None:
                    self._free_slots.put(item[1][0])

    def _stop_gracefully(self, on_report: Reporter) -> None:
        """Ask the workers to stop after this round (they checkpoint it), and wait a little."""
        self._stop.set()
        stopped: set[int] = set()
        deadline = time.monotonic() + _STOP_GRACE_S
        while len(stopped) < len(self._processes) and time.monotonic() < deadline:
            message = self._receive("stopping", on_report)
            if message is not None and message[0] in ("stopped", "done"):
                stopped.add(message[1])

    def _receive(self, stage: str, on_report: Reporter) -> tuple[str, int, Any] | None:
        """The next message that is not a batch of reports; those go to `on_report` on the way."""
        message = self._supervisor.next(stage)
        return None if message is None else self._pass_on(message, on_report)

    @staticmethod
    def _pass_on(message: tuple[str, int, Any], on_report: Reporter) -> tuple[str, int, Any] | None:
        """A batch of reports goes to `on_report` (None); any other message comes back."""
        if message[0] != "reports":
            return message
        for report in message[2]:
            on_report(report)
        return None

    def close(self) -> None:
        """Tell every worker to stop, join them, and kill the ones that do not stop."""
        for q in self._commands:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for p in self._processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        started = [p for p in self._processes if p is not None and p.pid is not None]  # start() may have failed
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=_JOIN_TIMEOUT_S)
        for q in [*self.data_queues, self._free_slots, *self._commands, self._results]:
            q.cancel_join_thread()
            q.close()
        self.slots.close()
