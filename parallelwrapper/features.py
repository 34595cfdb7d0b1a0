"""The features a config turns on, as one `feature.Feature`: a pipeline over a hierarchy over replacement over `Plain`.

Built once (the wrapper's build(), a ParallelWrapper) and handed to the hosts, which hand it to
their workers: each feature's package reads its own option, and nothing else does.
"""

from __future__ import annotations

from collections.abc import Collection

from . import hierarchy, pipeline, replacement
from .config import Config
from .env import Placement, TorchrunEnv, resolve
from .feature import Feature, Plain


def of(config: Config) -> Feature:
    """The features `config` turns on, each over the next; Plain when none is."""
    return pipeline.of(config, hierarchy.of(config, replacement.of(config, Plain())))


def placement(
    config: Config, torchrun: TorchrunEnv | None = None, *, feature: Feature | None = None, gpus: int | None = None, cores: int | None = None, explicit: Collection[str] = ()
) -> Placement:
    """env.resolve's placement of this machine's workers, with what the config's features (`feature`,
    or `of(config)`) say of it: the processes a worker is and the notes."""
    feature = feature or of(config)
    return resolve(config, torchrun, gpus=gpus, cores=cores, explicit=explicit, per_worker=feature.processes, notes=feature.notes(torchrun is not None))


__all__ = ["of", "placement"]
