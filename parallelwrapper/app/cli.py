"""`pw-fit`: train on MNIST, compare synchronisation schemes (`pw-fit compare`) or score a saved model (`pw-fit predict`).

Parsing only: the work is `run.train_mnist` and `compare.compare`. Errors in the input (a bad
option, a missing data directory) become click errors, without a traceback.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from parallelwrapper import PAYLOAD_DTYPES, PIPELINE_SCHEDULES, PRECISIONS, CheckpointError, InferenceError, InferenceMode, TrainingMode, WorkerError
from parallelwrapper.checkpoint import peek

from .compare import CompareOptions, compare
from .mnist import MnistFilesMissing
from .models import MODEL_NAMES
from .options import DEVICES, LR_SCHEDULES, OPTIMIZERS, RunOptions
from .predict import PredictOptions, predict_mnist
from .run import train_mnist

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_LR_DEFAULTS = ", ".join(f"{name} {choice.default_lr:g}" for name, choice in OPTIMIZERS.items())


def _run_options(f: F) -> F:
    """The options `pw-fit` and `pw-fit compare` share; the first four mirror the builder."""
    options = [
        click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="Workers, one process and device each; one worker on the CPU trains in this process."),
        click.option("--prefetch-buffer", type=click.IntRange(min=1), default=24, show_default=True, help="Batches read ahead into the spawned workers' shared queue."),
        click.option("--report-score-after-averaging/--no-report-score-after-averaging", default=True, show_default=True, help="Report the averaged score after every averaging, or once per epoch."),
        click.option("--average-updaters/--no-average-updaters", default=True, show_default=True, help="Average optimizer state (momentum, Adam moments) with the parameters."),
        click.option("--average-updaters-every", type=click.IntRange(min=1), default=1, show_default=True, help="With --average-updaters: the optimizer state travels every M-th round only (DES-LOC), and at every epoch's end, checkpoint, validation and stop; each worker keeps its own in between."),
        click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True),
        click.option("--batch-size", type=click.IntRange(min=1), default=128, show_default=True, help="Samples per batch (one worker step)."),
        click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None, help=f"Learning rate. Default per optimizer: {_LR_DEFAULTS}."),
        click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)), default="nesterov", show_default=True, help="nesterov: SGD, momentum 0.9, Nesterov (DL4J's NESTEROVS)."),
        click.option("--model", type=click.Choice(list(MODEL_NAMES)), default="lenet", show_default=True, help="lenet: DL4J's LeNet; mlp: a small MLP."),
        click.option("--device", type=click.Choice(list(DEVICES)), default="auto", show_default=True, help="auto: the GPUs when there are any (shared round-robin, over gloo, when the workers outnumber them), else the CPU; cuda: the same, or an error without a GPU."),
        click.option("--seed", type=int, default=123, show_default=True, help="Model init, shuffling and worker RNGs."),
        click.option("--clip-grad-norm", type=click.FloatRange(min=0, min_open=True), default=None, help="Clip each step's gradients to this total norm (default: no clipping)."),
        click.option("--precision", type=click.Choice(list(PRECISIONS)), default="32", show_default=True, help="bf16-mixed: forward and loss under autocast to bfloat16; weights and averaging stay float32."),
        click.option("--data-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None, help="Directory of the MNIST IDX files (gzipped or not). Default: the cache dir ($PW_DATA_DIR or ~/.cache/parallelwrapper/mnist)."),
        click.option("--download/--no-download", default=True, show_default=True, help="Download MNIST files missing from the data dir."),
        click.option("--train-samples", type=click.IntRange(min=1), default=None, help="Train on the first N training images only (for smoke tests)."),
        click.option("--test-samples", type=click.IntRange(min=1), default=None, help="Evaluate on the first N test images only (for smoke tests)."),
        click.option("--outer-lr", type=click.FloatRange(min=0, min_open=True), default=None, help="DiLoCo/SlowMo: after each averaging, step an outer SGD at this learning rate on the round's change (1 with no momentum: plain averaging). Default: off."),
        click.option("--outer-momentum", type=click.FloatRange(min=0, max=1, max_open=True), default=0.0, show_default=True, help="The outer SGD's Nesterov momentum (needs --outer-lr)."),
        click.option("--warmup-sync-steps", type=click.IntRange(min=0), default=0, show_default=True, help="Post-local SGD: share gradients every step for the first N steps, then average every --averaging-frequency."),
        click.option("--overlap-averaging/--no-overlap-averaging", default=False, show_default=True, help="Run each averaging in the background during the next round's steps (averaging mode only; in pw-fit compare, its averaging runs)."),
        click.option("--fragments", type=click.IntRange(min=1), default=1, show_default=True, help="Average the state in N fragments of about equal bytes, each sent at its own point of the round and landed a round later (needs --overlap-averaging in pw-fit; pw-fit compare's averaging runs overlap with N > 1)."),
        click.option("--gradient-threshold", type=click.FloatRange(min=0, min_open=True), default=None, help="Shared gradients threshold-encoded (DL4J, Strom 2015): only entries of lr x gradient past this τ are sent, τ then adapting (needs --mode shared-gradients; in pw-fit compare, the τ its --encoded run starts from, default 1e-3). Default: dense."),
        click.option("--payload-dtype", type=click.Choice(list(PAYLOAD_DTYPES)), default="float32", show_default=True, help="What an averaging sends: bfloat16/float16 send the change since the last average cast, int8/int4 block-quantized (a scale per 256 numbers); what is lost goes with the next round."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def _make(cls: Callable[..., T], **kwargs: Any) -> T:
    """Options whose combination the library rejects are usage errors."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _call(fn: Callable[..., T], *args: Any) -> T:
    """Run the library; a data or worker failure becomes a one-message error."""
    try:
        return fn(*args)
    except MnistFilesMissing as e:
        raise click.ClickException(e.explain("pass --data-dir DIR", "drop --no-download to fetch them")) from None
    except (ValueError, WorkerError, InferenceError) as e:  # MnistError is a ValueError: it names the file
        raise click.ClickException(str(e)) from None
    except ImportError as e:  # an optional extra (--tensorboard): the message names the package to install
        raise click.ClickException(str(e)) from None


