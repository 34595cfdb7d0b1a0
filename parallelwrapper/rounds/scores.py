"""Score windows: the sample-weighted mean loss since the last report and over the epoch, and
the reports a worker makes of them (every round, every k steps, or once per epoch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..types import Counters, Reporter, RoundReport
from .header import RoundTotals


@dataclass
class _Window:
    """Totals of a run of rounds: since the last score report, or over an epoch."""

    rounds: int = 0
    loss_sum: float = 0.0
    samples: int = 0
    skipped: int = 0

    def add(self, totals: RoundTotals) -> None:
        self.rounds += 1
        self.loss_sum += totals.loss_sum
        self.samples += int(totals.samples)
        self.skipped += totals.skipped

    @property
    def score(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")


class ScoreBook:
    """The score windows of an epoch and the reports they make."""

    def __init__(self, report: Reporter, every: int, rounds: bool) -> None:
        self.report, self._every, self._rounds = report, every, rounds
        self.window, self.whole = _Window(), _Window()  # since the last report; the whole epoch

    def add(self, totals: RoundTotals, counters: Counters, end_of_epoch: bool) -> None:
        self.window.add(totals)
        self.whole.add(totals)
        if self._rounds and (self.window.rounds == self._every or end_of_epoch):
            self.report(RoundReport(dataclasses.replace(counters), self.window.score, self.window.skipped))
            self.window = _Window()
