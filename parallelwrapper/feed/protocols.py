"""What a rank reads its batches through: a `BatchSource`, `END` at its epoch's end, and `Epochs` read by index.

The feed's side of its contract with the round loop, apart from its transports so that the round
loop, the stages of a pipeline and the hosts name it without taking in any of them."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..types import Batch


class EndOfEpoch:
    """The sentinel a batch source returns when this worker's share of the epoch is done."""


END = EndOfEpoch()


class BatchSource(Protocol):
    def next_batch(self) -> tuple[int, Batch] | EndOfEpoch:
        """(batch index in the epoch, batch) or END."""
        ...

    def epoch_length(self, epoch: int) -> int | None:
        """How many batches epoch `epoch` has over every rank, where every rank's source knows it
        before the epoch ends (a list, Epochs); else None. Every rank must answer the same: the
        autopilot cuts the epoch's last rounds by it (Pilot.steps)."""
        ...


@runtime_checkable
class Epochs(Protocol):
    """Epochs of batches read by index: what spawned workers are sent once per fit to read their
    shards from (feed/epochs.py: a list of batches, or a map-style DataLoader's sample indices)."""

    def length(self, epoch: int) -> int:
        """How many batches epoch `epoch` has."""
        ...

    def batch_at(self, epoch: int, index: int) -> Batch:
        """Batch `index` of epoch `epoch`, loaded."""
        ...


__all__ = ["END", "BatchSource", "EndOfEpoch", "Epochs"]
