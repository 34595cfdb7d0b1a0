"""The one seam of a feature (a pipeline, a hierarchy, replacement): the `Feature` the hosts, a worker and its round loop ask.

After Lightning Fabric's strategies: a feature is an object built once from the config
(`features.of`), which the rest of the package asks, and no module outside its folder reads its
option (tests/test_feature_boundaries.py). With no feature on, `Plain` answers, so that callers
have one path and no branch on an option. A feature stands over the next one (`Over`) and passes
on what it does not change: the config lets a hierarchy and replacement go together, each acting
under a host of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from .config import Config
from .env import Placement
from .feed.protocols import BatchSource
from .job import Job
from .rounds import Lockstep
from .types import TrainingState
from .worker import Replica


@dataclass(frozen=True)
class Seat:
    """What one process of a worker trains and in which groups: its part of the job, the worker
    it is (or is a stage of), the round protocol's group (None: the default), what makes its
    replica, what makes its batches of the worker's source, and the ranks it steps with as one
    worker (a hierarchy's node), and the worker's other processes (a pipeline's stages), whose
    rounds must run with the same choices as this one's."""

    job: Job
    rank: int
    stage: int | None = None
    group: dist.ProcessGroup | None = None
    make_replica: Callable[..., Replica] = Replica
    relay: Callable[[BatchSource], BatchSource] | None = None
    lockstep: Lockstep | None = None
    together: dist.ProcessGroup | None = None


class Feature(Protocol):
    """A feature as the hosts, a worker and its round loop ask it."""

    @property
    def processes(self) -> int:
        """How many processes one worker is (a pipeline's stages); devices go by process."""
        ...

    @property
    def alone(self) -> bool:
        """Whether each process takes its own batches and steps alone, so that workers may claim
        their batches first-come (feed/claims.py): not in lockstep within a worker or a node."""
        ...

    @property
    def redoes(self) -> bool:
        """What a lost process means: whether a lost worker's round is redone, from a copy of the
        whole state every worker keeps at its start (replacement), so that the round's state goes
        whole (rounds/state.later_tensors); else a loss ends the fit (with a pipeline, a lost
        stage is its whole worker's loss)."""
        ...

    def notes(self, torchrun: bool) -> tuple[str, ...]:
        """What the caller is told once about the feature under this host (torchrun or not)."""
        ...

    def check(self, job: Job) -> None:
        """At build(): a ValueError, with the fix, for a job the feature cannot run."""
        ...

    def fingerprint(self) -> dict[str, object]:
        """How a checkpoint's own states split (by process), which a resume must match."""
        ...

    def seat(self, job: Job, config: Config, placement: Placement, process: int, group: dist.ProcessGroup | None) -> Seat:
        """Which groups exist and what process `process` trains in them (every process of the
        group calls this: groups are made by all alike). `group`: the host's round group."""
        ...

    def joined(self, states: Sequence[TrainingState], job: Job) -> TrainingState:
        """A worker's state from its processes' states, in process order (`processes` of them)."""
        ...


class Plain:
    """No feature: a worker is one process, in the host's group, training the whole job."""

    processes = 1
    alone = True
    redoes = False

    def notes(self, torchrun: bool) -> tuple[str, ...]:
        return ()

    def check(self, job: Job) -> None:
        return None

    def fingerprint(self) -> dict[str, object]:
        return {}

    def seat(self, job: Job, config: Config, placement: Placement, process: int, group: dist.ProcessGroup | None) -> Seat:
        return Seat(job, process, group=group)

    def joined(self, states: Sequence[TrainingState], job: Job) -> TrainingState:
        (state,) = states
        return state


class Over:
    """A feature over `rest` (the next feature, or Plain): it asks `rest` what it does not change."""

    def __init__(self, rest: Feature) -> None:
        self.rest = rest

    @property
    def processes(self) -> int:
        return self.rest.processes

    @property
    def alone(self) -> bool:
        return self.rest.alone

    @property
    def redoes(self) -> bool:
        return self.rest.redoes

    def notes(self, torchrun: bool) -> tuple[str, ...]:
        return self.rest.notes(torchrun)

    def check(self, job: Job) -> None:
        self.rest.check(job)

    def fingerprint(self) -> dict[str, object]:
        return self.rest.fingerprint()

    def seat(self, job: Job, config: Config, placement: Placement, process: int, group: dist.ProcessGroup | None) -> Seat:
        return self.rest.seat(job, config, placement, process, group)

    def joined(self, states: Sequence[TrainingState], job: Job) -> TrainingState:
        return self.rest.joined(states, job)


__all__ = ["Feature", "Over", "Plain", "Seat"]
