"""Score windows: the sample-weighted mean loss since the last report and over the epoch, and
the reports a worker makes of them (every round, every k steps, or once per epoch); and the
validation: every worker's share scored, combined and reported."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..types import Counters, EncodingStats, Reporter, RoundReport, ValidationReport
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

    def add(self, totals: RoundTotals, encoding: EncodingStats | None, seconds: tuple[float, float]) -> None:
        self.rounds += 1
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
    """The score windows of an epoch and the reports they make."""

    def __init__(self, report: Reporter, every: int, rounds: bool) -> None:
        self.report, self._every, self._rounds = report, every, rounds
        self.window, self.whole = _Window(), _Window()  # since the last report; the whole epoch

    def add(self, totals: RoundTotals, counters: Counters, end_of_epoch: bool, encoding: EncodingStats | None = None, lr: float = math.nan, seconds: tuple[float, float] = (0.0, 0.0)) -> None:
        """A landed round's totals (and, with gradient encoding, its τ, density and bytes), the
        learning rate of this worker's last step, and this worker's seconds in local work and in
        exchanges since the last round it added."""
        self.window.add(totals, encoding, seconds)
        self.whole.add(totals, encoding, seconds)
        if self._rounds and (self.window.rounds == self._every or end_of_epoch):
            w = self.window
            self.report(RoundReport(dataclasses.replace(counters), w.score, w.skipped, encoding=w.encoding, lr=lr, training_s=w.training_s, exchange_s=w.exchange_s))
            self.window = _Window()


def combine_validation(shares: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The sample-weighted means of the workers' validation sums (Σ metric·n, Σ n), in rank order,
    so that every worker computes the same floats."""
    sums: dict[str, float] = {}
    for share, _ in shares:
        for name, value in share.items():
            sums[name] = sums.get(name, 0.0) + value
    count = sum(n for _, n in shares)
    return {name: value / count for name, value in sums.items()} if count else {}


def validate(trainer: Trainer, counters: Counters, report: Reporter, group: dist.ProcessGroup | None, rank: int, world_size: int) -> bool:
    """Every worker scores its share and one gather merges them in rank order, so nobody idles;
    the metrics are reported and handed to the trainer. True: early stopping ends the fit."""
    local = trainer.validation_sums(rank, world_size)
    assert local is not None, "validated without validation data"
    shares: list[Any] = [None] * world_size
    dist.all_gather_object(shares, local, group=group)
    metrics = combine_validation(shares)
    report(ValidationReport(dataclasses.replace(counters), metrics))
    return trainer.after_validation(metrics)
