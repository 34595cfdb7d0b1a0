"""Scoring a model on batches without training it: the sample-weighted sums of per-batch metrics, in eval mode.
The workers' validation and `ParallelWrapper.evaluate` both score this way, and
both default to the same metrics for `(inputs, targets)` batches; `check_validation` tries a
validation on its first batch before training starts."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import SupportsFloat

import torch

from .batches import batch_size, describe, move_to
from .feed.data import epoch_iterable
from .job import Job, OutputLoss
from .types import Batch, Output

Values = dict[str, SupportsFloat]  # {name: batch mean}: numbers, or tensors of one element
Metrics = Callable[[torch.nn.Module, Batch], Values]  # (model, batch) -> {name: batch mean}


def classification_metrics(model: torch.nn.Module, batch: Batch, loss_fn: Callable[..., torch.Tensor] | None) -> Values:
    """The mean loss (with a loss function) and the share of argmax(outputs) == targets: for a
    classifier, whose outputs are class scores (batch, classes, ...) for targets of class indices
    (batch, ...), as cross_entropy takes them. Other outputs are a ValueError that says to pass a
    validation step of one's own."""
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise ValueError(
            f"the default metrics score (inputs, targets) batches, got a {type(batch).__name__} {describe(batch)}; for a model "
            f"that computes its own loss build with .loss_from_output(), else pass a step fn(model, batch) -> {{name: value}}: "
            f".validation(data, step=fn) or evaluate(data, step=fn)"
        )
    inputs, targets = batch
    return scored_outputs(model(inputs), targets, loss_fn)


def output_metrics(model: torch.nn.Module, batch: Batch, step: OutputLoss) -> Values:
    """Of a model that computes its own loss (`.loss_from_output()`): that loss and, where the
    output has `logits` and the batch `labels` of the logits' shape less the last dimension, the
    share of argmax(logits) == labels over the labels that count (-100, Hugging Face's ignored
    label, left out)."""
    output = step.outputs(model, batch)
    metrics: Values = {"loss": step.loss(output)}
    logits, labels = OutputLoss.get(output, "logits"), OutputLoss.get(batch, "labels") if isinstance(batch, Mapping) else None
    if isinstance(logits, torch.Tensor) and isinstance(labels, torch.Tensor) and logits.shape[:-1] == labels.shape:
        counted = labels != -100
        hits = (logits.argmax(dim=-1) == labels) & counted
        metrics["accuracy"] = int(hits.sum()) / max(1, int(counted.sum()))  # in float64: 9,700 of 10,000 is 0.97, not float32's 0.96999...
    return metrics


def job_metrics(job: Job) -> Metrics:
    """The metrics a job scores by default, unprefixed: its own loss and accuracy
    (`output_metrics`) for a model that computes its loss, else `classification_metrics`."""
    if isinstance(job.training_step, OutputLoss):
        return functools.partial(output_metrics, step=job.training_step)
    return functools.partial(classification_metrics, loss_fn=job.loss_fn)


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
    hits = outputs.argmax(dim=1) == targets
    metrics: Values = {"accuracy": int(hits.sum()) / max(1, hits.numel())}  # in float64, as above
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


def _default_validation(model: torch.nn.Module, batch: Batch, metrics: Metrics) -> Values:
    return validation_of(metrics(model, batch))


def validation_of(metrics: Values) -> Values:
    """The default validation's names for classification_metrics: val_loss, val_accuracy."""
    return {f"val_{name}": value for name, value in metrics.items()}


def validation_metrics(job: Job) -> Metrics:
    """What a validation scores: the job's validation step, or val_loss and val_accuracy."""
    if job.validation_step is not None:
        return job.validation_step
    return functools.partial(_default_validation, metrics=job_metrics(job))


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


__all__ = ["autocast", "check_validation", "classification_metrics", "job_metrics", "metric_sums", "output_metrics", "scored_outputs", "validation_metrics", "validation_of"]
