"""Model parallelism inside each worker (`.pipeline(stages=S)`): every worker a pipeline of S stage processes.

Stage s holds only its layers and their optimizer state.

- split.py cuts the model into stages, and a fit's state along the same lines;
- stage.py is a stage's process-side: its groups, the batches it takes, its schedule step.

The round protocol is unchanged: stage s of every worker averages its own state with the others'
stage s, in a group of its own, every k steps, with overlap and an outer optimizer over the
stage's parameters as without a pipeline. The rest of the package asks this package's `Stages`
(feature.Feature, which `of` makes) and names none of its classes: a worker is S processes, its
states split by stage in a checkpoint and joined by `joined`, and each stage's process has its
seat (its layers and their optimizer, its groups, the batches it takes).
"""

from __future__ import annotations

from ..config import Config
from ..feature import Feature
from .split import joined_state, layers, stage_module


def of(config: Config, rest: Feature) -> Feature:
    """The pipeline over `rest`, when `config` asks for one: only then is its module imported (stages.py says why)."""
    if config.pipeline is None:
        return rest
    from .stages import Stages

    return Stages(config.pipeline, rest)


__all__ = ["joined_state", "layers", "of", "stage_module"]
