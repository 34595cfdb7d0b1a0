"""The pipeline as a feature (`Stages`): a worker's S processes, each stage's seat, and its states joined.

Its own module, which the package's `of` imports only for a config that asks for a pipeline: it
imports torch.distributed.pipelining, and with it torch._dynamo: some 2 s of the start of a process
that makes no optimizer (making one imports torch._dynamo too), such as `pw-fit predict`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from ..config import Config, Pipeline
from ..env import Placement
from ..feature import Feature, Over, Seat
from ..job import Job
from ..types import TrainingState
from .split import Layout, cut, joined_state, stage_module
from .stage import Position, RelaySource, StageReplica, join_groups


class Stages(Over):
    """The pipeline as a feature: each worker `spec.stages` processes, one a stage."""

    def __init__(self, spec: Pipeline, rest: Feature) -> None:
        super().__init__(rest)
        self.spec = spec

    @property
    def processes(self) -> int:
        return self.spec.stages

    @property
    def alone(self) -> bool:
        return False  # a worker's stages step together on the batches its first stage takes

    def check(self, job: Job) -> None:
        """A ValueError for a pipeline that cannot be cut as asked, or a schedule this torch lacks,
        with the fix. The options that do not run with a pipeline are config.CONFLICTS'."""
        cut(job.model, self.spec)
        if self.spec.schedule == "zbv" and not hasattr(pipelining, "ScheduleZBVZeroBubble"):
            raise ValueError(f"pipeline(schedule='zbv') needs torch.distributed.pipelining.ScheduleZBVZeroBubble, which torch {torch.__version__} lacks; upgrade torch, or use schedule='1f1b'")
        self.rest.check(job)

    def fingerprint(self) -> dict[str, object]:
        return {**self.rest.fingerprint(), "stages": self.spec.stages}  # its own states are by process

    def seat(self, job: Job, config: Config, placement: Placement, process: int, group: dist.ProcessGroup | None) -> Seat:
        """The stage in process `process`: its layers and their optimizer, its groups (joined here:
        every process of the group calls this; stage s of every worker is its round group), and
        the batches its pipeline's first stage takes from the worker's source and relays down."""
        position = Position.of(process, self.spec.stages)
        whole = Layout.of(job.model, job.make_optimizer(job.model))
        part = dataclasses.replace(job, model=stage_module(job.model, self.spec, position.stage))
        stage_group, pipe = join_groups(position, placement.world_size)
        make = functools.partial(StageReplica, position=position, pipe=pipe, whole=whole)
        return Seat(part, position.worker, position.stage, stage_group, make, lambda source: RelaySource(source if position.stage == 0 else None, position, pipe), together=pipe)

    def joined(self, states: Sequence[TrainingState], job: Job) -> TrainingState:
        return joined_state(list(states), job, self.spec)
