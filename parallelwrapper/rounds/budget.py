"""How many batches a round may have in all, when workers take them first-come rather than k
each (spawned workers, overlap_averaging, the shared queue)."""

from __future__ import annotations

from typing import Any, Protocol


class Budget(Protocol):
    """How many batches a round may have in all, when not k per worker (RoundBudget)."""

    def take(self, round_index: int) -> bool: ...

    def untake(self, round_index: int) -> None: ...

    def landed(self, round_index: int) -> None: ...


class RoundBudget:
    """Spawned workers with overlap_averaging and the first-come feed: a round is N·k batches in
    all, so a worker that runs faster (its core shared with fewer other threads) takes more of
    them, instead of each taking k and the faster one waiting for the slower at every landing.
    The sample-weighted average is exact whatever the split.

    One count per round in a ring of `RING` in shared memory; every worker resets round r's
    count when it lands r. A ring of 4 is enough: a worker first takes a batch for round r + 4
    (looking ahead, at the end of r + 3's steps) after it landed r + 1, so after every worker
    launched r + 1, and every worker lands r before it launches r + 1 (driver.py, `_overlapped_epoch`).
    (With 3, a worker could take a batch for r + 3 before a slower one has landed r.)
    """

    RING = 4

    def __init__(self, ctx: Any, batches_per_round: int) -> None:
        self._counts = ctx.Array("q", self.RING, lock=True)
        self._limit = batches_per_round

    def take(self, round_index: int) -> bool:
        """Count one batch against round `round_index`; False when the round has all it may have."""
        with self._counts.get_lock():
            slot = round_index % self.RING
            if self._counts[slot] >= self._limit:
                return False
            self._counts[slot] += 1
            return True

    def untake(self, round_index: int) -> None:
        with self._counts.get_lock():
            self._counts[round_index % self.RING] -= 1

    def landed(self, round_index: int) -> None:
        with self._counts.get_lock():
            self._counts[round_index % self.RING] = 0

    def clear(self) -> None:
        """Before a fit, while no worker trains."""
        with self._counts.get_lock():
            self._counts[:] = [0] * self.RING
