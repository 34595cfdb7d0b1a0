"""Who hears what fit() reports, in the main process: the History, listeners, writers, early stopping.

The records (`Score`, `EpochEnd`, `Validation`, `Replacement`: types.py) come as they were made,
by the worker that saw the event (a replacement's, by the host that made it); the Recorder keeps
each in the fit's History and hands it to the listeners. A listener is any object with some of
`on_fit_start(config, epochs)`, `on_score(score)`, `on_validation(validation)`,
`on_epoch_end(epoch)`, `on_worker_replaced(rank, reason, lost_round)`, `on_fit_end(history)`, or a
plain callable, which receives each `Score`. Listeners run in the main process (on rank 0 under
torchrun), between rounds: a slow listener slows nothing but the reporting. One that raises
KeyboardInterrupt stops the fit as Ctrl-C does: every record already made still reaches the
History and every listener, the round in flight lands (saved, with checkpoints on), and fit()
raises KeyboardInterrupt.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from .errors import WorkerError
from .types import EpochEnd, Replacement, Report, Score, Validation

if TYPE_CHECKING:
    from .config import Config


def exchange_share(scores: Sequence[Score]) -> float:
    """Of the reporting worker's time over `scores`, the share spent in exchanges rather than in
    its steps: Σ exchange_s / Σ (training_s + exchange_s); NaN when they count no time."""
    busy = sum(s.training_s + s.exchange_s for s in scores)
    return sum(s.exchange_s for s in scores) / busy if busy > 0 else math.nan


def autopilot_changes(scores: Sequence[Score]) -> list[dict[str, int | str | bool | None]]:
    """The autopilot's changes over `scores` (`.averaging_frequency("auto")`): from which round
    on, the k, payload, optimizer-state period and overlap it chose (as the first later score that
    ran otherwise ran them: overlapped, the round after a decision has done its steps already),
    and why."""

    def choice(s: Score) -> tuple[int, str, int, bool]:
        return s.k, s.payload, s.updaters_every, s.overlap

    changes: list[dict[str, int | str | bool | None]] = []
    for i, before in enumerate(scores):
        after = next((s for s in scores[i + 1 :] if choice(s) != choice(before)), None) if before.why else None
        if after is not None:
            changes.append({"round": after.round, "k": after.k, "payload": after.payload, "updaters_every": after.updaters_every, "overlap": after.overlap, "why": before.why})
    return changes


@dataclass
class History:
    """What fit() returns: every averaged score, epoch end, validation and replacement of that call."""

    scores: list[Score] = field(default_factory=list)
    epochs: list[EpochEnd] = field(default_factory=list)
    validations: list[Validation] = field(default_factory=list)
    replacements: list[Replacement] = field(default_factory=list)

    best_round: int | None = None  # with EarlyStopping(restore_best=True): the round whose state the model holds

    @property
    def final_score(self) -> float:
        """The mean loss of the last epoch, or of the part of it trained before an early stop."""
        return self.epochs[-1].score if self.epochs else math.nan


LISTENER_METHODS = ("on_fit_start", "on_score", "on_validation", "on_epoch_end", "on_worker_replaced", "on_fit_end")


def check_listeners(listeners: Sequence[object]) -> None:
    for i, listener in enumerate(listeners):
        if not callable(listener) and not any(hasattr(listener, m) for m in LISTENER_METHODS):
            raise ValueError(f"listeners[{i}] ({listener!r}) is neither callable nor has any of {LISTENER_METHODS}")


def notify(listeners: Sequence[object], method: str, *args: object) -> None:
    """Call `method` of each listener with `args` (a plain callable hears each Score). A
    KeyboardInterrupt raised in one (a listener's way to stop the fit, or a Ctrl-C that came
    while it ran) is raised once every listener has heard: the others do not miss the record.
    The host then stops as for a Ctrl-C (hosts/runtime.py, hosts/spawned.py)."""
    interrupted: KeyboardInterrupt | None = None
    for listener in listeners:
        fn = getattr(listener, method, None)
        try:
            if fn is not None:
                fn(*args)
            elif method == "on_score" and callable(listener):
                listener(*args)
        except KeyboardInterrupt as e:
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


# Where each record goes: its History list, and the listener method that hears it.
_ROUTES: dict[type[Report], tuple[str, str]] = {
    Score: ("scores", "on_score"),
    EpochEnd: ("epochs", "on_epoch_end"),
    Validation: ("validations", "on_validation"),
    Replacement: ("replacements", "on_worker_replaced"),
}


class Recorder:
    """One fit()'s records, as the workers made them: each goes to its History list and to its
    listener method."""

    def __init__(self, listeners: Sequence[object]) -> None:
        self.listeners, self.history = listeners, History()

    def __call__(self, record: Report) -> None:
        kept_in, method = _ROUTES[type(record)]
        getattr(self.history, kept_in).append(record)
        heard = (record.rank, record.reason, record.lost_round) if isinstance(record, Replacement) else (record,)
        notify(self.listeners, method, *heard)


class _Bar(Protocol):
    """What ProgressBar uses of a tqdm bar."""

    n: float
    total: float | None

    def update(self, n: float = 1) -> bool | None: ...

    def set_postfix(self, ordered_dict: Mapping[str, object] | None = None, refresh: bool = True) -> None: ...

    def close(self) -> None: ...


class ProgressBar:
    """A tqdm bar over an epoch's batches, one bar per epoch, with the last round's averaged loss
    ("round loss"), its k and payload, the latest validation metrics, and at the end the epoch's mean loss ("epoch
    loss"). `batches_per_epoch` sets the bar's total when the data has a length; a resumed fit()
    starts its bar where the epoch was."""

    def __init__(self, batches_per_epoch: int | None = None, **tqdm_kwargs: object) -> None:
        self._total, self._kwargs = batches_per_epoch, tqdm_kwargs
        self._bar: _Bar | None = None
        self._postfix: dict[str, str] = {}

    def _open(self, epoch: int) -> _Bar:
        from tqdm.auto import tqdm

        if self._bar is None:
            self._bar = tqdm(total=self._total, desc=f"epoch {epoch}", unit="batch", **self._kwargs)
            self._postfix = {}
        return self._bar

    def _show(self, bar: _Bar, values: dict[str, float], refresh: bool = False) -> None:
        self._postfix.update({k.replace("_", " "): f"{v:.4f}" for k, v in values.items()})
        bar.set_postfix(self._postfix, refresh=refresh)

    def on_score(self, score: Score) -> None:
        """Move the bar to the score's place in the epoch and show its round loss, k and payload."""
        bar = self._open(score.epoch)
        bar.update(score.position - bar.n)
        if score.k:
            self._postfix["k"], self._postfix["payload"] = str(score.k), score.payload + (", overlapped" if score.overlap else "")
        self._show(bar, {"round_loss": score.score})

    def on_validation(self, validation: Validation) -> None:
        """Show the validation's metrics beside the round loss."""
        if self._bar is not None:  # at an epoch's end the bar is still open: the validation comes first
            self._show(self._bar, validation.metrics)

    def on_worker_replaced(self, rank: int, reason: WorkerError, lost_round: int) -> None:
        """Write a line under the bar: which worker was replaced, and why."""
        from tqdm.auto import tqdm

        tqdm.write(f"worker {rank} replaced, round {lost_round} trained again: {str(reason).splitlines()[0]}")

    def on_epoch_end(self, epoch: EpochEnd) -> None:
        """Fill the bar, show the epoch's mean loss and close it."""
        bar = self._open(epoch.epoch)
        if bar.total and epoch.complete:
            bar.update(bar.total - bar.n)
        self._postfix.pop("round loss", None)
        self._show(bar, {"epoch_loss": epoch.score}, refresh=True)
        bar.close()
        self._bar = None


