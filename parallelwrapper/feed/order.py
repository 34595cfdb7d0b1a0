"""Each epoch's order of the training data, told its epoch and kept beside the checkpoint, so that a resumed epoch trains every sample once.

A checkpoint says where a run stands: the epoch, and how many of its batches are trained
(`Counters.position`); a resumed feed skips that many. That is exact only if the resumed epoch
yields its batches in the same order, which a shuffling DataLoader does not: a new process draws
another permutation. So the process that draws the data's epochs (the main process, or rank 0
under torchrun) keeps what fixes each epoch's order in `ORDER_FILE` beside the checkpoint, before
any batch of that epoch is trained, and a resumed run draws its first epoch from there:

- a loader with `state_dict`/`load_state_dict` (torchdata's `StatefulDataLoader`, made for
  this): its state at the epoch's start, loaded back before the epoch is read again;
- any other DataLoader over a map-style dataset: the epoch's batches of sample indices and the
  base seed of its processes, drawn from the loader as iterating it draws them (epochs.py), and
  read through a loader over exactly those batches; and the state of the loader's generator after
  the draw, so that the epochs after it draw as they would have;
- other data (a list, an IterableDataset, a generator) is read as it is: a list has one order,
  and an iterable is told its epoch (`set_epoch`), the convention of DistributedSampler and
  Hugging Face `datasets` for an order that depends on the epoch alone.

Whatever has `set_epoch` (the dataset, the sampler, the batch sampler, the data itself) is told
each epoch before it is read, on every rank, as DistributedSampler and `datasets` expect.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, RandomSampler

from .. import checkpoint
from ..types import Batch, DataOrder, Sample, StateDict
from .data import Batches, epoch_iterable
from .epochs import Epoch, drawn, indexed_loader, loader_over, packed

ORDER_FILE = "data-order.pt"
_KEPT_EPOCHS = 2  # a checkpoint lags the drawing process by at most its prefetch: the epoch in progress and the one before


def set_epoch(data: object, epoch: int) -> None:
    """Tell every part of `data` that has `set_epoch` (the data itself, a loader's dataset, sampler
    and batch sampler, and the batch sampler's sampler) that epoch `epoch` begins; each once."""
    parts = [data]
    if isinstance(data, DataLoader):
        parts += [data.dataset, data.sampler, data.batch_sampler, getattr(data.batch_sampler, "sampler", None)]
    seen: set[int] = set()
    for part in parts:
        if part is not None and id(part) not in seen and callable(getattr(part, "set_epoch", None)):
            seen.add(id(part))
            part.set_epoch(epoch)  # type: ignore[attr-defined]


def stateful(data: object) -> bool:
    """A loader that saves and loads its own place (torchdata's StatefulDataLoader)."""
    return isinstance(data, DataLoader) and callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))


def shuffles(data: object) -> bool:
    """Whether a DataLoader draws each epoch's order at random (its sampler is not a fixed order)."""
    if not isinstance(data, DataLoader) or not indexed_loader(data):
        return False
    sampler = getattr(data.batch_sampler, "sampler", data.sampler)
    return isinstance(sampler, RandomSampler) or getattr(sampler, "generator", None) is not None or getattr(sampler, "shuffle", False) is True


def read(location: str | os.PathLike[str]) -> dict[int, StateDict]:
    """The epochs' orders kept beside the checkpoint at `location` (a directory or its file); none
    where there is no such file."""
    path = Path(location)
    path = (path if path.is_dir() else path.parent) / ORDER_FILE
    if not path.is_file():
        return {}
    kept: dict[int, StateDict] = torch.load(path, map_location="cpu", weights_only=True)
    return kept


def check_resumable(data: Batches, kept: dict[int, StateDict], epoch: int, position: int, where: str) -> None:
    """A ValueError where a resume mid-epoch would train another order: a shuffling loader whose
    epoch `epoch` the checkpoint at `where` kept no order of (`kept`: `read`'s)."""
    if position > 0 and epoch not in kept and (stateful(data) or shuffles(data)):
        raise ValueError(
            f"resume: the checkpoint at {where} is {position} batches into epoch {epoch} of a shuffling loader, but keeps "
            f"no record of that epoch's order ({ORDER_FILE} is missing or older): the resumed epoch would draw another "
            f"order and train some samples twice, others never. Resume from a checkpoint at an epoch's end, or start afresh"
        )


