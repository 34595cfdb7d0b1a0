"""One worker in the caller's own process: `.workers(1)` on the CPU.

With one worker there is nobody to share batches with, so nothing is spawned, queued or copied:
the worker takes each batch from the iterable when it needs it and trains on it where it lies,
as a plain loop does (a DataLoader's own workers still read ahead). On a small machine this is
what makes one worker as fast as a plain loop: a feeder thread, even one that only copies a
batch into shared memory, takes a core from the worker's threads at every step.

Everything else is the shared runtime's (runtime.py), so `.workers(1)` and `.workers(2)` differ
only in speed: the round protocol on a process group of this process alone (averaging over it is
a no-op, not a branch, and the caller's default group, if any, is left alone); the worker's own
copy of the model, RNG stream and threads; checkpoints, and Ctrl-C with checkpoints on (the round
finishes and is saved, then KeyboardInterrupt; a second Ctrl-C interrupts at once).

One worker on a GPU is still spawned: a group of one built this way has not been run on a GPU.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]

from .. import feed
from ..config import Config
from ..env import Placement, collective_timeout, resolve
from ..feature import Feature
from ..feed.data import Batches
from ..job import Job
from ..messages import FitCommand
from ..types import Reporter, TrainingState
from .runtime import SignalHooks, Worker, stop_on_signals


def group_of_one(config: Config) -> dist.ProcessGroup:
    """A gloo group of this process alone, put together as torch's `new_group` does it, but
    without a default group (which is global: the caller may have one, or want one later)."""
    store = HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    gloo = dist.ProcessGroupGloo(store, 0, 1, collective_timeout(config))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


class InProcessWorker:
    """The host interface (`fit`, `close`, `kill`) for a worker that is this process."""

    def __init__(self, config: Config, job: Job, placement: Placement | None = None, feature: Feature | None = None) -> None:
        self._hooks = SignalHooks()
        placement = placement or resolve(config)
        self._worker = Worker(job, config, placement, 0, 0, group=group_of_one(config), hooks=self._hooks, feature=feature)

    def fit(self, command: FitCommand, data: Batches, on_report: Reporter) -> TrainingState:
        """Train as a spawned worker 0 would on `command`; return its final state (model, optimizer, schedule)."""
        source = feed.source(data, 0, 1, command.counters, command.until_epoch, order=command.order)
        with stop_on_signals(self._hooks, (signal.SIGINT,), on_report) as report:
            until_epoch = self._worker.start(command)
            del command  # loaded: the copy of the state goes now, not at the fit's end
            self._worker.train(until_epoch, source, report)
        return self._worker.replica.state_dicts()

    def close(self) -> None:
        """Nothing runs between fits; the group of one needs no shutdown."""

    kill = close
