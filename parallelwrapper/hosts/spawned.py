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
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ..checkpoint import make_checkpointer
from ..config import Config, Job
from ..env import Placement, collective_timeout, resolve
from ..feed import Batches, Feeder, QueueSource
from ..rounds import RoundBudget
from ..slots import SlotReader, SlotWriter
from ..types import EpochReport, FitCommand, Hooks, Phase, Report, Reporter, Stopped, TrainingState, WorkerError
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

    def progress(self, phase: Phase, epoch: int, index: int, step: int) -> None:
        super().progress(phase, epoch, index, step)
        self._board.write(self._rank, phase, epoch, index, step)

    def stop_requested(self) -> bool:
        return bool(self._stop.is_set())


def _worker_entry(
    rank: int,
    config: Config,
    placement: Placement,
    store_port: int,
    channels: tuple[Any, Any, Any, Any, Any, ProgressBoard, RoundBudget | None],
    parent_pid: int,
) -> None:
    """A spawned worker: join the group, then run fit commands until told to close."""
    data_queue, free_slots, command_queue, result_queue, stop, board, budget = channels
    world = placement.world_size
    # Ctrl-C in a terminal reaches every process of the group: the main process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        claim_device(placement, rank)
        store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=collective_timeout(config))
        dist.init_process_group(placement.backend, store=store, rank=rank, world_size=world, timeout=collective_timeout(config))
        job: Job = pickle.loads(_get(command_queue, parent_pid))
        hooks = _SpawnedHooks(board, rank, stop, make_checkpointer(config, job, world))
        worker = Worker(job, config, placement, rank, rank, hooks=hooks, budget=budget)
        source = QueueSource(data_queue, SlotReader(free_slots), parent_pid)
        report = _Reports(result_queue, rank) if rank == 0 else _ignore
        result_queue.put(("ready", rank, None))
        while True:
            command: FitCommand | None = _get(command_queue, parent_pid)
            if command is None:
                break
            stopped = False
            try:
                worker.fit(command, source, report)
            except Stopped:
                stopped = True
            finally:
                if isinstance(report, _Reports):  # the last reports, before the word that the fit ended
                    report.flush()
            done = None if stopped or rank != 0 else worker.replica.state_dicts()
            result_queue.put(("stopped" if stopped else "done", rank, done))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the main process
        error = e if isinstance(e, WorkerError) else WorkerError(rank, summary(e) + " (while starting)", traceback.format_exc())
        result_queue.put(("error", rank, error))
        # Flush before the process group goes down: the peers' "connection closed" errors must
        # reach the main process after this worker's own.
        result_queue.close()
        result_queue.join_thread()
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
        placement = placement or resolve(config)
        n = placement.world_size
        ctx = mp.get_context("spawn")
        # Plain pickle copies tensors by value. Handed to Process() as objects, they would go
        # through torch's reducers instead, which move the user's model into shared memory that
        # every worker then trains in place, all at once. And the job goes through the command
        # queue, not Process(): a spawn writes its arguments into a pipe, and a large write
        # blocks for ever when the child dies while starting (a script without a main guard).
        job_bytes = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        # The main process serves the rendezvous store: port 0 lets the OS choose a free port,
        # so pools running side by side (tests, several trainers) never collide.
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=collective_timeout(config))
        if config.deterministic:
            per_worker = max(1, config.prefetch_buffer // n)
            self.data_queues = [ctx.Queue(maxsize=per_worker) for _ in range(n)]
        else:
            self.data_queues = [ctx.Queue(maxsize=config.prefetch_buffer)]
        self._free_slots = ctx.Queue()
        self.slots = SlotWriter(self._free_slots, config.prefetch_buffer)
        self._commands = [ctx.Queue() for _ in range(n)]
        self._results = ctx.Queue()
        self._stop = ctx.Event()
        board = ProgressBoard(ctx, n)
        # First-come rounds of N·k batches in all only where a worker does not wait for the others
        # at each round's end anyway, and batches are not dealt by number.
        first_come = config.overlap_averaging and not config.deterministic
        self._budget = RoundBudget(ctx, n * config.averaging_frequency) if first_come else None
        self._processes = [
            ctx.Process(
                target=_worker_entry,
                args=(
                    rank,
                    config,
                    placement,
                    self._store.port,
                    (
                        self.data_queues[rank % len(self.data_queues)],
                        self._free_slots,
                        self._commands[rank],
                        self._results,
                        self._stop,
                        board,
                        self._budget,
                    ),
                    os.getpid(),
                ),
                name=f"parallelwrapper-worker-{rank}",
                daemon=True,
            )
            for rank in range(n)
        ]
        self._supervisor = Supervisor(self._processes, self._results, board, config.stall_timeout_s)
        try:
            for p, q in zip(self._processes, self._commands):
                q.put(job_bytes)
                p.start()
            ready: set[int] = set()
            deadline = time.monotonic() + _START_TIMEOUT_S
            while len(ready) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not start within {_START_TIMEOUT_S:.0f} s")
                message = self._supervisor.next("starting")
                if message is not None:
                    ready.add(message[1])
        except BaseException:
            self.kill()
            raise

    def fit(self, command: FitCommand, data: Batches, on_report: Reporter) -> TrainingState:
        """Run one fit on all workers, fed from `data`; return rank 0's final state (model, optimizer, schedule).

        Ctrl-C: with checkpoints on, the workers finish the round and save it (for up to
        `_STOP_GRACE_S`), then KeyboardInterrupt propagates; without, it propagates at once.
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
                if message is not None and message[0] == "done":
                    done.add(message[1])
                    final = message[2] if message[1] == 0 else final
        finally:
            feeder.stop()
        self._drain()
        assert final is not None
        return final

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
        if message is None or message[0] != "reports":
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
        started = [p for p in self._processes if p.pid is not None]  # start() may have failed
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=_JOIN_TIMEOUT_S)
        for q in [*self.data_queues, self._free_slots, *self._commands, self._results]:
            q.cancel_join_thread()
            q.close()
        self.slots.close()
