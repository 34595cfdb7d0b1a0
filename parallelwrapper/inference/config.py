"""What a ParallelInference is built from: its modes, the frozen `InferenceConfig`, and where its workers run.

The config is validated on construction with the fix in the message; the training's placement
(env.resolve) decides where the workers run: GPU i for worker i when there are GPUs, else the CPU
with the cores shared out among the workers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..config import Config, check_devices
from ..env import Placement, gpu_count, resolve
from ..registry import Declared, count, declared, instance, number, option, validate


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
    """The options of `ParallelInference.builder(model)`, each declared once (registry.option) as
    the training's are: its default, what it does, what a value must be, its setter
    (inference/settings.py) and `pw-fit predict`'s flag. Validated on construction: each value by
    its declaration, then what one value's check cannot say."""

    workers: int | None = option(
        None, "Workers, one process and device each (inplace: replicas in this process); None: one per GPU, or 1 without one.",
        count(1, optional=True), "workers", example=2, flag="--workers")
    devices: tuple[str, ...] | None = option(
        None, "One device per worker; None: cuda:i for worker i when there are GPUs, else the CPU.",
        instance(tuple, optional=True), "devices", example=("cpu", "cpu"))
    inference_mode: InferenceMode = option(
        InferenceMode.BATCHED, "batched: requests waiting while the workers are busy go together; sequential: one at a time; inplace: in this process.",
        instance(InferenceMode), "inference_mode", example=InferenceMode.SEQUENTIAL, flag="--inference-mode")
    batch_limit: int = option(
        32, "batched: the most samples in one forward pass (a larger request goes alone).",
        count(1), "batch_limit", example=64, flag="--batch-limit")
    queue_limit: int = option(
        64, "Requests waiting for a worker, at most; submit() blocks beyond.",
        count(1), "queue_limit", example=128)
    max_wait_ms: float = option(
        2.0, "batched: milliseconds a batch may wait for more requests when a worker is free.",
        number(0), "max_wait_ms", example=5.0)
    input_shape: tuple[int, ...] | None = option(
        None, "One sample's shape; None: every input is a batch.",
        instance(tuple, optional=True), "input_shape", example=(1, 28, 28))
    threads_per_worker: int | None = option(
        None, "torch threads in each worker (None: the cores shared out among the workers).",
        count(1, optional=True), "threads_per_worker", example=1)

    def __post_init__(self) -> None:
        validate(self)
        if self.input_shape is not None and not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.input_shape):
            raise ValueError(f"input_shape is one sample's shape, sizes >= 0, e.g. .input_shape(1, 28, 28); got {self.input_shape!r}")
        check_devices(self.devices)
        if self.devices is not None and self.workers is not None and len(self.devices) != self.workers:
            raise ValueError(
                f"devices names {len(self.devices)} devices for {self.workers} workers; give one device per worker, "
                f"e.g. .devices({['cpu'] * self.workers}), or leave .workers() out to take one per device"
            )


INFERENCE_OPTIONS: dict[str, Declared] = {d.name: d for d in declared(InferenceConfig)}  # serving's options, by name, as declared


def placement(config: InferenceConfig) -> Placement:
    """Where the workers run (devices, threads), as training places its workers (env.resolve)."""
    workers = config.workers or (len(config.devices) if config.devices else max(1, gpu_count()))
    # The training config carries the options the placement reads; its other fields stay at their defaults.
    return resolve(Config(workers=workers, devices=config.devices, threads_per_worker=config.threads_per_worker))


__all__ = ["INFERENCE_OPTIONS", "InferenceConfig", "InferenceMode", "placement"]
