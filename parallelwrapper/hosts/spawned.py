"""Starting and supervising workers: spawned local processes, or this process inside a torchrun group.

This is the only module that reads the environment.

Process discipline (after Lightning Fabric and torchft): a `spawn` context, never a global start
method; a module-level worker entry; a timeout on every wait; worker exceptions sent back as
values and re-raised with the rank; shutdown by a close message, join with a timeout, then kill.
Workers are daemons, and each gives up when its parent is gone, so none outlives the trainer.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]
import torch.multiprocessing as mp

from .checkpoint import Checkpointer, fingerprint, set_rng_state
from .config import Config, Job
from .feed import Batches, Feeder, QueueSource, RoundBudget
from .slots import SlotReader, SlotWriter
from .worker import Counters, EpochReport, Hooks, Phase, Replica, RoundReport, Stopped

_START_TIMEOUT_S = 180.0  # importing torch in a fresh process on a loaded 2-core machine is slow
_JOIN_TIMEOUT_S = 10.0
_REPORT_S = 0.25  # how long rank 0 may hold scores back to send them together
_POLL_S = 0.2  # the supervisor's poll: each wake-up takes a core from a worker for a moment
_ERROR_GRACE_S = 0.5  # after a first error, how long to wait for the one that caused it
_STOP_GRACE_S = 15.0  # after Ctrl-C, how long workers get to finish the round and checkpoint
_COLLECTIVE_MARGIN_S = 30.0


class WorkerError(RuntimeError):
    """A worker failed. `rank` names it; the message carries its traceback."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"worker {rank} failed:\n{message}")
        self.rank = rank


# -- the environment ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun identity of this process, or None outside torchrun."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return TorchrunEnv(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )


def in_torchrun() -> bool:
    return torchrun_env() is not None


def threads_per_worker(config: Config, local_workers: int) -> int:
    """Cores shared out among the workers on this machine: oversubscribing them costs more than
    it gains (each worker's intra-op threads fight the others' for the same cores)."""
    if config.threads_per_worker is not None:
        return config.threads_per_worker
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_workers)


def _prepare_worker(config: Config, device: torch.device, rank: int, local_workers: int) -> None:
    """A worker's device, threads and RNG, the same whether spawned or under torchrun."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads_per_worker(config, local_workers))
    torch.manual_seed(config.seed + rank)


def collective_timeout(config: Config) -> datetime.timedelta:
    """The collectives' own timeout: past the stall watchdog's, so that the watchdog, which can
    name the stalled worker, speaks first; it is the only guard under torchrun."""
    return datetime.timedelta(seconds=config.stall_timeout_s + _COLLECTIVE_MARGIN_S)


# -- torchrun: this process is one worker --------------------------------------------------------


def join_torchrun(config: Config) -> tuple[TorchrunEnv, torch.device, bool]:
    """Join (or reuse) the default process group that torchrun set up the environment for.
    Returns the identity, this worker's device, and whether this call created the group."""
    env = torchrun_env()
    assert env is not None, "join_torchrun() outside torchrun"
    if config.devices is not None:
        device = torch.device(config.devices[env.local_rank % len(config.devices)])
    elif torch.cuda.is_available():
        device = torch.device(f"cuda:{env.local_rank % torch.cuda.device_count()}")
    else:
        device = torch.device("cpu")
    _prepare_worker(config, device, env.rank, env.local_world_size)
    if dist.is_initialized():
        return env, device, False
    backend = config.backend if config.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, timeout=collective_timeout(config))
    return env, device, True


# -- spawned local workers -----------------------------------------------------------------------


@dataclass(frozen=True)
class FitCommand:
    """What the main process sends each worker to start a fit()."""

    until_epoch: int
    counters: Counters
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    rng: list[dict[str, Any]] | None  # per rank, when resuming from a checkpoint


class ProgressBoard:
    """Each worker's phase, place and the time it got there, in shared memory: the supervisor's
    stall watchdog reads it without asking the workers anything."""

    FIELDS = 5  # phase, epoch, batch index, local step, monotonic time (system-wide on Linux)

    def __init__(self, ctx: Any, workers: int) -> None:
        self.array = ctx.Array("d", workers * self.FIELDS, lock=False)

    def write(self, rank: int, phase: Phase, epoch: int, index: int, step: int) -> None:
        o = rank * self.FIELDS
        self.array[o : o + self.FIELDS] = [float(phase), epoch, index, step, time.monotonic()]

    def read(self, rank: int) -> tuple[Phase, int, int, int, float]:
        o = rank * self.FIELDS
        phase, epoch, index, step, since = self.array[o : o + self.FIELDS]
        return Phase(int(phase)), int(epoch), int(index), int(step), since


