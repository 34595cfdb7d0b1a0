"""One worker in the caller's own process: `.workers(1)` on the CPU.

With one worker there is nobody to share batches with, so nothing is spawned, queued or copied:
the worker takes each batch from the iterable when it needs it and trains on it where it lies,
as a plain loop does (a DataLoader's own workers still read ahead). On a small machine this is
what makes one worker as fast as a plain loop: a feeder thread, even one that only copies a
batch into shared memory, takes a core from the worker's threads at every step.

What stays as with spawned workers, so that `.workers(1)` and `.workers(2)` differ only in speed:
- the round protocol, on a process group of this process alone: averaging over it is a no-op,
  not a branch, and the default process group is left alone (the caller may have its own);
- the worker's own copy of the model and optimizer: the caller's change only when fit() returns;
- the worker's own RNG stream, seeded `seed + 0` as spawned worker 0's is; the caller's RNG
  state and torch thread count are as they were after fit();
- checkpoints, and Ctrl-C with checkpoints on: the round finishes and is saved, then
  KeyboardInterrupt (a second Ctrl-C interrupts at once).

One worker on a GPU is still spawned: a group of one built this way has not been run on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]

from .checkpoint import rng_state, set_rng_state
from .config import Config, Job
from .feed import Batches, ShardSource
from .launch import FitCommand, collective_timeout, make_checkpointer, threads_per_worker
from .worker import Hooks, Replica, Reporter, Stopped


def runs_in_process(config: Config) -> bool:
    return config.workers == 1 and torch.device(config.resolved_devices()[0]).type == "cpu"


def group_of_one(config: Config) -> dist.ProcessGroup:
    """A gloo group of this process alone, put together as torch's `new_group` does it, but
    without a default group (which is global: the caller may have one, or want one later)."""
    store = HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    gloo = dist.ProcessGroupGloo(store, 0, 1, collective_timeout(config))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


class _Hooks(Hooks):
    """Checkpoints, and a stop flag that the first Ctrl-C sets."""

    stop = False

    def stop_requested(self) -> bool:
        return self.stop


class InProcessWorker:
    """The pool's interface (`fit`, `close`, `kill`) for a worker that is this process."""

    def __init__(self, config: Config, job: Job) -> None:
        self._config = config
        device = torch.device(config.resolved_devices()[0])
        model = copy.deepcopy(job.model).to(device)
        self._hooks = _Hooks(make_checkpointer(config, job, 1))
        self._replica = Replica(
            model, job.make_optimizer(model), job, config, device, 0, 1, group_of_one(config), self._hooks
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self._rng = rng_state()

    def fit(
        self, command: FitCommand, data: Batches, on_report: Reporter
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Train as a spawned worker 0 would on `command`; return its final (model, optimizer) state."""
        replica = self._replica
        replica.load_state(command.model_state, command.optimizer_state)
        replica.counters = command.counters
        if command.rng is not None:
            self._rng = command.rng[0]
        source = ShardSource(data, 0, 1, command.counters.epoch, command.counters.position)
        with self._own_threads_and_rng(), self._ctrl_c_finishes_the_round():
            try:
                replica.fit(command.until_epoch, source, on_report)
            except Stopped:
                raise KeyboardInterrupt from None
        return replica.state_dicts()

    @contextlib.contextmanager
    def _own_threads_and_rng(self) -> Iterator[None]:
        threads, caller_rng = torch.get_num_threads(), rng_state()
        torch.set_num_threads(threads_per_worker(self._config, 1))
        set_rng_state(self._rng)
        try:
            yield
        finally:
            self._rng = rng_state()
            set_rng_state(caller_rng)
            torch.set_num_threads(threads)

    @contextlib.contextmanager
    def _ctrl_c_finishes_the_round(self) -> Iterator[None]:
        self._hooks.stop = False
        if self._config.checkpoint_dir is None or threading.current_thread() is not threading.main_thread():
            yield
            return

        def first_stops_second_interrupts(signum: int, frame: FrameType | None) -> None:
            if self._hooks.stop:
                raise KeyboardInterrupt
            self._hooks.stop = True

        previous = signal.signal(signal.SIGINT, first_stops_second_interrupts)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def close(self) -> None:
        """Nothing runs between fits; the group of one needs no shutdown."""

    kill = close
