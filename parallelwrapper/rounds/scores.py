"""Score windows and the records a worker reports of them, and the validation's shares combined.

A score is the sample-weighted mean loss since the last report and over the epoch, reported every
round, every k steps or once per epoch; every worker's share of a validation is scored, combined and
reported. The records are the public ones (types.Score, EpochEnd, Validation), made here, their
seconds counted from the fit's start (FitCommand.start)."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import cast

import torch.distributed as dist

from ..types import Counters, EncodingStats, EpochEnd, InForce, Reporter, Score, Validation
from .header import RoundTotals
from .trainer import Trainer


@dataclass
class _Window:
    """Totals of a run of rounds: since the last score report, or over an epoch."""

    rounds: int = 0
    loss_sum: float = 0.0
    samples: int = 0
    skipped: int = 0
    encoding: EncodingStats | None = None
    training_s: float = 0.0  # this worker's, in local work
    exchange_s: float = 0.0  # this worker's, in the exchanges
    batches: int = 0  # every worker's
    ran: InForce | None = None  # the last round's
    why: str | None = None  # the autopilot's last change in these rounds

    def add(self, totals: RoundTotals, encoding: EncodingStats | None, seconds: tuple[float, float], ran: InForce | None) -> None:
        self.rounds += 1
        self.batches += totals.batches
        self.ran, self.why = ran, self.why if ran is None or ran.why is None else ran.why
        self.training_s += seconds[0]
        self.exchange_s += seconds[1]
        self.loss_sum += totals.loss_sum
        self.samples += int(totals.samples)
        self.skipped += totals.skipped
        if encoding is not None:
            self.encoding = encoding if self.encoding is None else self.encoding + encoding

    @property
    def score(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")


class ScoreBook:
    """The score windows of an epoch and the records a worker reports: its scores, validations
    and end. `started`: when the fit() began (time.monotonic()), which their seconds count from."""

    def __init__(self, report: Reporter, every: int, rounds: bool, started: float) -> None:
        self.report, self._every, self._rounds, self._started = report, every, rounds, started
        self.window, self.whole = _Window(), _Window()  # since the last report; the whole epoch

    def _seconds(self) -> float:
        return time.monotonic() - self._started

    def add(
        self, totals: RoundTotals, counters: Counters, end_of_epoch: bool, encoding: EncodingStats | None = None,
        lr: float = math.nan, seconds: tuple[float, float] = (0.0, 0.0), ran: InForce | None = None,
    ) -> None:  # fmt: skip
        """A landed round's totals (and, with gradient encoding, its τ, density and bytes), the
        learning rate of this worker's last step, this worker's seconds in local work and in
        exchanges since the last round it added, and what the round ran with."""
        self.window.add(totals, encoding, seconds, ran)
        self.whole.add(totals, encoding, seconds, ran)
        if self._rounds and (self.window.rounds == self._every or end_of_epoch):
            w = self.window
            per_worker = w.batches / max(totals.workers, 1)  # local steps a worker took, on average
            in_force = {} if w.ran is None else dataclasses.asdict(dataclasses.replace(w.ran, why=w.why))  # k, payload, ..., flattened
            c = counters
            self.report(Score(
                c.rounds, c.iterations, c.samples, c.epoch, w.score, self._seconds(), w.skipped, c.position, w.encoding, lr, w.training_s, w.exchange_s,
                step_s=w.training_s / per_worker if per_worker else math.nan, link_s=w.exchange_s / w.rounds, **in_force,
            ))  # fmt: skip
            self.window = _Window()

    def validated(self, counters: Counters, metrics: dict[str, float]) -> None:
        """Report a validation's combined metrics, at `counters`."""
        epoch = counters.epoch - 1 if counters.position == 0 and counters.epoch > 0 else counters.epoch  # at an epoch's end: that epoch
        c = dataclasses.replace(counters)
        self.report(Validation(c.rounds, c.iterations, c.samples, epoch, metrics, self._seconds(), counters=c))

    def ended(self, counters: Counters, epoch: int, complete: bool) -> None:
        """Report the end of `epoch` (not `complete`: of its part in this fit, which early stopping
        ended), its score the whole epoch's, at `counters`."""
        c = dataclasses.replace(counters)
        self.report(EpochEnd(epoch, c.iterations, c.samples, self.whole.score, self._seconds(), complete, counters=c))


def combine_validation(shares: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The sample-weighted means of the workers' validation sums (Σ metric·n, Σ n), in rank order,
    so that every worker computes the same floats."""
    sums: dict[str, float] = {}
    for share, _ in shares:
        for name, value in share.items():
            sums[name] = sums.get(name, 0.0) + value
    count = sum(n for _, n in shares)
    return {name: value / count for name, value in sums.items()} if count else {}


def validate(trainer: Trainer, counters: Counters, book: ScoreBook, group: dist.ProcessGroup | None, rank: int, world_size: int) -> bool:
    """Every worker scores its share and one gather merges them in rank order, so nobody idles;
    the metrics are reported (`book`) and handed to the trainer. True: early stopping ends the fit."""
    local = trainer.validation_sums(rank, world_size)
    assert local is not None, "validated without validation data"
    shares = cast("list[tuple[dict[str, float], int]]", [None] * world_size)  # all_gather_object fills each
    dist.all_gather_object(shares, local, group=group)
    metrics = combine_validation(shares)
    book.validated(counters, metrics)
    return trainer.after_validation(metrics)