class JsonlWriter:
    """Appends one JSON object per score and per epoch end to a file, flushed as it goes, so a
    crashed run keeps what it reported. Records carry `"kind": "score"` or `"kind": "epoch"`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, kind: str, record: Mapping[str, object]) -> None:
        """Append `record` with `"kind": kind`, and flush."""
        self._file.write(json.dumps({"kind": kind, **record}) + "\n")
        self._file.flush()

    def on_score(self, score: Score) -> None:
        """A `"score"` record."""
        self.write("score", dataclasses.asdict(score))

    def on_epoch_end(self, epoch: EpochEnd) -> None:
        """An `"epoch"` record."""
        self.write("epoch", dataclasses.asdict(epoch))

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class CsvWriter:
    """Writes the scores as CSV, one row per averaging; with gradient encoding, its τ, density and
    bytes sent in columns of their own (empty without)."""

    ENCODING = ["threshold", "density", "bytes_sent"]
    FIELDS = [f.name for f in dataclasses.fields(Score) if f.name != "encoding"] + ENCODING

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=self.FIELDS)
        if new:
            self._writer.writeheader()

    def on_score(self, score: Score) -> None:
        """A row, flushed."""
        row = dataclasses.asdict(score)
        encoding = row.pop("encoding") or {}
        self._writer.writerow({**row, **{k: encoding.get(k, "") for k in self.ENCODING}})
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class ScoreLogger:
    """Prints the averaged score every `every` averagings, as DL4J's ScoreIterationListener."""

    def __init__(self, every: int = 10) -> None:
        self.every = every

    def on_score(self, score: Score) -> None:
        """Print the score on every `every`-th averaging."""
        if score.round % self.every == 0:
            print(f"round {score.round} iteration {score.iteration} epoch {score.epoch}: score {score.score:.5f}")


