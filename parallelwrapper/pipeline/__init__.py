"""Model parallelism inside each worker (`.pipeline(stages=S, ...)`): every data-parallel worker is
a pipeline of S stage processes, stage s holding only its layers and their optimizer state.

- split.py cuts the model into stages, and a fit's state along the same lines;
- stage.py is a stage's process-side: its groups, the batches it takes, its schedule step.

The round protocol is unchanged: stage s of every worker averages its own state with the others'
stage s, in a group of its own, every k steps (hosts/process.py wires a stage's worker), with
overlap and an outer optimizer over the stage's parameters as without a pipeline.
`check` refuses, at build(), the options this version does not run with a pipeline.
"""

from __future__ import annotations

import torch
from torch.distributed import pipelining

from ..config import Config, Job
from .split import cut, joined_state, layers, stage_module
from .stage import Position, RelaySource, StageReplica, gathered_state, join_groups


def check(config: Config, job: Job) -> None:
    """A ValueError for a pipeline that cannot be cut as asked, or an option that does not run
    with one in this version, with the reason and the fix."""
    spec = config.pipeline
    if spec is None:
        return
    cut(job.model, spec)
    if spec.schedule == "zbv" and not hasattr(pipelining, "ScheduleZBVZeroBubble"):
        raise ValueError(f"pipeline(schedule='zbv') needs torch.distributed.pipelining.ScheduleZBVZeroBubble, which torch {torch.__version__} lacks; upgrade torch, or use schedule='1f1b'")
    refused = (
        (config.on_worker_failure == "replace", 'on_worker_failure("replace"): a lost stage would take its whole pipeline with it; drop it'),
        (config.precision == "16-mixed", "precision('16-mixed'): its loss scaling needs the loss before the backward, which the pipeline's schedule runs itself; use .precision('bf16-mixed')"),
        (config.hierarchy != "none", "hierarchy: its node groups are not stage groups; drop .hierarchy()"),
        (job.validation_step is not None, "validation(step=fn): fn(model, batch) takes the whole model, which no stage holds; drop step= for val_loss and val_accuracy"),
        (job.training_step is not None or job.loss_fn is None, "training_step: the last stage computes the loss from (inputs, targets) batches; use .loss_fn(fn)"),
        (job.before_step is not None, "before_step: each stage holds only a part of the model; drop .before_step(fn)"),
    )
    for bad, reason in refused:
        if bad:
            raise ValueError(f"pipeline(stages={spec.stages}) does not go with {reason}")


__all__ = ["Position", "RelaySource", "StageReplica", "check", "gathered_state", "join_groups", "joined_state", "layers", "stage_module"]
