"""`pw-fit`: train on MNIST, compare synchronisation schemes (`pw-fit compare`) or score a saved model (`pw-fit predict`).

Parsing only: the work is `run.train_mnist` and `compare.compare`. Errors in the input (a bad
option, a missing data directory) become click errors, without a traceback.
"""

from __future__ import annotations

import enum
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from parallelwrapper import INFERENCE_OPTIONS, OPTIONS, Autopilot, CheckpointError, GradientEncoding, InferenceError, Pipeline, WorkerError, checkpoint_counters, declared

from .compare import CompareOptions, compare
from .mnist import MnistFilesMissing
from .models import MODEL_NAMES
from .options import DEVICES, FIT_CONFIG, LR_SCHEDULES, OPTIMIZERS, RunOptions
from .predict import PredictOptions, predict_mnist
from .run import train_mnist

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_PIPELINE = {d.name: d for d in declared(Pipeline)}  # .pipeline(...)'s parts: --stages and its flags
_ENCODING = {d.name: d for d in declared(GradientEncoding)}  # .gradient_encoding(...)'s: --gradient-threshold
_TAU = f"{_ENCODING['threshold'].default:g}"  # the encoded run's τ by default
_LR_DEFAULTS = ", ".join(f"{name} {choice.default_lr:g}" for name, choice in OPTIMIZERS.items())


def _ruled(rule: Callable[[object], str | None], value: Any) -> Any:
    problem = None if value is None else rule(value)
    if problem is not None:
        raise click.BadParameter(f"{value!r} is not {problem}")
    return value


def _declared(name: str, extra: str = "", options: Mapping[str, Any] = OPTIONS, **override: Any) -> Callable[[F], F]:
    """pw-fit's flag for the library's option `name`, made from its declaration (the training's
    parallelwrapper.OPTIONS, or serving's INFERENCE_OPTIONS): the flag, its help (then `extra`,
    what pw-fit adds), the values it takes, and its default, pw-fit's (FIT_CONFIG: DL4J's
    example's k and seed); `override` where the flag's own differ."""
    d = options[name]
    check, flag = d.option.check, d.option.flag
    assert flag is not None, f"{name} has no pw-fit flag in its declaration"
    default = override.pop("default", getattr(FIT_CONFIG, name) if options is OPTIONS else d.default)
    kwargs: dict[str, Any] = {"show_default": default is not None, "help": f"{d.option.help} {extra}".strip()}
    decls = [f"{flag}/--no-{flag.removeprefix('--')}"] if check.boolean else [flag]
    if check.rule is not None:  # e.g. a payload name, sparse:D among them: the help shows the declaration's examples
        kwargs["metavar"] = "[" + "|".join(str(c) for c in check.choices) + "]"
        kwargs["callback"] = lambda ctx, param, value: _ruled(check.rule, value)
    elif check.choices:
        kwargs["type"] = click.Choice([str(c) for c in check.choices])
    elif check.integer:
        kwargs["type"] = int if check.minimum is None else click.IntRange(min=check.minimum)
    elif check.positive:
        kwargs["type"] = click.FloatRange(min=0, min_open=True)
    elif isinstance(default, enum.Enum):
        kwargs["type"], default = click.Choice([m.value for m in type(default)]), default.value
    return click.option(*decls, default=default, **{**kwargs, **override})


