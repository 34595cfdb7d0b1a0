"""Scoring a model on batches, without training it: the sample-weighted sums of per-batch metrics,
in eval mode. The workers' validation and `ParallelWrapper.evaluate` both score this way, and
both default to the same metrics for `(inputs, targets)` batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .batches import batch_size, move_to

Metrics = Callable[[torch.nn.Module, Any], dict[str, Any]]  # (model, batch) -> {name: batch mean}


def classification_metrics(model: torch.nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor] | None) -> dict[str, Any]:
    """The mean loss (with a loss function) and the share of argmax(outputs) == targets."""
    inputs, targets = batch
    outputs = model(inputs)
    metrics = {"accuracy": (outputs.argmax(dim=1) == targets).float().mean()}
    return metrics if loss_fn is None else {"loss": loss_fn(outputs, targets), **metrics}


@torch.no_grad()
def metric_sums(
    model: torch.nn.Module,
    batches: Iterable[Any],
    metrics: Metrics,
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[dict[str, float], int]:
    """Σ metric·n per metric and Σ n over `batches`, each moved to `device` and scored in eval mode
    under `context` (autocast, say); the model's mode is restored after."""
    sums: dict[str, float] = {}
    count = 0
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            n = batch_size(batch)
            with context():
                values = metrics(model, move_to(batch, device))
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + float(value) * n
            count += n
    finally:
        model.train(was_training)
    return sums, count


__all__ = ["classification_metrics", "metric_sums"]