class EarlyStopping:
    """Stop fit() at the validation where `monitor` has not improved for `patience` validations,
    after DL4J's EarlyStoppingParallelTrainer; with `restore_best`, fit() leaves the state of the
    best validation in the model. Needs `.validation(data)`.

    The decision is taken on every worker from the same combined metrics, so all stop after the
    same round, with no message between them; this copy, in the main process, follows the same
    validations, so `best`, `best_round` and `stopped_round` say what happened, and with
    `restore_best` fit()'s History says which round's state the model holds (`best_round`).
    State restarts at every fit()."""

    def __init__(self, monitor: str = "val_loss", patience: int = 3, mode: str = "min", min_delta: float = 0.0, restore_best: bool = False) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"EarlyStopping patience must be an int >= 1, got {patience!r}")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping min_delta must be >= 0, got {min_delta!r}")
        self.monitor, self.patience, self.mode, self.min_delta, self.restore_best = monitor, patience, mode, min_delta, restore_best
        self.reset()

    def reset(self) -> None:
        """Forget the best value and the wait, as at the start of a fit()."""
        self.best: float | None = None
        self.best_round: int | None = None  # the round of the best validation (this copy's account)
        self.wait = 0
        self.stopped_round: int | None = None

    def on_fit_start(self, config: Config, epochs: int) -> None:
        """Start afresh: each fit() stops on its own validations."""
        self.reset()

    def update(self, metrics: dict[str, float]) -> tuple[bool, bool]:
        """(improved, stop) after a validation's metrics."""
        if self.monitor not in metrics:
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, but the validation reports {sorted(metrics)}")
        value = metrics[self.monitor]
        sign = 1.0 if self.mode == "min" else -1.0
        improved = self.best is None or sign * (self.best - value) > self.min_delta
        if improved:
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        return improved, self.wait >= self.patience

    def on_validation(self, validation: Validation) -> None:
        """Follow the workers' decision on this validation, to say later what happened."""
        if self.stopped_round is not None:
            return
        improved, stop = self.update(validation.metrics)
        if improved:
            self.best_round = validation.round
        if stop:
            self.stopped_round = validation.round


def early_stopping_of(listeners: Sequence[object]) -> EarlyStopping | None:
    """The EarlyStopping among the listeners: the workers apply it to their validations."""
    stoppers = [listener for listener in listeners if isinstance(listener, EarlyStopping)]
    if len(stoppers) > 1:
        raise ValueError(f"listeners: {len(stoppers)} EarlyStopping given; give one")
    return stoppers[0] if stoppers else None