class _SpawnedHooks(Hooks):
    def __init__(self, board: ProgressBoard, rank: int, stop: Any, checkpointer: Any) -> None:
        super().__init__(checkpointer)
        self._board, self._rank, self._stop = board, rank, stop

    def progress(self, phase: Phase, epoch: int, index: int, step: int) -> None:
        self._board.write(self._rank, phase, epoch, index, step)

    def stop_requested(self) -> bool:
        return bool(self._stop.is_set())


def make_checkpointer(config: Config, job: Job, world_size: int) -> Checkpointer | None:
    if config.checkpoint_dir is None:
        return None
    return Checkpointer(config.checkpoint_dir, config.checkpoint_every, fingerprint(config, job, world_size), config)


def _worker_entry(
    rank: int,
    config: Config,
    store_port: int,
    channels: tuple[Any, Any, Any, Any, Any, ProgressBoard, RoundBudget | None],
    parent_pid: int,
) -> None:
    """A spawned worker: join the group, then run fit commands until told to close."""
    data_queue, free_slots, command_queue, result_queue, stop, board, budget = channels
    world = config.workers
    # Ctrl-C in a terminal reaches every process of the group: the main process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = torch.device(config.resolved_devices()[rank])
        _prepare_worker(config, device, rank, world)
        store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=collective_timeout(config))
        dist.init_process_group(
            config.resolved_backend(), store=store, rank=rank, world_size=world, timeout=collective_timeout(config)
        )
        job: Job = pickle.loads(_get(command_queue, parent_pid))
        model = job.model.to(device)
        hooks = _SpawnedHooks(board, rank, stop, make_checkpointer(config, job, world))
        replica = Replica(model, job.make_optimizer(model), job, config, device, rank, world, hooks=hooks, budget=budget)
        source = QueueSource(data_queue, SlotReader(free_slots), parent_pid)
        report = _Reports(result_queue, rank)
        result_queue.put(("ready", rank, None))
        while True:
            command: FitCommand | None = _get(command_queue, parent_pid)
            if command is None:
                break
            replica.load_state(command.model_state, command.optimizer_state)
            replica.counters = command.counters
            if command.rng is not None:
                set_rng_state(command.rng[rank])
            try:
                replica.fit(command.until_epoch, source, report if rank == 0 else lambda r: None)
            except Stopped:
                report.flush()
                result_queue.put(("stopped", rank, None))
                continue
            result_queue.put(("done", rank, replica.state_dicts() if rank == 0 else None))
    except BaseException:  # noqa: BLE001 - every failure goes back to the main process
        result_queue.put(("error", rank, traceback.format_exc()))
        # Flush before the process group goes down: the peers' "connection closed" errors must
        # reach the main process after this worker's own.
        result_queue.close()
        result_queue.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Reports:
    """Rank 0's reports, sent in batches at most every `_REPORT_S`: every message wakes the
    main process, which then takes a core from a worker for a moment (and with few cores, a
    worker held up holds every worker up at the next averaging). An epoch's end goes at once."""

    def __init__(self, results: Any, rank: int) -> None:
        self._results, self._rank = results, rank
        self._pending: list[RoundReport | EpochReport] = []
        self._last = time.monotonic()

    def __call__(self, report: RoundReport | EpochReport) -> None:
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