class EpochOrder:
    """Epoch after epoch of `data` from `first`, each told its epoch, drawn in the order kept for
    it where the run resumed there, and kept for a later resume where `order.keep_in` says.

    `trains_here`: this process also trains (one worker in the caller's process, a torchrun
    rank): its global RNG then follows the training's own RNG state, which the checkpoint restored,
    and is never set from a kept order. Each epoch is drawn as it begins, and the last two are
    kept (a checkpoint lags the drawing by at most its read-ahead), or all of a fit's at its start
    (`up_front`).
    """

    def __init__(self, data: Batches, first: int, order: DataOrder | None, *, trains_here: bool) -> None:
        self._data, self._epoch, self._trains_here = data, first, trains_here
        self._order = order or DataOrder()
        self._kept: dict[int, StateDict] = dict(self._order.kept)
        self._make = epoch_iterable(data)

    @property
    def keeps(self) -> bool:
        """Whether anything is drawn in a kept order or kept: else the data is read as it is."""
        return (self._order.keep_in is not None or bool(self._kept)) and (stateful(self._data) or indexed_loader(self._data))

    def __call__(self) -> Iterable[Batch]:
        """The next epoch's batches."""
        epoch, self._epoch = self._epoch, self._epoch + 1
        set_epoch(self._data, epoch)
        if not self.keeps:
            return self._make()
        loader: DataLoader[Sample] = self._data  # type: ignore[assignment]
        if stateful(loader):
            kept = self._kept.get(epoch)
            if kept is not None:
                loader.load_state_dict(kept["loader"])  # type: ignore[attr-defined]
            else:
                self._keep(epoch, {"loader": loader.state_dict()})  # type: ignore[attr-defined]
            return loader
        seed, batches = self.draw(epoch)
        return loader_over(loader, seed, batches)

    def up_front(self, until: int) -> list[Epoch]:
        """The batches of sample indices of every epoch from here to `until` - 1, drawn now (for
        spawned workers that read their own shards), each epoch told first (`set_epoch`); all of
        them kept, in one write."""
        epochs = []
        for epoch in range(self._epoch, until):
            set_epoch(self._data, epoch)
            epochs.append(self.draw(epoch, write=False)[1])
        self._write(self._kept)
        return epochs

    def draw(self, epoch: int, write: bool = True) -> tuple[int, Epoch]:
        """Epoch `epoch`'s base seed and batches of sample indices: as kept, or drawn from the loader
        (and kept). After a kept epoch the loader's generator, and the global RNG where this process
        does not train, go on from where they were after that epoch's draw."""
        loader: DataLoader[Sample] = self._data  # type: ignore[assignment]
        kept = self._kept.get(epoch)
        if kept is not None:
            if loader.generator is not None:
                loader.generator.set_state(kept["generator"])
            if not self._trains_here:
                torch.set_rng_state(kept["global"])
            return int(kept["seed"]), kept["batches"]
        seed, batches = drawn(loader)
        epoch_batches = packed(batches)
        after = {"generator": None if loader.generator is None else loader.generator.get_state(), "global": torch.get_rng_state()}
        self._keep(epoch, {"seed": seed, "batches": epoch_batches, **after}, write)
        return seed, epoch_batches

    def _keep(self, epoch: int, what: StateDict, write: bool = True) -> None:
        """Keep epoch `epoch`'s order in memory and, with `write`, the last two epochs' in ORDER_FILE."""
        self._kept[epoch] = what
        if write:
            self._write({e: v for e, v in self._kept.items() if e > epoch - _KEPT_EPOCHS})

    def _write(self, kept: dict[int, StateDict]) -> None:
        """`kept` in ORDER_FILE, where this process keeps the orders (atomically, as a checkpoint is written)."""
        if self._order.keep_in is not None:
            checkpoint.save(self._order.keep_in, kept, ORDER_FILE)


__all__ = ["ORDER_FILE", "EpochOrder", "check_resumable", "read", "set_epoch", "shuffles", "stateful"]
