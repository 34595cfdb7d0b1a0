"""What spawned workers are sent once per fit to read their shards from: a list of batches, or a map-style DataLoader's epochs as sample indices.

With feed "auto", spawned workers given a list or tuple of batches receive it once per fit(), its
tensors in shared memory, and the main process copies nothing per batch (`shardable`). A
DataLoader over a map-style dataset, loading in the main process (num_workers=0), goes the same
way as `DatasetEpochs`: the main process draws each epoch's batches as sample indices from the
loader's batch sampler (shuffling as iterating the loader would), and each worker loads and
collates only the batches it claims or is dealt, from its own copy of the dataset.

Validation data goes the same way, but each worker draws the indices itself, where it used to
iterate the whole loader (`loader_share`): every worker draws the same batches, as iterating the
loader would, and loads only its own, about 1/N of the samples."""

from __future__ import annotations

import io
import itertools
import multiprocessing
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from ..types import Batch, Sample
from .data import Batches, distributed_sampler
from .protocols import Epochs


def indexed_loader(data: object) -> TypeGuard[DataLoader[Sample]]:
    """A DataLoader that batches a map-style dataset by its batch sampler: its batches can be drawn
    as sample indices, and loaded wherever its dataset is."""
    return isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset) and data.batch_sampler is not None


def map_style_loader(data: object) -> bool:
    """An `indexed_loader` that loads in the calling process (not one whose own worker processes
    load: those read ahead in parallel already), whose dataset and collate function pickle, to go
    to the workers."""
    return indexed_loader(data) and data.num_workers == 0 and _pickles((data.dataset, data.collate_fn))


class _TensorsAside(pickle.Pickler):
    """A pickler that leaves tensors and arrays out (they always pickle: in shared memory)."""

    def persistent_id(self, obj: object) -> int | None:
        return id(obj) if isinstance(obj, (torch.Tensor, torch.UntypedStorage, np.ndarray)) else None


