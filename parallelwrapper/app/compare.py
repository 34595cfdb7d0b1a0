"""Synchronous gradients against model averaging, measured on MNIST: the function behind `pw-fit compare`.

Every run trains the same model from the same initial weights on the same batches (dealt to the
same workers: `deterministic`) for the same sample budget; only the synchronisation differs:
SHARED_GRADIENTS (gradients averaged every step, the DataParallelTable / DDP way) and AVERAGING
every k local steps (local SGD; Lin et al., 2020, "Don't Use Large Mini-Batches, Use Local SGD").
The test set is evaluated at the same sample counts in every run, so the curves line up. With
an outer optimizer in the base options (DiLoCo, Douillard et al., 2023; SlowMo, Wang et al., 2020)
each k also runs with it ("outer k=..."), beside plain averaging. A frequency "auto" races the
autopilot (first-come: it steers by measured times).

    results = compare(CompareOptions(RunOptions.of(data_dir=Path("../shared/data/mnist")), out=Path("runs/compare")))

writes `compare.csv` (one row per run and evaluation point), `compare.md` (one row per run) and
`compare.png` (test accuracy against samples and against seconds, one line per run; the
autopilot's k round by round).

Seconds count training only: the workers are started before the clock runs (by a warm-up fit
of one batch per worker, whose effect is then undone) and evaluations are left out.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from parallelwrapper import Autopilot, GradientEncoding, ParallelWrapper, Score, TrainingMode, exchange_share

from .communication import HEADER_BYTES, Communication, estimated_communication
from .options import Batch, RunOptions, builder, epoch_batches, eval_batches, initial_model, load_splits

if TYPE_CHECKING:
    from matplotlib.figure import Figure

T = TypeVar("T")
MODEL_TITLES = {"lenet": "LeNet", "mlp": "MLP"}


@dataclass(frozen=True)
class CompareOptions:
    """The runs to compare. `base` sets everything they share; its mode and averaging frequency
    are replaced by each run's. With `base.outer_lr`, each k runs twice: plain averaging, and with
    the outer optimizer."""

    base: RunOptions = field(default_factory=RunOptions)
    frequencies: tuple[int | str, ...] = (1, 4, 16)  # one AVERAGING run per k, or "auto" (the autopilot)
    shared_gradients: bool = True  # and one SHARED_GRADIENTS run
    encoded: bool = False  # and one SHARED_GRADIENTS run threshold-encoded, τ starting at `threshold`
    threshold: float | None = None  # the encoded run's τ at the start; None: GradientEncoding's
    evals_per_epoch: int = 8
    target_accuracy: float = 0.97
    out: Path = Path("runs/compare")

    def __post_init__(self) -> None:
        ks = self.frequencies
        if any(k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or k < 1) for k in ks) or len(set(ks)) != len(ks):
            raise ValueError(f"frequencies must be distinct ints >= 1 or 'auto', e.g. (1, 4, 16, 'auto'); got {ks!r}")
        if not ks and not self.shared_gradients and not self.encoded:
            raise ValueError("nothing to compare: give at least one averaging frequency or keep shared gradients")
        if not isinstance(self.evals_per_epoch, int) or self.evals_per_epoch < 1:
            raise ValueError(f"evals_per_epoch must be an int >= 1, got {self.evals_per_epoch!r}")
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy is a fraction in (0, 1], e.g. 0.97; got {self.target_accuracy!r}")
        self.encoding()  # the library refuses a bad threshold
        if self.base.config.warmup_sync_steps:
            raise ValueError("compare runs each scheme from the start: drop --warmup-sync-steps (warmup_sync_steps), which pw-fit takes")
        if self.base.outer_lr is not None and not ks:
            raise ValueError("the outer optimizer steps after averagings: give averaging frequencies with --outer-lr")

    def encoding(self) -> GradientEncoding:
        """The encoded run's encoding: τ from `threshold`, the rest the library's defaults."""
        return GradientEncoding() if self.threshold is None else GradientEncoding(self.threshold)


@dataclass(frozen=True)
class RunSpec:
    training_mode: TrainingMode
    averaging_frequency: int | str  # or "auto"
    outer: bool = False  # with the base options' outer optimizer
    encoded: bool = False  # SHARED_GRADIENTS threshold-encoded

    @property
    def label(self) -> str:
        if self.training_mode is TrainingMode.SHARED_GRADIENTS:
            return "encoded shared gradients" if self.encoded else "shared gradients"
        return f"{'outer' if self.outer else 'averaging'} k={self.averaging_frequency}"

    def options(self, base: RunOptions, encoding: GradientEncoding | None = None) -> RunOptions:
        """`base` as this run trains: its mode and k; the outer optimizer only in an outer run; the
        payload dtype and fragments only where there are averagings (fragments overlap them); the
        encoding (`encoding`, or the library's default) only in the encoded run. Dealt (deterministic) but for the
        autopilot, which steers by measured times."""
        outer = self.outer and base.outer_lr is not None
        averaging, k, c = self.training_mode is TrainingMode.AVERAGING, self.averaging_frequency, base.config
        config = dataclasses.replace(
            c, training_mode=self.training_mode, averaging_frequency=k if isinstance(k, int) else c.averaging_frequency,
            autopilot=None if isinstance(k, int) else Autopilot(), report_score_after_averaging=True, deterministic=isinstance(k, int),
            payload_dtype=c.payload_dtype if averaging else "float32", fragments=c.fragments if averaging else 1,
            overlap_averaging=averaging and c.overlap_averaging,
            gradient_encoding=(encoding or GradientEncoding()) if self.encoded else None,
        )  # fmt: skip
        return dataclasses.replace(base, config=config, outer_lr=base.outer_lr if outer else None, outer_momentum=base.outer_momentum if outer else 0.0)


def run_specs(options: CompareOptions) -> list[RunSpec]:
    specs = [RunSpec(TrainingMode.SHARED_GRADIENTS, 1)] if options.shared_gradients else []
    specs += [RunSpec(TrainingMode.SHARED_GRADIENTS, 1, encoded=True)] if options.encoded else []
    outer = options.base.outer_lr is not None
    ks = sorted(k for k in options.frequencies if k != "auto") + [k for k in options.frequencies if k == "auto"]
    return specs + [RunSpec(TrainingMode.AVERAGING, k, o) for k in ks for o in (False, True)[: 1 + outer]]


# -- one run ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """The state of a run after some training: what the test set says, and what it cost."""

    samples: int  # training samples so far, all workers
    seconds: float  # training time so far (no start-up, no evaluation)
    test_accuracy: float
    test_loss: float
    train_score: float  # mean training loss since the previous point (NaN at the start)
    rounds: int  # averagings (SHARED_GRADIENTS: steps) so far
    collectives: int
    bytes_per_worker: float
    exchange_share: float  # of worker 0's time in the fits' rounds so far, the share in exchanges (Score.exchange_s; NaN at the start)


@dataclass(frozen=True)
class RunResult:
    spec: RunSpec
    points: list[Point]
    ks: list[tuple[int, int]] = field(default_factory=list)  # (samples so far, k) of each round: the autopilot's choice

    @property
    def final(self) -> Point:
        return self.points[-1]

    def first_reaching(self, target: float) -> Point | None:
        """The first evaluation at or above `target` accuracy."""
        return next((p for p in self.points if p.test_accuracy >= target), None)


def chunks(batches: list[T], evals: int, unit: int) -> list[list[T]]:
    """About `evals` consecutive pieces, each a multiple of `unit` batches (the last excepted),
    so that every piece ends on a round boundary in every run."""
    size = math.ceil(math.ceil(len(batches) / evals) / unit) * unit
    return [batches[i : i + size] for i in range(0, len(batches), size)]


def _start_workers(wrapper: ParallelWrapper, batches: list[Batch]) -> None:
    """Start the workers outside the clock: fit one batch per worker, then put the model and the
    optimizers back as they were (the next fit() starts from them)."""
    optimizers = [o for o in (wrapper.optimizer, wrapper.outer_optimizer) if o is not None]
    model_state = copy.deepcopy(wrapper.model.state_dict())
    states = [copy.deepcopy(o.state_dict()) for o in optimizers]
    wrapper.fit(batches[: wrapper.config.workers])
    wrapper.model.load_state_dict(model_state)
    for o, state in zip(optimizers, states, strict=True):
        o.load_state_dict(state)


def run_one(spec: RunSpec, options: CompareOptions, pieces: Sequence[list[Batch]], test: list[Batch], echo: Callable[[str], None] | None = None) -> RunResult:
    """Train one configuration over `pieces`, evaluating before the first and after each."""
    run_options = spec.options(options.base, options.encoding())

    @functools.cache
    def cost_of(payload: str) -> Communication:  # by payload: the autopilot's rounds change it
        return estimated_communication(run_options, payload)

    cost = cost_of(run_options.config.payload_dtype)
    model = initial_model(run_options)  # the same initial weights in every run
    wrapper = builder(model, run_options).build()

    sent = 0.0  # encoded: the bytes the fits' rounds sent, as their scores say
    scores: list[Score] = []  # every fit's, for worker 0's share of time in exchanges

    def point(samples: int, seconds: float, score: float, rounds: int, fits: int) -> Point:
        ev = wrapper.evaluate(test)
        if spec.encoded:  # a fit's first round sends its header alone, then each round a meta all-reduce and the messages
            collectives, sent_bytes = fits + 2 * rounds, sent + cost.ring_bytes(HEADER_BYTES) * fits
        elif spec.averaging_frequency == "auto":  # each round in the payload it ran with (its optimizer state counted every round)
            collectives = sum(cost_of(s.payload).collectives(1, 0) for s in scores) + fits
            sent_bytes = sum(cost_of(s.payload).bytes_per_worker(1, 0) for s in scores) + cost.ring_bytes(HEADER_BYTES) * fits
        else:
            collectives, sent_bytes = cost.collectives(rounds, fits), cost.bytes_per_worker(rounds, fits)
        return Point(samples, seconds, ev["accuracy"], ev["loss"], score, rounds, collectives, sent_bytes, exchange_share(scores))

    with wrapper:
        _start_workers(wrapper, pieces[0])
        rounds0, samples0 = wrapper.rounds, wrapper.samples
        points = [point(0, 0.0, math.nan, 0, 0)]
        seconds = 0.0
        for fits, piece in enumerate(pieces, start=1):
            start = time.perf_counter()
            history = wrapper.fit(piece)
            seconds += time.perf_counter() - start
            sent += sum(s.encoding.bytes_sent for s in history.scores if s.encoding is not None)
            scores += history.scores
            points.append(point(wrapper.samples - samples0, seconds, history.final_score, wrapper.rounds - rounds0, fits))
            if echo is not None:
                p = points[-1]
                echo(f"  {spec.label}: {p.samples} samples, {p.seconds:.1f} s, test accuracy {p.test_accuracy:.4f}")
    return RunResult(spec, points, [(s.samples - samples0, s.k) for s in scores] if spec.averaging_frequency == "auto" else [])


# -- all runs, and the files -----------------------------------------------------------------------


def compare(options: CompareOptions, *, echo: Callable[[str], None] | None = print) -> list[RunResult]:
    """Run every configuration, write compare.csv, compare.md and compare.png into `out`, and
    `echo` the progress and the table."""
    start = time.perf_counter()
    base = options.base
    train, test_split = load_splits(base)
    specs = run_specs(options)
    unit = base.config.workers * max((s.averaging_frequency for s in specs if isinstance(s.averaging_frequency, int)), default=1)
    pieces = [
        piece
        for epoch in range(base.epochs)
        for piece in chunks(epoch_batches(train, base, epoch), options.evals_per_epoch, unit)
    ]
    test = eval_batches(test_split)
    results = []
    for spec in specs:
        if echo is not None:
            echo(f"{spec.label}:")
        results.append(run_one(spec, options, pieces, test, echo))
    options.out.mkdir(parents=True, exist_ok=True)
    write_csv(results, options.out / "compare.csv")
    table = markdown(results, options, time.perf_counter() - start)
    (options.out / "compare.md").write_text(table)
    plot(results, options, options.out / "compare.png")
    if echo is not None:
        echo(f"\n{table}")
    return results


CSV_FIELDS = ["run", "training_mode", "averaging_frequency", "outer", "encoded", *(f.name for f in dataclasses.fields(Point))]


def write_csv(results: Sequence[RunResult], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            for p in r.points:
                row = {"run": r.spec.label, "training_mode": r.spec.training_mode.value, "averaging_frequency": r.spec.averaging_frequency, "outer": r.spec.outer, "encoded": r.spec.encoded}
                writer.writerow({**row, **dataclasses.asdict(p)})


def describe_setup(options: CompareOptions, results: Sequence[RunResult]) -> str:
    b = options.base
    c = b.config
    samples = results[0].final.samples if results else 0
    return (
        f"{MODEL_TITLES.get(b.model, b.model)} on MNIST, {c.workers} workers × batch {b.batch_size}, "
        f"{b.optimizer} lr {b.learning_rate:g}, "
        + (f"outer SGD lr {b.outer_lr:g} Nesterov momentum {b.outer_momentum:g}, " if b.outer_lr is not None else "")
        + (f"averagings sent in {c.payload_dtype}, " if c.payload_dtype != "float32" else "")
        + (f"averagings in {c.fragments} fragments, overlapped, " if c.fragments > 1 else "")
        + ("averagings overlapped, " if c.overlap_averaging and c.fragments == 1 else "")
        + f"{samples:,} training samples per run"
    )


def markdown(results: Sequence[RunResult], options: CompareOptions, wall_seconds: float) -> str:
    """One row per run: final accuracy, samples and seconds to the target, communication; then
    how much of the comparison's `wall_seconds` the training took."""
    target = options.target_accuracy
    lines = [
        "# Synchronous gradients against model averaging\n",
        f"{describe_setup(options, results)}; the same initial weights and batches in every run. "
        f"Seconds are training time (no start-up, no evaluation). Communication is computed from "
        f"the all-reduce layout (ring all-reduce: 2(N-1)/N of each buffer sent per worker; a 16-bit "
        f"or quantized payload: (N-1) encodings sent, a fit()'s first round in float32 where the state it averages does not exist at its start), not measured; "
        f"encoded shared gradients count the bytes their messages had ((N-1) each), with the ring's share of the header; "
        f"an outer step sends nothing. \"To {target:.0%}\" is the first of the evaluations at or above it.\n",
        f"| run | final test accuracy | final test loss | training seconds | training samples/s "
        f"| samples to {target:.0%} | seconds to {target:.0%} | collectives | MB sent per worker | worker 0's time in exchanges |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        f, hit = r.final, r.first_reaching(target)
        rate = f.samples / f.seconds if f.seconds > 0 else math.nan
        reached = (f"{hit.samples:,}", f"{hit.seconds:.1f}") if hit else ("not reached", "not reached")
        cells = (f"{f.test_accuracy:.4f}", f"{f.test_loss:.4f}", f"{f.seconds:.1f}", f"{rate:,.0f}", *reached, f"{f.collectives:,}", f"{f.bytes_per_worker / 1e6:,.1f}", f"{f.exchange_share:.1%}")
        lines.append(f"| {r.spec.label} | {' | '.join(cells)} |")
    training = sum(r.final.seconds for r in results)
    evaluations = sum(len(r.points) for r in results)
    lines.append(
        f"\nWall time {wall_seconds:.1f} s, of which {training:.1f} s ({training / wall_seconds:.0%}) training; "
        f"the rest is reading MNIST, starting the workers of each of the {len(results)} runs and "
        f"{evaluations} test-set evaluations."
    )
    return "\n".join(lines) + "\n"


def plot(results: Sequence[RunResult], options: CompareOptions, path: Path) -> None:
    """Write `figure` to `path`."""
    import matplotlib.pyplot as plt

    fig = figure(results, options)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Averaging runs from dark (small k) to light (large k), each with a marker of its own; shared
# gradients in black, dashed, with hollow squares, drawn on top: averaging with k=1 is the same
# training, and its filled circles show inside the squares instead of vanishing under the line.
_MARKERS = ("o", "^", "D", "v", "P", "X", "*")


def _style(spec: RunSpec, ks: list[int]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    if spec.training_mode is TrainingMode.SHARED_GRADIENTS:
        return {"color": "black", "linestyle": "--", "marker": "s", "markersize": 8, "markerfacecolor": "none", "zorder": 3}
    if spec.averaging_frequency == "auto":
        return {"color": "tab:red", "marker": "*", "markersize": 7, "zorder": 4, "linestyle": "-." if spec.outer else "-"}
    assert isinstance(spec.averaging_frequency, int)
    i = ks.index(spec.averaging_frequency)
    shade = plt.get_cmap("viridis")(0.1 + 0.75 * i / max(1, len(ks) - 1))
    # An outer run in its k's colour and marker, dash-dotted, hollow.
    outer = {"linestyle": "-.", "markerfacecolor": "none"} if spec.outer else {"linestyle": "-"}
    return {"color": shade, "marker": _MARKERS[i % len(_MARKERS)], "markersize": 4, "zorder": 2, **outer}


def figure(results: Sequence[RunResult], options: CompareOptions) -> Figure:
    """Test accuracy against samples and against seconds, one line per run.

    The accuracy axis is a logit scale: it shows the whole run, from the untrained model's
    accuracy at 0 samples to the last tenths of a percent, where the runs differ."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, PercentFormatter

    auto = [r for r in results if r.ks]
    fig, axes = plt.subplots(1, 3 if auto else 2, figsize=(19 if auto else 13, 5.6), width_ratios=[1, 1, 0.6][: 3 if auto else 2])
    fig.subplots_adjust(left=0.05 if auto else 0.07, right=0.99, bottom=0.1, top=0.86, wspace=0.12 if auto else 0.05)
    axes[1].sharey(axes[0])
    axes[1].tick_params(labelleft=False)
    ks = sorted({k for r in results if r.spec.training_mode is TrainingMode.AVERAGING and isinstance(k := r.spec.averaging_frequency, int)})
    target = options.target_accuracy
    for ax, x_name, x_label in (
        (axes[0], "samples", "training samples seen (all workers)"),
        (axes[1], "seconds", "training seconds (wall clock, no start-up, no evaluation)"),
    ):
        for r in results:
            label = f"{r.spec.label}: {100 * r.final.test_accuracy:.2f}%"
            if x_name == "seconds":
                label += f" in {r.final.seconds:.1f} s, {r.final.bytes_per_worker / 1e6:,.0f} MB sent/worker"
            ax.plot(
                [getattr(p, x_name) for p in r.points], [_clip(p.test_accuracy) for p in r.points],
                linewidth=2, label=label, **_style(r.spec, ks),
            )  # fmt: skip
        ax.axhline(_clip(target), color="grey", linewidth=1, linestyle=":")
        ax.annotate(
            f"target {100 * target:g}%", xy=(0.01, _clip(target)), xycoords=("axes fraction", "data"),
            va="bottom", color="grey", fontsize=9,
        )  # fmt: skip
        ax.set_xlabel(x_label)
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=9)
    # Every point on the axis, the 0-sample ones included, from a little under the lowest to a
    # little over the best.
    accuracies = [_clip(p.test_accuracy) for r in results for p in r.points] + [_clip(target)]
    y = axes[0]
    y.set_yscale("logit")
    y.set_ylim(min(accuracies) * 0.8, 1 - (1 - max(accuracies)) * 0.7)
    lo, hi = y.get_ylim()
    ticks = [t for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.985, 0.99, 0.995, 0.999) if lo <= t <= hi]
    y.yaxis.set_major_locator(FixedLocator(ticks))
    y.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=1))
    y.yaxis.set_minor_formatter(NullFormatter())
    y.set_ylabel("test accuracy (logit scale)")
    axes[0].set_title("against samples: which learns more per sample")
    axes[1].set_title("against time: which learns faster on this machine")
    for r in auto:  # the autopilot's k, round by round
        axes[2].step([n for n, _ in r.ks], [k for _, k in r.ks], where="post", color=_style(r.spec, ks)["color"], label=r.spec.label)
        axes[2].set_yscale("log", base=2)
        axes[2].set(xlabel="training samples seen (all workers)", ylabel="k of each round", title="the autopilot's k")
        axes[2].grid(True, alpha=0.3)
    fig.suptitle(describe_setup(options, results), fontsize=11)
    return fig


def _clip(accuracy: float) -> float:
    """Keep accuracies inside (0, 1) for the logit axis."""
    return min(max(accuracy, 1e-3), 1 - 1e-4)


__all__ = ["CompareOptions", "Communication", "HEADER_BYTES", "Point", "RunResult", "RunSpec", "compare",
    "estimated_communication", "figure", "markdown", "plot", "run_specs", "write_csv"]