# pw-fit's own flags that pw-fit predict takes too, written once.
_MODEL = click.option("--model", type=click.Choice(list(MODEL_NAMES)), default="lenet", show_default=True, help="lenet: DL4J's LeNet; mlp: a small MLP (predict: the one it was trained as).")
_DEVICE = click.option("--device", type=click.Choice(list(DEVICES)), default="auto", show_default=True, help="auto: the GPUs when there are any (shared round-robin when the workers outnumber them), else the CPU; cuda: the same, or an error without a GPU.")
_DATA_DIR = click.option("--data-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None, help="Directory of the MNIST IDX files (gzipped or not). Default: the cache dir ($PW_DATA_DIR or ~/.cache/parallelwrapper/mnist).")
_DOWNLOAD = click.option("--download/--no-download", default=True, show_default=True, help="Download MNIST files missing from the data dir.")
_TEST_SAMPLES = click.option("--test-samples", type=click.IntRange(min=1), default=None, help="Evaluate (predict: score) the first N test images only (for smoke tests).")  # fmt: skip


def _run_options(f: F) -> F:
    """The options `pw-fit` and `pw-fit compare` share: the builder's as declared, then the run's."""
    options = [
        _declared("workers"),
        _declared("prefetch_buffer"),
        _declared("report_score_after_averaging"),
        _declared("average_updaters"),
        _declared("average_updaters_every"),
        click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True),
        click.option("--batch-size", type=click.IntRange(min=1), default=128, show_default=True, help="Samples per batch (one worker step)."),
        click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None, help=f"Learning rate. Default per optimizer: {_LR_DEFAULTS}."),
        click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)), default="nesterov", show_default=True, help="nesterov: SGD, momentum 0.9, Nesterov (DL4J's NESTEROVS)."),
        _MODEL,
        _DEVICE,
        _declared("seed", "pw-fit also seeds the model's initial weights and the shuffling with it."),
        _declared("gradient_clipping"),
        _declared("accumulate"),
        _declared("precision"),
        _DATA_DIR,
        _DOWNLOAD,
        click.option("--train-samples", type=click.IntRange(min=1), default=None, help="Train on the first N training images only (for smoke tests)."),
        _TEST_SAMPLES,
        click.option("--outer-lr", type=click.FloatRange(min=0, min_open=True), default=None, help="DiLoCo/SlowMo: after each averaging, step an outer SGD at this learning rate on the round's change (1 with no momentum: plain averaging). Default: off."),
        click.option("--outer-momentum", type=click.FloatRange(min=0, max=1, max_open=True), default=0.0, show_default=True, help="The outer SGD's Nesterov momentum (needs --outer-lr)."),
        _declared("warmup_sync_steps"),
        _declared("overlap_averaging", "In pw-fit compare: its averaging runs."),
        _declared("fragments", "In pw-fit compare, its averaging runs overlap with N > 1."),
        _declared("threshold", f"Needs --training-mode shared-gradients; in pw-fit compare, the τ its --encoded run starts from (default {_TAU}). Default: dense.", _ENCODING, default=None),
        _declared("payload_dtype"),
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
@_declared("averaging_frequency", "Or auto: the autopilot chooses k (1 to 128), the payload, the optimizer state's period and, as its last resort, overlap, from the measured step and exchange times (a --payload-dtype or --average-updaters-every other than its default is kept).", type=_K)
@_declared("training_mode")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="Write metrics.jsonl, summary.json and model.pt here.")
@click.option("--tensorboard", type=click.Path(file_okay=False, path_type=Path), default=None, help="Write the scores, validations, epoch figures, learning rate and replacements here as TensorBoard scalars (needs the tensorboard package: pip install tensorboard). Default: off.")
@_declared("deterministic")
@_declared("checkpoint_dir", type=click.Path(file_okay=False))
@_declared("checkpoint_every")
@click.option("--resume", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None, help="Continue the run whose checkpoint is in this directory (same options; --epochs counts from the run's start).")
@_declared("validation_every", "pw-fit validates on the test set at each epoch's end, and with N every N averagings too; val_loss and val_accuracy go to the progress bar and metrics.jsonl.")
@click.option("--lr-schedule", type=click.Choice(list(LR_SCHEDULES)), default="none", show_default=True, help="step: lr x 0.7 after each epoch; cosine: anneal to 0 over the run; onecycle: warm up to --lr and anneal, over the run (steps: ceil(batches / workers) an epoch).")
@_declared("max_replacements", "Given, pw-fit replaces a worker that fails (an error, a death, a stall): every worker goes back to the last average and its round's batches are trained again (on_worker_failure('replace')). Default: a failure ends the run.", default=None)
@_declared("stages", "--workers 2 --stages 2 runs 4 processes. Default: no pipeline.", _PIPELINE, default=None)
@_declared("microbatches", "With --stages.", _PIPELINE)
@_declared("schedule", "With --stages.", _PIPELINE)
@click.option("--early-stopping-patience", type=click.IntRange(min=1), default=None, help="Stop when val_loss has not improved for this many validations (at each epoch's end, and every --validation-every N averagings). Default: off.")
@click.pass_context
def main(ctx: click.Context, /, **kwargs: Any) -> None:
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
    options = _make(RunOptions.of, **_library(kwargs))
    try:
        summary = _call(train_mnist, options)
    except KeyboardInterrupt:
        saved = Path(options.config.checkpoint_dir) if options.config.checkpoint_dir is not None else options.resume
        if saved is None:
            raise  # nothing to resume from: click says "Aborted!"
        click.echo(f"\n{_resume_hint(ctx, saved)}", err=True)  # below the progress bar's line
        ctx.exit(130)  # as a shell reports a process that SIGINT ended
    click.echo(summary.describe())