class WorkerPool:
    """N spawned workers that live as long as the wrapper, their queues, and their supervision:
    errors, deaths and stalls become a `WorkerError` naming the worker."""

    def __init__(self, config: Config, job: Job) -> None:
        self.config = config
        n = config.workers
        if config.shares_gpus():
            warnings.warn(
                f"{n} workers share {len(set(config.resolved_devices()))} GPUs: using gloo, which is slower "
                f"than NCCL; use .workers(n) with n <= the number of GPUs for NCCL",
                stacklevel=3,
            )
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
        self._board = ProgressBoard(ctx, n)
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
                    self._store.port,
                    (
                        self.data_queues[rank % len(self.data_queues)],
                        self._free_slots,
                        self._commands[rank],
                        self._results,
                        self._stop,
                        self._board,
                        self._budget,
                    ),
                    os.getpid(),
                ),
                name=f"parallelwrapper-worker-{rank}",
                daemon=True,
            )
            for rank in range(n)
        ]
        try:
            for p, q in zip(self._processes, self._commands):
                q.put(job_bytes)
                p.start()
            ready: set[int] = set()
            deadline = time.monotonic() + _START_TIMEOUT_S
            while len(ready) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not start within {_START_TIMEOUT_S:.0f} s")
                message = self._next("starting")
                if message is not None:
                    ready.add(message[1])
        except BaseException:
            self.kill()
            raise

    def fit(self, command: FitCommand, data: Batches, on_report: Callable[[RoundReport | EpochReport], None]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run one fit on all workers, fed from `data`; return rank 0's final (model, optimizer) state.

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
        final: tuple[dict[str, Any], dict[str, Any]] | None = None
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
        assert final is not None
        return final

    def _stop_gracefully(self, on_report: Callable[[RoundReport | EpochReport], None]) -> None:
        """Ask the workers to stop after this round (they checkpoint it), and wait a little."""
        self._stop.set()
        stopped: set[int] = set()
        deadline = time.monotonic() + _STOP_GRACE_S
        while len(stopped) < len(self._processes) and time.monotonic() < deadline:
            message = self._receive("stopping", on_report)
            if message is not None and message[0] in ("stopped", "done"):
                stopped.add(message[1])

    def _receive(
        self, stage: str, on_report: Callable[[RoundReport | EpochReport], None]
    ) -> tuple[str, int, Any] | None:
        """The next message that is not a batch of reports; those go to `on_report` on the way."""
        message = self._next(stage)
        if message is None or message[0] != "reports":
            return message
        for report in message[2]:
            on_report(report)
        return None

    def _next(self, stage: str) -> tuple[str, int, Any] | None:
        """The next message, or None after a short poll; raises for errors, deaths and stalls."""
        try:
            message = self._results.get(timeout=_POLL_S)
        except queue.Empty:
            self._raise_if_dead(stage)
            self._raise_if_stalled()
            return None
        kind, rank, payload = message
        if kind == "error":
            self._raise_error(rank, payload)
        return kind, rank, payload

    def _raise_if_dead(self, stage: str) -> None:
        for rank, p in enumerate(self._processes):
            if p.exitcode is not None:
                # It may have sent an error just before exiting; that says more than the exit code.
                self._raise_error(rank, _exit_message(p.exitcode, stage))

    def _raise_if_stalled(self) -> None:
        """The worker that has been longest in one place, if that is longer than the stall
        timeout. Waiting at the averaging is not a stall of its own: it waits for the others."""
        now = time.monotonic()
        stuck = []
        for rank in range(len(self._processes)):
            phase, epoch, index, step, since = self._board.read(rank)
            if phase in (Phase.WAITING, Phase.TRAINING) and now - since > self.config.stall_timeout_s:
                # A worker stuck in its own step is the cause; the others then wait for it.
                stuck.append((phase is not Phase.TRAINING, since, rank, phase, epoch, index, step))
        if not stuck:
            return
        _, since, rank, phase, epoch, index, step = min(stuck)
        where = (
            f"training on batch {index} of epoch {epoch} (local step {step})"
            if phase is Phase.TRAINING
            else f"waiting for a batch in epoch {epoch}: the training data produced none"
        )
        raise WorkerError(
            rank,
            f"stalled: no progress for {now - since:.0f} s while {where}; the stall timeout is "
            f"{self.config.stall_timeout_s:.0f} s (.stall_timeout(seconds) to change it)",
        )

    def _raise_error(self, rank: int, message: str) -> None:
        """Wait briefly for the error that caused this one (a worker killed by a signal sends
        nothing, and its peers then report broken connections), then raise the root cause."""
        errors = {rank: message}
        deadline = time.monotonic() + _ERROR_GRACE_S
        while time.monotonic() < deadline:
            try:
                kind, r, payload = self._results.get(timeout=_POLL_S)
                if kind == "error":
                    errors.setdefault(r, payload)
            except queue.Empty:
                pass
        silent = [r for r, p in enumerate(self._processes) if p.exitcode is not None and p.exitcode < 0]
        root = next((r for r in silent if r not in errors), None)
        if root is not None:
            errors = {root: _exit_message(self._processes[root].exitcode or 0, "training"), **errors}
        else:
            root = rank
        others = "".join(f"\n\n(also worker {r}: {m.strip().splitlines()[-1]})" for r, m in errors.items() if r != root)
        raise WorkerError(root, errors[root] + others)

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


def _exit_message(exitcode: int, stage: str) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the process was killed by {name} while {stage} (out of memory?)"
    hint = (
        "; its own error is on stderr above. A script that trains must guard its entry point with "
        "`if __name__ == '__main__':`, because each worker imports the main module"
        if stage == "starting"
        else ""
    )
    return f"the process exited with code {exitcode} while {stage}{hint}"
