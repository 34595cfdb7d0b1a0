"""Where workers run, behind one `Host` interface: spawned processes, the caller's process, a torchrun rank, or a fleet's member.

Spawned processes on this machine (spawned.py, with process.py the worker's side, supervisor.py
watching them, and the replacement/ package replacing one that is lost), the caller's own process
for one CPU worker (inprocess.py), this process as one rank of a torchrun group (torchrun.py), or
as one member of a fleet, whose group forms in a store none of its processes hosts (fleet.py).
All three run a worker by the same path (runtime.py), so a worker trains, stops, checkpoints and
fails the same way under each."""

from __future__ import annotations

from typing import Protocol

from ..config import Config
from ..env import Placement
from ..feature import Feature
from ..feed.data import Batches
from ..job import Job
from ..messages import FitCommand
from ..types import Reporter, TrainingState
from .fleet import FleetWorker, Surviving
from .inprocess import InProcessWorker
from .spawned import ReplacingFactory, WorkerPool
from .torchrun import TorchrunWorker


class Host(Protocol):
    """Runs a fit on every worker and returns the final state (model, optimizer, schedule); `close` lets the
    workers go, `kill` after a failure stops them at once."""

    def fit(self, command: FitCommand, data: Batches, on_report: Reporter) -> TrainingState: ...

    def close(self) -> None: ...

    def kill(self) -> None: ...


def start_host(
    config: Config, job: Job, placement: Placement, feature: Feature, replacing: ReplacingFactory | None = None, surviving: Surviving | None = None
) -> Host:
    """The host the placement calls for, asking `feature` (the config's, features.of); spawned
    workers replace a lost one with what `replacing` makes, and a fleet's members go on after a
    loss with what `surviving` makes (the replacement feature's sides, which hosts do not import)."""
    if config.fleet is not None:
        assert surviving is not None, "config.refuse holds a fleet to on_worker_failure('replace')"
        return FleetWorker(config, job, placement, feature, surviving)
    if placement.torchrun is not None:
        return TorchrunWorker(config, job, placement, feature)
    if placement.in_process:
        return InProcessWorker(config, job, placement, feature)
    return WorkerPool(config, job, placement, replacing, feature)


__all__ = ["FleetWorker", "Host", "InProcessWorker", "TorchrunWorker", "WorkerPool", "start_host"]