class _KOrAuto(click.ParamType):  # type: ignore[type-arg]
    """An averaging frequency: an int >= 1, or "auto"."""

    name = "k|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if value == "auto":
            return "auto"
        try:
            k = int(value)
        except (TypeError, ValueError):
            k = 0
        if k < 1:
            self.fail(f"{value!r}: an averaging frequency is an integer >= 1 or 'auto'", param, ctx)
        return k


_K = _KOrAuto()


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@_run_options
@click.option("--averaging-frequency", type=_K, default="3", show_default=True, help="Local iterations per worker between averagings, or auto: the autopilot chooses k (1 to 64), the payload and the optimizer state's period from the measured step and exchange times (a --payload-dtype or --average-updaters-every other than its default is kept).")
@click.option("--mode", type=click.Choice([m.value for m in TrainingMode]), default=TrainingMode.AVERAGING.value, show_default=True, help="averaging: local steps, then average; shared-gradients: average gradients every step.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="Write metrics.jsonl, summary.json and model.pt here.")
@click.option("--tensorboard", type=click.Path(file_okay=False, path_type=Path), default=None, help="Write the scores, validations, epoch figures, learning rate and replacements here as TensorBoard scalars (needs the tensorboard package: pip install tensorboard). Default: off.")
@click.option("--deterministic/--no-deterministic", default=False, show_default=True, help="Deal batch i to worker i mod N: the same run gives the same model, and a resumed run ends as an uninterrupted one.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Save a checkpoint here every --checkpoint-every rounds, at each epoch's end and on Ctrl-C.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=50, show_default=True, help="Rounds between checkpoints.")
@click.option("--resume", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None, help="Continue the run whose checkpoint is in this directory (same options; --epochs counts from the run's start).")
@click.option("--val-every", type=click.IntRange(min=0), default=0, show_default=True, help="Also validate on the test set every N averagings (0: at each epoch's end only); val_loss and val_accuracy go to the progress bar and metrics.jsonl.")
@click.option("--lr-schedule", type=click.Choice(list(LR_SCHEDULES)), default="none", show_default=True, help="step: lr x 0.7 after each epoch; cosine: anneal to 0 over the run; onecycle: warm up to --lr and anneal, over the run (steps: ceil(batches / workers) an epoch).")
@click.option("--replace-workers", type=click.IntRange(min=0), default=0, show_default=True, help="Replace a worker that fails (an error, a death, a stall) up to N times: every worker goes back to the last average and its round's batches are trained again (0: a failure ends the run).")
@click.option("--stages", type=click.IntRange(min=1), default=1, show_default=True, help="Model parallelism: each worker a pipeline of N stage processes, each holding about 1/N of the model and its optimizer state, averaged stage by stage (1: no pipeline). --workers 2 --stages 2 runs 4 processes.")
@click.option("--microbatches", type=click.IntRange(min=1), default=1, show_default=True, help="With --stages: cut each batch into M microbatches for the pipeline's schedule (1F1B runs GPipe when M < stages).")
@click.option("--schedule", type=click.Choice(list(PIPELINE_SCHEDULES)), default="1f1b", show_default=True, help="With --stages: the pipeline's schedule; zbv (zero bubble, V) has each stage hold two pieces of the model and fills the bubbles with weight gradients.")
@click.option("--early-stopping-patience", type=click.IntRange(min=1), default=None, help="Stop when val_loss has not improved for this many validations (needs --val-every). Default: off.")
@click.pass_context
def main(ctx: click.Context, /, mode: str, **kwargs: Any) -> None:
    """Train a model on MNIST with a ParallelWrapper (DL4J's multi-GPU LeNet example by default),
    showing where the workers run (devices, backend), the averaged score, each epoch's mean
    training loss and test accuracy and, at the end, the test accuracy, samples per second while
    training and over the wall time. With checkpoints, Ctrl-C prints the command that resumes.

    `pw-fit compare --help` compares shared gradients against averaging frequencies;
    `pw-fit predict --help` scores a saved model with parallel inference workers."""
    if ctx.invoked_subcommand is not None:
        given = [f"--{name.replace('_', '-')}" for name in ctx.params if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{', '.join(given)} given before '{ctx.invoked_subcommand}': options go after the command, e.g. pw-fit compare --workers 2")
        return
    if kwargs["gradient_threshold"] is not None and mode != TrainingMode.SHARED_GRADIENTS.value:
        raise click.UsageError("--gradient-threshold encodes shared gradients: add --mode shared-gradients")
    options = _make(RunOptions, mode=TrainingMode(mode), **kwargs)
    try:
        summary = _call(train_mnist, options)
    except KeyboardInterrupt:
        saved = options.checkpoint_dir or options.resume
        if saved is None:
            raise  # nothing to resume from: click says "Aborted!"
        click.echo(f"\n{_resume_hint(ctx, saved)}", err=True)  # below the progress bar's line
        ctx.exit(130)  # as a shell reports a process that SIGINT ended
    click.echo(summary.describe())


def _resume_hint(ctx: click.Context, directory: Path) -> str:
    """Where an interrupted run's checkpoint is, and the command that carries on from it: this
    one's options as given, with --resume."""
    try:
        at = peek(directory)
    except CheckpointError:
        return f"Interrupted before the first checkpoint was saved in {directory}: nothing to resume, run the command again."
    args = [ctx.command_path]
    for param in ctx.command.params:
        name = param.name or ""
        if name == "resume" or ctx.get_parameter_source(name) is ParameterSource.DEFAULT:
            continue
        value = ctx.params[name]
        if isinstance(param, click.Option) and param.is_flag:
            args.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            args += [param.opts[0], str(value)]
    return (
        f"Interrupted: the checkpoint in {directory} holds epoch {at['epoch']}, {at['position']} batches in "
        f"({at['rounds']} averagings). Carry on with:\n  {shlex.join([*args, '--resume', str(directory)])}"
    )


def _frequencies(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int | str, ...]:
    try:
        ks = tuple(k.strip() if k.strip() == "auto" else int(k) for k in value.split(",") if k.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers or auto, e.g. 1,4,16,auto") from None
    if any(k != "auto" and int(k) < 1 for k in ks) or len(set(ks)) != len(ks):
        raise click.BadParameter(f"{value!r}: averaging frequencies are distinct integers >= 1 or auto, e.g. 1,4,16,auto")
    return ks


@main.command(name="compare")
@_run_options
@click.option("--frequencies", default="1,4,16", show_default=True, callback=_frequencies, help="Averaging frequencies k to run, comma-separated; auto races the autopilot (first-come, steered by measured times) and plots its k.")
@click.option("--shared-gradients/--no-shared-gradients", default=True, show_default=True, help="Also run shared gradients (averaged every step).")
@click.option("--encoded/--no-encoded", default=False, show_default=True, help="Also run shared gradients threshold-encoded, τ starting at --gradient-threshold (default 1e-3); its bytes are those it sent.")
@click.option("--evals", type=click.IntRange(min=1), default=8, show_default=True, help="Test-set evaluations per epoch (the points of each curve).")
@click.option("--target", type=click.FloatRange(min=0, max=1, min_open=True), default=0.97, show_default=True, help="Accuracy whose samples and seconds to reach are tabled.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/compare"), show_default=True, help="Write compare.csv, compare.md and compare.png here.")
def compare_command(frequencies: tuple[int | str, ...], shared_gradients: bool, encoded: bool, evals: int, target: float, out: Path, **kwargs: Any) -> None:  # fmt: skip
    """Train the same model from the same weights on the same data with shared gradients and
    with averaging at several frequencies (and, with --outer-lr, each frequency again with the
    outer optimizer); table and plot test accuracy against samples and seconds, and the bytes
    each sends per worker."""
    base = _make(RunOptions, **kwargs)
    if base.average_updaters_every != 1:  # its bytes are computed (communication.py) for the state in every round
        raise click.UsageError("pw-fit compare computes each run's bytes with the optimizer state in every round: drop --average-updaters-every")
    options = _make(
        CompareOptions, base=base, frequencies=frequencies, shared_gradients=shared_gradients, encoded=encoded,
        evals_per_epoch=evals, target_accuracy=target, out=out,
    )  # fmt: skip
    _call(compare, options)
    click.echo(f"wrote {out / 'compare.csv'}, {out / 'compare.md'}, {out / 'compare.png'}")


@main.command(name="predict")
@click.option("--model-path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True, help="The state dict to score, as pw-fit --out DIR saves it (DIR/model.pt).")
@click.option("--model", type=click.Choice(list(MODEL_NAMES)), default="lenet", show_default=True, help="The architecture it was trained as.")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="Inference workers, one process and device each.")
@click.option("--mode", type=click.Choice([m.value for m in InferenceMode]), default=InferenceMode.BATCHED.value, show_default=True, help="batched: requests waiting while the workers are busy go together; sequential: one at a time; inplace: in this process.")
@click.option("--request-size", type=click.IntRange(min=1), default=1, show_default=True, help="Test images per request (1: single images, as a server gets them).")
@click.option("--batch-limit", type=click.IntRange(min=1), default=32, show_default=True, help="batched: the most images in one forward pass.")
@click.option("--device", type=click.Choice(list(DEVICES)), default="auto", show_default=True, help="auto: the GPUs when there are any, else the CPU.")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None, help="Directory of the MNIST IDX files. Default: the cache dir ($PW_DATA_DIR or ~/.cache/parallelwrapper/mnist).")
@click.option("--download/--no-download", default=True, show_default=True, help="Download MNIST files missing from the data dir.")
@click.option("--test-samples", type=click.IntRange(min=1), default=None, help="Score the first N test images only (for smoke tests).")
def predict_command(**kwargs: Any) -> None:
    """Score a saved model on the MNIST test set with a ParallelInference of N workers: print
    where they run, the test accuracy and the samples per second (start-up excluded)."""
    options = _make(PredictOptions, **kwargs)
    click.echo(_call(predict_mnist, options, click.echo).describe())


__all__ = ["main"]