def _library(flags: dict[str, Any]) -> dict[str, Any]:
    """pw-fit's flags with those that make one of the library's options as that option: --averaging-frequency
    auto the autopilot, --stages and its pipeline's flags a Pipeline, --gradient-threshold the
    encoding, --max-replacements N replacement. The library checks them all (RunOptions.of)."""
    flags = dict(flags)
    if flags.get("averaging_frequency") == "auto":
        del flags["averaging_frequency"]
        flags["autopilot"] = Autopilot()
    stages, microbatches, schedule = flags.pop("stages", None), flags.pop("microbatches", 1), flags.pop("pipeline_schedule", "1f1b")
    if stages is not None:
        flags["pipeline"] = Pipeline(stages, None, microbatches, schedule)
    elif (microbatches, schedule) != (1, "1f1b"):
        given = " ".join(f for f in (f"--microbatches {microbatches}" * (microbatches != 1), f"--pipeline-schedule {schedule}" * (schedule != "1f1b")) if f)
        raise click.UsageError(f"{given} shapes a pipeline, which --stages N makes: add --stages 2 or more")
    threshold = flags.pop("gradient_threshold", None)
    if threshold is not None:
        flags["gradient_encoding"] = GradientEncoding(threshold)
    replacements = flags.pop("max_replacements", None)
    if replacements is not None:
        flags.update(on_worker_failure="replace", max_replacements=replacements)
    return flags


def _resume_hint(ctx: click.Context, directory: Path) -> str:
    """Where an interrupted run's checkpoint is, and the command that carries on from it: this
    one's options as given, with --resume."""
    try:
        at = checkpoint_counters(directory)
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
@click.option("--encoded/--no-encoded", default=False, show_default=True, help=f"Also run shared gradients threshold-encoded, τ starting at --gradient-threshold (default {_TAU}); its bytes are those it sent.")
@click.option("--evals", type=click.IntRange(min=1), default=8, show_default=True, help="Test-set evaluations per epoch (the points of each curve).")
@click.option("--target", type=click.FloatRange(min=0, max=1, min_open=True), default=0.97, show_default=True, help="Accuracy whose samples and seconds to reach are tabled.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/compare"), show_default=True, help="Write compare.csv, compare.md and compare.png here.")
def compare_command(frequencies: tuple[int | str, ...], shared_gradients: bool, encoded: bool, evals: int, target: float, out: Path, **kwargs: Any) -> None:  # fmt: skip
    """Train the same model from the same weights on the same data with shared gradients and
    with averaging at several frequencies (and, with --outer-lr, each frequency again with the
    outer optimizer); table and plot test accuracy against samples and seconds, and the bytes
    each sends per worker."""
    threshold = kwargs.pop("gradient_threshold")  # the encoded run's
    kwargs["overlap_averaging"] |= kwargs["fragments"] > 1  # fragments overlap the averaging runs
    base = _make(RunOptions.of, **_library(kwargs))
    if base.config.average_updaters_every != 1:  # its bytes are computed (communication.py) for the state in every round
        raise click.UsageError("pw-fit compare computes each run's bytes with the optimizer state in every round: drop --average-updaters-every")
    options = _make(
        CompareOptions, base=base, frequencies=frequencies, shared_gradients=shared_gradients, encoded=encoded,
        evals_per_epoch=evals, target_accuracy=target, out=out, threshold=threshold,
    )  # fmt: skip
    _call(compare, options)
    click.echo(f"wrote {out / 'compare.csv'}, {out / 'compare.md'}, {out / 'compare.png'}")


@main.command(name="predict")
@click.option("--model-path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True, help="The state dict to score, as pw-fit --out DIR saves it (DIR/model.pt).")
@_MODEL
@_declared("workers", options=INFERENCE_OPTIONS, default=2)
@_declared("inference_mode", options=INFERENCE_OPTIONS)
@click.option("--request-size", type=click.IntRange(min=1), default=1, show_default=True, help="Test images per request (1: single images, as a server gets them).")
@_declared("batch_limit", options=INFERENCE_OPTIONS)
@_DEVICE
@_DATA_DIR
@_DOWNLOAD
@_TEST_SAMPLES
def predict_command(**kwargs: Any) -> None:
    """Score a saved model on the MNIST test set with a ParallelInference of N workers: print
    where they run, the test accuracy and the samples per second (start-up excluded)."""
    options = _make(PredictOptions, **kwargs)
    click.echo(_call(predict_mnist, options, click.echo).describe())


__all__ = ["main"]
