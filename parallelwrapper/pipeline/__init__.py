"""Model parallelism inside each worker (`.pipeline(stages=S)`): every worker a pipeline of S stage processes.

Stage s holds only its layers and their optimizer state.

- split.py cuts the model into stages, and a fit's state along the same lines;
- stage.py is a stage's process-side: its groups, the batches it takes, its schedule step.

The round protocol is unchanged: stage s of every worker averages its own state with the others'
stage s, in a group of its own, every k steps (hosts/runtime.py's Worker asks `plan` for its stage), with
overlap and an outer optimizer over the stage's parameters as without a pipeline.
Hosts ask this package two things, and name none of its classes: `check` (at build(): can the
model be cut as asked) and `plan` (in a stage's process: what its worker trains, in which groups,
on which batches); the main process joins the stages' states with `joined_state`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from ..config import Config
from ..job import Job
from ..types import BatchSource
from ..worker import Replica
from .split import Layout, cut, joined_state, layers, stage_module
from .stage import Position, RelaySource, StageReplica, join_groups


@dataclass(frozen=True)
class StagePlan:
    """What a stage's process trains: its part of the job, the replica that trains it, the
    worker it belongs to and its stage, the worker's data-parallel group (stage s of every
    worker), and what makes its batches of the source its worker reads."""

    job: Job
    make_replica: Callable[..., Replica]
    worker: int
    stage: int
    group: dist.ProcessGroup
    relay: Callable[[BatchSource], BatchSource]


def plan(job: Job, config: Config, world_size: int, process: int) -> StagePlan:
    """The stage in process `process` of a group of `world_size` workers: its layers and their
    optimizer, its groups (joined here: every process of the group calls this), and the batches
    its pipeline's first stage takes from the worker's source and relays down the pipeline."""
    assert config.pipeline is not None
    spec = config.pipeline
    position = Position.of(process, spec.stages)
    whole = Layout.of(job.model, job.make_optimizer(job.model))
    part = dataclasses.replace(job, model=stage_module(job.model, spec, position.stage))
    group, pipe = join_groups(position, world_size)
    make = functools.partial(StageReplica, position=position, pipe=pipe, whole=whole)
    return StagePlan(part, make, position.worker, position.stage, group, lambda source: RelaySource(source if position.stage == 0 else None, position, pipe))


def check(config: Config, job: Job) -> None:
    """A ValueError for a pipeline that cannot be cut as asked, or a schedule this torch lacks,
    with the fix. The options that do not run with a pipeline are config.CONFLICTS'."""
    spec = config.pipeline
    if spec is None:
        return
    cut(job.model, spec)
    if spec.schedule == "zbv" and not hasattr(pipelining, "ScheduleZBVZeroBubble"):
        raise ValueError(f"pipeline(schedule='zbv') needs torch.distributed.pipelining.ScheduleZBVZeroBubble, which torch {torch.__version__} lacks; upgrade torch, or use schedule='1f1b'")


__all__ = ["StagePlan", "check", "joined_state", "layers", "plan", "stage_module"]
