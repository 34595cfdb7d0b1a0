"""Spawned workers: N local processes that live as long as the wrapper, fed from the main process and supervised.

They are fed from one shared queue, and an error, a death or a stall becomes a `WorkerError` naming
the worker.

Process discipline (after Lightning Fabric and torchft): a `forkserver` context (processes.py), never a global
start method; a module-level worker entry; a timeout on every wait; worker errors sent back as values
and re-raised with the rank; shutdown by a close message, join with a timeout, then kill.
Workers are daemons, and each gives up when its parent is gone, so none outlives the trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Protocol, cast

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.utils.data import DataLoader

from ..config import Config
from ..env import Placement, collective_timeout, resolve
from ..errors import WorkerError
from ..feature import Feature, Plain
from ..feed.claims import claimed
from ..feed.data import Batches
from ..feed.epochs import shardable, shards_of
from ..feed.order import EpochOrder
from ..feed.queue import Feeder, Item, drain
from ..feed.slots import SlotWriter
from ..job import Job
from ..messages import FitCommand, Message
from ..processes import START_TIMEOUT_S, worker_context
from ..types import Report, Reporter, TrainingState
from .jobs import shared_pickle as _shared_pickle
from .process import Channels, Command, Failover, worker_entry
from .supervisor import ProgressBoard, Supervisor

_JOIN_TIMEOUT_S = 10.0
_STOP_GRACE_S = 15.0  # after Ctrl-C, how long workers get to finish the round and checkpoint


class _Closes(Protocol):
    """A multiprocessing queue, of any items, as `kill` closes it."""

    def cancel_join_thread(self) -> None: ...

    def close(self) -> None: ...


class Replacing(Protocol):
    """A feature's side in the main process that replaces a lost worker (replacement/): the pool
    asks it this, and names none of its classes."""

    @property
    def slots(self) -> int:
        """The slots its workers hold beyond the prefetched ones."""
        ...

    @property
    def worker_side(self) -> Failover:
        """What each worker's process is given."""
        ...

    def started(self) -> None: ...

    def fit_starts(self, start: float) -> None: ...

    def passes(self, rank: int, report: Report) -> bool: ...

    def call_away(self) -> None: ...

    def replace(
        self, error: WorkerError, feeder: Feeder, until_epoch: int, supervisor: Supervisor, pass_on: Callable[[Message], object], on_report: Reporter
    ) -> None: ...


# How the pool makes its Replacing (what replacement.replacer gives, which the wrapper hands down):
# of the config, the placement and the pool itself, which it sees as replacement/replacer.py's Pool.
ReplacingFactory = Callable[[Config, Placement, "WorkerPool"], Replacing]


