"""What a ParallelInference is built from: its modes, the frozen `InferenceConfig`, and where its workers run.

The config is validated on construction with the fix in the message; the training's placement
(env.resolve) decides where the workers run: GPU i for worker i when there are GPUs, else the CPU
with the cores shared out among the workers."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from ..config import Config, check_int
from ..env import Placement, gpu_count, resolve


class InferenceMode(enum.Enum):
    """How requests reach a model (DL4J's InferenceMode).

    BATCHED: requests that wait while the workers are busy go together, up to `batch_limit`
    samples, in one forward pass on one worker.
    SEQUENTIAL: each request goes to a worker on its own, as one forward pass.
    INPLACE: each request runs in the caller's thread, on one of `workers` replicas in this
    process; nothing is spawned.
    """

    BATCHED = "batched"
    SEQUENTIAL = "sequential"
    INPLACE = "inplace"


@dataclass(frozen=True)
class InferenceConfig:
    """The options of `ParallelInference.builder(model)` (inference/settings.py gives each one's
    meaning and default)."""

    workers: int | None = None  # None: one per GPU, or 1 on a machine without one (the CPU is one device)
    devices: tuple[str, ...] | None = None  # one per worker; None: cuda:i for worker i, else the CPU
    inference_mode: InferenceMode = InferenceMode.BATCHED
    batch_limit: int = 32  # samples in one forward pass, at most (a larger request goes alone)
    queue_limit: int = 64  # requests waiting for a worker, at most; submit() blocks beyond
    max_wait_ms: float = 2.0  # BATCHED: how long a batch may wait for more requests
    input_shape: tuple[int, ...] | None = None  # one sample's shape; None: every input is a batch
    threads_per_worker: int | None = None  # None: the cores shared out among the workers

    def __post_init__(self) -> None:
        if not isinstance(self.inference_mode, InferenceMode):
            raise TypeError(f"inference_mode must be one of {[m.value for m in InferenceMode]} or an InferenceMode, got {self.inference_mode!r}")
        if self.workers is not None:
            check_int("workers", self.workers, 1, "ParallelInference.builder(model).workers(2)")
        check_int("batch_limit", self.batch_limit, 1, "the most samples in one forward pass, e.g. .batch_limit(32)")
        check_int("queue_limit", self.queue_limit, 1, "the most requests waiting for a worker, e.g. .queue_limit(64)")
        if not (isinstance(self.max_wait_ms, (int, float)) and math.isfinite(self.max_wait_ms) and self.max_wait_ms >= 0):
            raise ValueError(f"max_wait_ms must be a number of milliseconds >= 0, e.g. .max_wait_ms(2); got {self.max_wait_ms!r}")
        if self.input_shape is not None and not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.input_shape):
            raise ValueError(f"input_shape is one sample's shape, sizes >= 0, e.g. .input_shape(1, 28, 28); got {self.input_shape!r}")
        if self.threads_per_worker is not None:
            check_int("threads_per_worker", self.threads_per_worker, 1, "or leave it unset to share the cores out")
        for d in self.devices or ():
            try:
                torch.device(d)
            except RuntimeError as e:
                raise ValueError(f"devices: {d!r} is not a torch device ({e})") from None
        if self.devices is not None and self.workers is not None and len(self.devices) != self.workers:
            raise ValueError(
                f"devices names {len(self.devices)} devices for {self.workers} workers; give one device per worker, "
                f"e.g. .devices({['cpu'] * self.workers}), or leave .workers() out to take one per device"
            )


def placement(config: InferenceConfig) -> Placement:
    """Where the workers run (devices, threads), as training places its workers (env.resolve)."""
    workers = config.workers or (len(config.devices) if config.devices else max(1, gpu_count()))
    # The training config carries the options the placement reads; its other fields stay at their defaults.
    return resolve(Config(workers=workers, devices=config.devices, threads_per_worker=config.threads_per_worker))


__all__ = ["InferenceConfig", "InferenceMode", "placement"]