def _pickles(obj: object) -> bool:
    """Whether `obj` pickles, found without copying its tensors' data (a lambda, an open file or a
    lock inside it does not)."""
    try:
        _TensorsAside(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:  # noqa: BLE001 - pickle raises PicklingError, TypeError, AttributeError...
        return False
    return True


Indices = torch.Tensor | list[object]  # a batch as its samples' keys in the dataset: an int64 tensor, or a list of any keys
Epoch = tuple[torch.Tensor, torch.Tensor] | list[list[object]]  # (its indices end to end, where each batch starts), or lists


class ListEpochs:
    """A list or tuple of batches, the same every epoch."""

    def __init__(self, batches: Sequence[Batch]) -> None:
        self._batches = batches

    def length(self, epoch: int) -> int:
        return len(self._batches)

    def batch_at(self, epoch: int, index: int) -> Batch:
        return self._batches[index]


@dataclass(frozen=True)
class DatasetEpochs:
    """A map-style DataLoader's epochs `first` onwards for spawned workers that read their own
    shards: its dataset and collate function, and each epoch's batches as sample indices, drawn
    in the main process from the loader's batch sampler (so shuffled as the loader would).
    Integer indices are kept as two int64 tensors an epoch (many epochs of Python ints would
    take some 36 bytes a sample each), any other keys as lists."""

    dataset: Dataset[Sample]
    collate_fn: Callable[[list[Sample]], Batch]
    first: int
    epochs: list[Epoch]

    @staticmethod
    def of(loader: DataLoader[Sample], first: int, until: int, epochs: list[Epoch] | None = None) -> DatasetEpochs:
        """Epochs `first` to `until` - 1 of `loader`: their batches as given (feed/order.py's,
        kept for a resume), or drawn from the loader."""
        epochs = epochs if epochs is not None else [packed(drawn(loader)[1]) for _ in range(first, until)]
        return DatasetEpochs(loader.dataset, loader.collate_fn, first, epochs)

    def length(self, epoch: int) -> int:
        """How many batches epoch `epoch` has."""
        kept = self.epochs[epoch - self.first]
        return len(kept) if isinstance(kept, list) else len(kept[1]) - 1

    def batch_at(self, epoch: int, index: int) -> Batch:
        """Batch `index` of epoch `epoch`: its samples' indices, loaded and collated (`batch`)."""
        kept = self.epochs[epoch - self.first]
        if isinstance(kept, list):
            return self.batch(kept[index])
        flat, starts = kept
        return self.batch(flat[int(starts[index]) : int(starts[index + 1])])

    def batch(self, indices: Indices) -> Batch:
        """A batch as the loader makes it: its samples (`__getitems__` where the dataset has it),
        collated. A TensorDataset (not a subclass, which may index its own way) under the default
        collate function is indexed once a tensor: the same tensors, for a fraction of the work."""
        if isinstance(indices, torch.Tensor) and type(self.dataset) is TensorDataset and self.collate_fn is default_collate:
            return [t[indices] for t in self.dataset.tensors]
        keys = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        getitems = getattr(self.dataset, "__getitems__", None)
        return self.collate_fn(getitems(keys) if getitems is not None else [self.dataset[i] for i in keys])


def shardable(data: Batches, feed: str, replaces: bool) -> bool:
    """Whether spawned workers read `data` in shards (Builder.feed): with feed "auto", when no
    replacement needs the queue's ledger to feed a round again, a list or tuple of batches, or a
    DataLoader over a map-style dataset that loads in the main process (`DatasetEpochs`), unless
    a DistributedSampler shards it already."""
    return feed == "auto" and not replaces and (isinstance(data, (list, tuple)) or (map_style_loader(data) and distributed_sampler(data) is None))


def shards_of(data: Batches, first_epoch: int, until_epoch: int, epochs: list[Epoch] | None = None) -> Epochs:
    """What spawned workers get to read their shards of `data` (shardable) from, once per fit():
    a DataLoader's epochs `first_epoch` to `until_epoch` - 1 as sample indices (DatasetEpochs.of),
    or the list or tuple of batches itself."""
    if isinstance(data, DataLoader):
        return DatasetEpochs.of(data, first_epoch, until_epoch, epochs)
    assert isinstance(data, (list, tuple)), "shardable data is a DataLoader, a list or a tuple"
    return ListEpochs(data)


def loader_share(loader: DataLoader[Sample], rank: int, world_size: int) -> DataLoader[Sample]:
    """One pass over an `indexed_loader`'s batches i ≡ rank (mod world_size), as a loader of their
    own: the pass's batches drawn as sample indices, as iterating `loader` draws them (its random
    streams left where iterating it leaves them), and only this rank's loaded and collated, by
    `loader`'s settings (`loader_over`)."""
    seed, batches = drawn(loader)
    return loader_over(loader, seed, batches[rank::world_size])


def loader_over(loader: DataLoader[Sample], seed: int, batches: Epoch) -> DataLoader[Sample]:
    """A loader of exactly `batches` (of sample indices, as `drawn` gives them, or `packed`),
    loaded and collated by `loader`'s settings, its processes seeded from `seed` as `loader`'s
    would be. Its processes (num_workers) start afresh for each pass; in a spawned worker, a
    daemon that may start none, it loads in the worker itself."""
    processes = 0 if multiprocessing.current_process().daemon else loader.num_workers
    return DataLoader(
        loader.dataset, batch_sampler=unpacked(batches), collate_fn=loader.collate_fn, num_workers=processes,
        pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=torch.Generator().manual_seed(seed),
        prefetch_factor=loader.prefetch_factor if processes else None, pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )  # fmt: skip


def drawn(loader: DataLoader[Sample]) -> tuple[int, list[list[object]]]:
    """(base seed, batches): one pass's batches of sample indices, drawn as iterating the loader
    draws them: its iterator takes the base seed of its processes from the generator (the global
    one when None) before the sampler draws its own, so the random streams stay where the loader
    leaves them."""
    assert loader.batch_sampler is not None
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator))
    return seed, [list(batch) for batch in loader.batch_sampler]


def packed(batches: list[list[object]]) -> Epoch:
    """An epoch's batches of sample indices, ints packed in two tensors (its indices end to end,
    where each batch starts); other keys kept as lists."""
    if not all(type(i) is int for batch in batches for i in batch):
        return batches
    starts = torch.tensor([0, *itertools.accumulate(len(batch) for batch in batches)], dtype=torch.int64)
    return torch.tensor([i for batch in batches for i in batch], dtype=torch.int64), starts


def unpacked(batches: Epoch) -> list[list[object]]:
    """`packed`'s batches as lists again."""
    if isinstance(batches, list):
        return batches
    flat, starts = batches
    bounds = starts.tolist()
    return [flat[a:b].tolist() for a, b in zip(bounds, bounds[1:])]


__all__ = ["DatasetEpochs", "ListEpochs", "drawn", "indexed_loader", "loader_over", "loader_share", "map_style_loader", "packed", "shardable", "shards_of", "unpacked"]
