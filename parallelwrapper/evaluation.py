"""Scoring a model on batches without training it: the sample-weighted sums of per-batch metrics, in eval mode.
The workers' validation and `ParallelWrapper.evaluate` both score this way, and
both default to the same metrics for `(inputs, targets)` batches; `check_validation` tries a
validation on its first batch before training starts."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import SupportsFloat

import torch

from .batches import batch_size, describe, move_to
from .feed.data import epoch_iterable
from .job import Job
from .types import Batch, Output

Values = dict[str, SupportsFloat]  # {name: batch mean}: numbers, or tensors of one element
Metrics = Callable[[torch.nn.Module, Batch], Values]  # (model, batch) -> {name: batch mean}


def classification_metrics(model: torch.nn.Module, batch: Batch, loss_fn: Callable[..., torch.Tensor] | None) -> Values:
    """The mean loss (with a loss function) and the share of argmax(outputs) == targets: for a
    classifier, whose outputs are class scores (batch, classes, ...) for targets of class indices
    (batch, ...), as cross_entropy takes them. Other outputs are a ValueError that says to pass a
    validation step of one's own."""
    inputs, targets = batch
    return scored_outputs(model(inputs), targets, loss_fn)


def scored_outputs(outputs: Output, targets: object, loss_fn: Callable[..., torch.Tensor] | None) -> Values:
    """classification_metrics of a batch's outputs, however they were computed (a pipeline's
    last stage has them, not the model)."""
    classifier = (
        isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() >= 2
        and outputs.shape[0] == targets.shape[0] and outputs.shape[2:] == targets.shape[1:]
    )  # fmt: skip
    if not classifier:
        raise ValueError(
            f"the default validation scores a classifier, whose outputs are class scores (batch, classes, ...) for "
            f"targets (batch, ...); the model returned {describe(outputs)} for targets {describe(targets)}: pass "
            f".validation(data, step=fn) with fn(model, batch) -> {{name: value}}"
        )
    metrics = {"accuracy": (outputs.argmax(dim=1) == targets).float().mean()}
    return metrics if loss_fn is None else {"loss": loss_fn(outputs, targets), **metrics}


@torch.no_grad()
def metric_sums(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    metrics: Metrics,
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
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


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16-mixed and 16-mixed: forward and loss in bfloat16 or float16 where autocast deems it
    safe; the parameters, their gradients, the optimizer and the averaging stay float32."""
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _default_validation(model: torch.nn.Module, batch: Batch, loss_fn: Callable[..., torch.Tensor] | None) -> Values:
    return validation_of(classification_metrics(model, batch, loss_fn))


def validation_of(metrics: Values) -> Values:
    """The default validation's names for classification_metrics: val_loss, val_accuracy."""
    return {f"val_{name}": value for name, value in metrics.items()}


def validation_metrics(job: Job) -> Metrics:
    """What a validation scores: the job's validation step, or val_loss and val_accuracy."""
    if job.validation_step is not None:
        return job.validation_step
    return functools.partial(_default_validation, loss_fn=job.loss_fn)


def check_validation(job: Job, model: torch.nn.Module, precision: str) -> None:
    """Score the validation data's first batch on `model` in this process, as a worker would
    (eval mode, no gradients, the precision's autocast), before any worker trains: data the step
    cannot score fails fit() at its start, named, instead of at the first validation."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    batch = next(iter(epoch_iterable(job.validation_data)()), None)
    if batch is None:
        raise ValueError("validation: the validation data yielded no batch; pass .validation(data) with at least one")
    try:
        metric_sums(model, [batch], validation_metrics(job), device, functools.partial(autocast, precision, device))
    except Exception as e:  # any failure here is the validation's, reported as such
        cause = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(
            f"validation: batch 0 {describe(batch)} fails before training starts: {type(e).__name__}: {cause}; "
            f"fix the validation data or its step (.validation(data, step=fn))"
        ) from e


__all__ = ["autocast", "check_validation", "classification_metrics", "metric_sums", "scored_outputs", "validation_metrics", "validation_of"]