class WorkerPool:
    """N spawned workers, their queues and their supervision."""

    def __init__(
        self, config: Config, job: Job, placement: Placement | None = None, replacing: ReplacingFactory | None = None, feature: Feature | None = None
    ) -> None:
        """`replacing`: what makes the replacement feature's side, when `config` replaces a lost
        worker (the wrapper hands down `replacement.replacer(config)`; without it a loss ends the fit).
        `feature`: the config's (features.of; None: Plain), which the workers ask what they train."""
        self.config = config
        self._feature = feature = feature or Plain()
        self._placement = placement = placement or resolve(config, per_worker=feature.processes, notes=feature.notes(False))
        n = placement.world_size
        # A forkserver's worker (processes.py) takes the main process's environment of the moment
        # it starts, as a spawned one would.
        ctx = self.ctx = worker_context()
        # Plain pickle copies tensors by value. Handed to Process() as objects, they would go
        # through torch's reducers instead, which move the user's model into shared memory that
        # every worker then trains in place, all at once. And the job goes through the command
        # queue, not Process(): a spawn writes its arguments into a pipe, and a large write
        # blocks for ever when the child dies while starting (a script without a main guard).
        # The pickle goes in shared memory, once for every worker: each queue would otherwise
        # hold a copy of its own until its worker took it. Kept only to start a replacement.
        self._job: torch.Tensor | None = _shared_pickle(job)
        # The main process serves the rendezvous store: port 0 lets the OS choose a free port,
        # so pools running side by side (tests, several trainers) never collide.
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=collective_timeout(config))
        if config.deterministic:
            per_worker = max(1, config.prefetch_buffer // n)
            self.data_queues: list[Queue[Item]] = [ctx.Queue(maxsize=per_worker) for _ in range(n)]
        else:
            self.data_queues = [ctx.Queue(maxsize=config.prefetch_buffer)]
        self.free_slots: Queue[int] = ctx.Queue()
        self._fits = 0  # fits read in shards, each claiming from a key of its own
        self._results: Queue[Message] = ctx.Queue()
        self._stop = ctx.Event()
        self.abort = ctx.Event()
        # With a pipeline each worker is `stages` processes (pipeline/): process p is stage
        # p % stages of worker p // stages; the board, commands and results are by process.
        processes = placement.processes
        self.board = ProgressBoard(ctx, processes)
        # Filled by `_spawn` before any other reads them (the supervisor holds the same list): only
        # `kill`, after a start that failed, may find a None.
        self._processes = cast("list[BaseProcess]", [None] * processes)
        self._commands = cast("list[Queue[Command]]", [None] * processes)
        # A standby: a process spawned ahead, its imports done (importing torch takes seconds), for
        # a rank that a replacement gives a fresh process (`occupy`).
        self._standby: tuple[BaseProcess, Queue[Command]] | None = None
        # With on_worker_failure("replace"): its side in this process (replacement/).
        self._replacer = None if replacing is None else replacing(config, placement, self)
        # The slots of prefetched batches, and those that replaceable workers keep until their round lands.
        self.slots = SlotWriter(self.free_slots, config.prefetch_buffer + (0 if self._replacer is None else self._replacer.slots))
        on_failure = None if self._replacer is None else self._replacer.call_away
        self._supervisor = Supervisor(self._processes, self._results, self.board, config.stall_timeout, placement.per_worker, on_failure)
        self._join = functools.partial(feature.joined, job=job)  # worker 0's state, from its processes' (a pipeline's stages')
        try:
            for rank in range(processes):
                self._spawn(rank, joins=True)
            if self._replacer is not None:
                self._replacer.started()
            self._supervisor.gather("ready", set(range(processes)), START_TIMEOUT_S, lambda message: None, "starting")
            if self._replacer is None:
                self._job = None  # every worker has unpickled it
        except BaseException:
            self.kill()
            raise

    def _spawn(self, rank: int | None, joins: bool) -> tuple[BaseProcess, Queue[Command]]:
        """Start the worker of `rank`, or a standby (None), with a command queue of its own. It
        `joins` the first process group at once; a replacement's joins the group its regroup forms."""
        commands: Queue[Command] = self.ctx.Queue()
        channels = Channels(
            self.data_queues, self.free_slots, commands, self._results, self._stop, self.board,
            self.abort, None if self._replacer is None else self._replacer.worker_side,
        )  # fmt: skip
        process = self.ctx.Process(
            target=worker_entry,
            args=(rank, self.config, self._placement, self._feature, self.store.port, channels, joins, dict(os.environ)),
            name="parallelwrapper-standby" if rank is None else f"parallelwrapper-worker-{rank}",
            daemon=True,
        )
        if rank is not None:
            commands.put(self._job)
            self._processes[rank], self._commands[rank] = process, commands
        process.start()
        return process, commands

    def pid(self, rank: int) -> int | None:
        """The process id of `rank`'s process as it is now (a replacement's: replacement/)."""
        return self._processes[rank].pid

    def command(self, word: object) -> None:
        """Put `word` on every process's command queue (a replacement's Regroup)."""
        for q in self._commands:
            q.put(word)

    def spawn_standby(self) -> None:
        """A standby, unless there is one."""
        if self._standby is None:
            self._standby = self._spawn(None, joins=False)

    def occupy(self, rank: int) -> None:
        """A fresh process for `rank`: the standby, whose imports are done, when it is alive. It
        joins the group that the replacement's regroup forms."""
        standby, self._standby = self._standby, None
        if standby is None or not standby[0].is_alive():
            self._spawn(rank, joins=False)
        else:
            process, commands = standby
            commands.put(rank)
            commands.put(self._job)
            process.name = f"parallelwrapper-worker-{rank}"  # as `_spawn` names a worker: what it is now
            self._processes[rank], self._commands[rank] = process, commands
        self._supervisor.gone.discard(rank)

    def put_down(self, rank: int) -> None:
        """Kill the process of `rank` (a late SIGCONT finds nothing), and have the supervisor
        pass it over until a fresh one takes the rank (`occupy`)."""
        process = self._processes[rank]
        if process.is_alive():
            process.kill()
        process.join(timeout=_JOIN_TIMEOUT_S)
        self._supervisor.gone.add(rank)

    def fit(self, command: FitCommand, data: Batches, on_report: Reporter) -> TrainingState:
        """Run one fit on all workers, fed from `data`; return rank 0's final state (model, optimizer, schedule).

        Ctrl-C: with checkpoints on, the workers finish the round and save it (for up to
        `_STOP_GRACE_S`), then KeyboardInterrupt propagates; without, it propagates at once.
        A KeyboardInterrupt raised in `on_report` (a listener's, or a Ctrl-C that came while one
        ran) is one, once the reports that came with it are all passed on.
        With on_worker_failure("replace"), a worker's failure replaces it (replacement/).
        """
        self._stop.clear()
        if self._replacer is not None:
            self._replacer.fit_starts(command.start)
        c, until_epoch = command.counters, command.until_epoch
        feeder = None
        if shardable(data, self.config.feed, self._replacer is not None):
            # Its tensors go to shared memory once; the workers claim its batches first-come from
            # a key of this fit's in the store (feed/claims.py), or each reads its dealt shard.
            self._fits += 1
            claims = f"pw-claims/{self._fits}" if claimed(self.config, self._feature.alone) else None
            # A loader's epochs are drawn now, in the order kept for a resume, and kept (feed/order.py).
            epochs = EpochOrder(data, c.epoch, command.order, trains_here=False).up_front(until_epoch) if isinstance(data, DataLoader) else None
            command = dataclasses.replace(command, shards=shards_of(data, c.epoch, until_epoch, epochs), claims=claims)
        else:
            feeder = Feeder(data, c.epoch, until_epoch, c.position, self.data_queues, self._placement.world_size, self.slots, command.order)
        for q in self._commands:
            q.put(command)
        # The queues hold the command until they have sent it; its state is the main process's
        # own tensors in shared memory (Parts.shipped), which the workers load by copy.
        del command
        if feeder is not None:
            feeder.start()
        done: set[int] = set()
        finals: dict[int, TrainingState] = {}  # worker 0's: its stages', with a pipeline
        # Left mid-message, a KeyboardInterrupt raised while reporting would lose the reports that
        # came with it: it waits until they are passed on (a later one is the same request).
        pressed: list[KeyboardInterrupt] = []

        def report(record: Report) -> None:
            try:
                on_report(record)
            except KeyboardInterrupt as e:
                pressed.append(e)

        try:
            while len(done) < len(self._processes):
                if feeder is not None and feeder.error is not None:
                    raise feeder.error
                try:
                    if pressed:
                        raise pressed[0]
                    message = self._receive("training", report)
                except KeyboardInterrupt:
                    if self.config.checkpoint_dir is None:
                        raise
                    self._stop_gracefully(report)
                    raise
                except WorkerError as error:
                    if self._replacer is None or feeder is None or done:
                        raise
                    self._replacer.replace(error, feeder, until_epoch, self._supervisor, lambda m: self._pass_on(m, report), report)
                    continue
                if message is not None and message[0] == "done":
                    done.add(message[1])
                    if message[2] is not None:
                        finals[message[1]] = message[2]
        finally:
            if feeder is not None:
                feeder.stop()
        self._drain()
        if pressed:  # in the last reports of the fit, which every worker has finished and saved
            raise pressed[0]
        return self._join([finals[s] for s in range(self._placement.per_worker)])

    def _drain(self) -> None:
        """Batches fed but not taken (early stopping ends a fit mid-epoch): the next fit() must
        not find them, and their slots go back to the feeder."""
        for q in self.data_queues:
            for item in drain(q, settle=False):
                if isinstance(item, tuple):  # a batch, not an end of epoch
                    self.free_slots.put(item[1][0])

    def _stop_gracefully(self, on_report: Reporter) -> None:
        """Ask the workers to stop after this round (they checkpoint it), and wait a little."""
        self._stop.set()
        stopped: set[int] = set()
        deadline = time.monotonic() + _STOP_GRACE_S
        while len(stopped) < len(self._processes) and time.monotonic() < deadline:
            message = self._receive("stopping", on_report)
            if message is not None and message[0] in ("stopped", "done"):
                stopped.add(message[1])

    def _receive(self, stage: str, on_report: Reporter) -> Message | None:
        """The next message that is not a batch of reports; those go to `on_report` on the way."""
        message = self._supervisor.next(stage)
        return None if message is None else self._pass_on(message, on_report)

    def _pass_on(self, message: Message, on_report: Reporter) -> Message | None:
        """A batch of reports goes to `on_report` (None); any other message comes back. Rank 0
        reports; with replacement the other workers send their epochs' ends too, which go on
        when the replacer says (`passes`)."""
        if message[0] != "reports":
            return message
        for report in message[2]:
            if self._replacer is None or self._replacer.passes(message[1], report):
                on_report(report)
        return None

    def close(self) -> None:
        """Tell every worker (and the standby) to stop, join them, and kill the ones that do not stop."""
        standby = [] if self._standby is None else [self._standby]
        for q in [*self._commands, *(commands for _, commands in standby)]:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for p in [*self._processes, *(process for process, _ in standby)]:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        standby = [] if self._standby is None else [self._standby]
        started = [p for p in [*self._processes, *(process for process, _ in standby)] if p is not None and p.pid is not None]
        for p in started:  # (start() may have failed)
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=_JOIN_TIMEOUT_S)
        queues: list[_Closes | None] = [*self.data_queues, self.free_slots, *self._commands, *(commands for _, commands in standby), self._results]
        for q in queues:
            if q is None:
                continue
            q.cancel_join_thread()
            q.close()
        self.slots.close()
