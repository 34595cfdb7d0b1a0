"""The setters of `ParallelInference.builder(model)`, after DL4J's `ParallelInference.Builder`: one per option.

Each option is declared in inference/config.py (its default, meaning and check); each setter says
what it does. They only record what they are given; `InferenceBuilder.build()`
(server.py) validates the whole and starts the workers."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

if sys.version_info >= (3, 11):
    from typing import Self
else:  # Python 3.10: typing_extensions comes with torch
    from typing_extensions import Self

from ..config import parse_enum
from ..registry import end_with_defaults
from .config import INFERENCE_OPTIONS, InferenceMode


class InferenceSettings:
    """The builder's setters: each sets one option of the InferenceConfig and returns the builder."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ParallelInference.builder() takes a torch.nn.Module, got {type(model).__name__}")
        self._model = model
        self._options: dict[str, Any] = {}  # InferenceConfig's options set so far, by name

    def workers(self, n: int) -> Self:
        """Workers, one process and device each (INPLACE: replicas in this process); None: one per
        GPU, or 1 on a machine without one (the CPU is one device: DL4J's default)."""
        self._options["workers"] = n
        return self

    def devices(self, devices: Sequence[str | torch.device]) -> Self:
        """One device per worker, e.g. ["cuda:0", "cuda:1"] or ["cpu", "cpu"]; None: cuda:i for
        worker i when there are GPUs (shared round-robin when workers outnumber them), else the CPU,
        whose cores the workers share out (.threads_per_worker)."""
        if isinstance(devices, (str, torch.device)):
            raise TypeError(f"devices takes one device per worker, e.g. .devices(['cpu', 'cpu']); got {devices!r}")
        self._options["devices"] = tuple(str(d) for d in devices)
        return self

    def inference_mode(self, mode: InferenceMode | str) -> Self:
        """InferenceMode.BATCHED, SEQUENTIAL or INPLACE (see InferenceMode)."""
        self._options["inference_mode"] = parse_enum(InferenceMode, mode, "inference_mode")
        return self

    def batch_limit(self, n: int) -> Self:
        """BATCHED: the most samples in one forward pass; a request larger than that goes alone,
        never split."""
        self._options["batch_limit"] = n
        return self

    def queue_limit(self, n: int) -> Self:
        """The most requests waiting for a worker; `submit` and `output` block while it is
        reached (back-pressure: a request is never dropped)."""
        self._options["queue_limit"] = n
        return self

    def max_wait_ms(self, ms: float) -> Self:
        """BATCHED: how long the oldest waiting request may wait for others to fill its batch
        when a worker is free, in milliseconds. 0: a free worker takes what is there."""
        self._options["max_wait_ms"] = ms
        return self

    def input_shape(self, *shape: int) -> Self:
        """One sample's shape, e.g. .input_shape(1, 28, 28): an input of that shape is one sample
        (its answer has no batch dimension), one of (B, *shape) a batch, any other fails its request
        at once. None: every input is a batch (B, ...)."""
        self._options["input_shape"] = tuple(shape)
        return self

    def threads_per_worker(self, n: int) -> Self:
        """torch threads in each worker process; None: the machine's cores divided among the workers."""
        self._options["threads_per_worker"] = n
        return self



end_with_defaults(InferenceSettings, INFERENCE_OPTIONS.values())

__all__ = ["InferenceSettings"]
