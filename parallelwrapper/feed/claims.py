"""First-come batches with no feeder: each worker claims the fit's next batch from one shared counter and loads it itself.

A claim is a number, 0, 1, 2, ... over the whole fit, each handed to exactly one worker by one
`add` on a key of the group's store (`StoreCounter`): the main process's store for spawned
workers, torchrun's for ranks on any number of machines, with no data between them. Claim c
is the fit's batch c past where it starts, epoch after epoch (`ClaimSource`), so every batch is
trained exactly once and claims come in index order, as from the shared queue: a round still
cuts the epoch into the same N·k batches (rounds/cut.py), and a faster worker takes more of each
round's. Data is read by index (feed/protocols.Epochs): a list or tuple of batches, or a map-style
DataLoader's epochs of sample indices (epochs.py).

Claims are for averaging rounds of spawned workers and torchrun ranks with the default feed.
`.deterministic(True)` deals batch i to worker i mod N instead (a fixed split, so the same run
gives the same model), and so do pipelines and a node hierarchy, whose ranks step together.
"""

from __future__ import annotations

from typing import Protocol

from torch.distributed import Store  # type: ignore[attr-defined]

from ..config import Config, TrainingMode
from ..types import Batch
from .protocols import END, EndOfEpoch, Epochs


class Counter(Protocol):
    def claim(self) -> int:
        """The next claim: 0 first, each number once over every worker of the fit."""
        ...


class StoreCounter:
    """A key of the group's store, one for each fit (a missing key counts from 0)."""

    def __init__(self, store: Store, key: str) -> None:
        self._store, self._key = store, key

    def claim(self) -> int:
        return int(self._store.add(self._key, 1)) - 1


class Refill:
    """A resumed round's claims (types.Resume): claim c is its hole c, then `then`, `then` + 1, ...:
    the batches of the round that no survivor trained come first, each once, then the fit goes on."""

    def __init__(self, counter: Counter, holes: tuple[int, ...], then: int) -> None:
        self._counter, self._holes, self._then = counter, holes, then

    def claim(self) -> int:
        c = self._counter.claim()
        return self._holes[c] if c < len(self._holes) else self._then + c - len(self._holes)


def claimed(config: Config, alone: bool) -> bool:
    """Whether workers claim their batches first-come (else each reads its dealt shard): averaging
    rounds with the default feed, neither dealt (`deterministic`) nor in lockstep within a
    worker (a pipeline's stages) or a node (a hierarchy's ranks): `alone`, the features say
    (feature.Feature.alone)."""
    return config.feed == "auto" and not config.deterministic and config.training_mode is TrainingMode.AVERAGING and alone


class ClaimSource:
    """One worker's batches of epochs `epoch` to `until_epoch` − 1, the first `skip` batches of
    `epoch` already trained (a resumed run): claimed, then loaded (`Epochs.batch_at`).

    A worker that claims a batch of a later epoch holds it and ends its epoch (END): every batch
    of this epoch is someone's already. It gives the held batch at the next epoch's first call.
    """

    def __init__(self, epochs: Epochs, counter: Counter, epoch: int, skip: int, until_epoch: int) -> None:
        self._epochs, self._counter = epochs, counter
        self._first, self._skip, self._until = epoch, skip, until_epoch
        self._epoch = epoch  # the epoch this worker is in
        self._held: tuple[int, int] | None = None  # (epoch, index) claimed and not given yet
        self._lengths: dict[int, int] = {}

    def _locate(self, claim: int) -> tuple[int, int]:
        """Where claim number `claim` lies: (epoch, index); past the fit's end, (until_epoch, 0)."""
        position, epoch = claim + self._skip, self._first
        while epoch < self._until and position >= (length := self._length(epoch)):
            position, epoch = position - length, epoch + 1
        return (epoch, position) if epoch < self._until else (self._until, 0)

    def _length(self, epoch: int) -> int:
        """An epoch's batches, asked once: every claim walks the epochs from the first."""
        if epoch not in self._lengths:
            self._lengths[epoch] = self._epochs.length(epoch)
        return self._lengths[epoch]

    def epoch_length(self, epoch: int) -> int | None:
        return self._length(epoch) if epoch < self._until else None

    def held(self) -> tuple[int, int] | None:
        """(epoch, index) of a batch claimed and not given yet (a later epoch's)."""
        return self._held

    def next_batch(self) -> tuple[int, Batch] | EndOfEpoch:
        if self._held is None:
            self._held = self._locate(self._counter.claim())
        epoch, index = self._held
        if epoch > self._epoch:
            self._epoch += 1
            return END
        self._held = None
        return index, self._epochs.batch_at(epoch, index)


__all__ = ["ClaimSource", "Counter", "Refill", "StoreCounter", "claimed"]
