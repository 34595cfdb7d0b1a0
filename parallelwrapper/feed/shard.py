"""A rank's dealt shard of data it reads itself: batch i of each epoch to rank i mod N, and no other rank's loaded.

Under torchrun, and for one worker in the caller's process, there is no queue: each process
reads its own data (`ShardSource`). So do spawned workers sent their epochs once per fit
(epochs.py) that are dealt rather than claiming (claims.py). Validation data is dealt the same
way (`rank_share`): of a DataLoader over a map-style dataset, each worker draws the batches'
indices itself and loads only its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from torch.utils.data.distributed import DistributedSampler

from ..types import Batch, DataOrder
from .data import Batches, check_epoch_length, data_raised, distributed_sampler, epoch_iterable
from .epochs import indexed_loader, loader_share
from .order import EpochOrder
from .protocols import END, EndOfEpoch, Epochs


def rank_share(data: Batches, rank: int, world_size: int) -> Iterator[Batch]:
    """One pass over `data`, this rank's batches only, as ShardSource deals them. Of a DataLoader
    over a map-style dataset (`indexed_loader`), only this rank's batches are loaded
    (`loader_share`); other data is iterated whole, and the other ranks' batches dropped."""
    presharded = distributed_sampler(data) is not None
    if not presharded and indexed_loader(data):
        yield from loader_share(data, rank, world_size)
        return
    for index, batch in enumerate(epoch_iterable(data)()):
        if presharded or index % world_size == rank:
            yield batch


class ShardSource:
    """torchrun, or one worker in this process: this rank's batches of each epoch,
    index ≡ rank (mod world_size).

    Every rank iterates the same data (same order: seed any shuffling the same on every rank)
    and keeps its own shard, so no data is sent between machines. A DataLoader whose sampler is
    a DistributedSampler is sharded already: all its batches are this rank's, and its sampler
    is told the epoch (`set_epoch`, as is anything of other data that has it: order.py) so that
    shuffling differs between epochs. Of `Epochs` sent to spawned workers (epochs.py), only this
    rank's batches are loaded, by index. A resumed epoch is drawn in the order kept for it (`order`).
    """

    def __init__(self, data: Batches | Epochs, rank: int, world_size: int, epoch: int = 0, skip: int = 0, order: DataOrder | None = None) -> None:
        self._rank, self._world, self._epoch, self._skip = rank, world_size, epoch, skip
        self._data = data
        self._epochs: Epochs | None = None
        self._make_epoch: Callable[[], Iterable[Batch]]
        self._sampler: DistributedSampler[object] | None = None
        if isinstance(data, Epochs):
            self._epochs, self._make_epoch = data, self._indices
        else:
            self._make_epoch, self._sampler = EpochOrder(data, epoch, order, trains_here=True), distributed_sampler(data)
        self._it: Iterator[tuple[int, Batch]] | None = None

    def _mine(self, index: int) -> bool:
        return self._sampler is not None or index % self._world == self._rank

    def _indices(self) -> range:
        """Of Epochs: this epoch's batches, by their indices (each loaded only if this rank's)."""
        assert self._epochs is not None
        return range(self._epochs.length(self._epoch))

    def _shard(self, skip: int) -> Iterator[tuple[int, Batch]]:
        """This rank's batches of an epoch, each with its index in the epoch of all ranks: a
        presharded loader's i-th batch is the epoch's batch i·world_size + rank, as dealt."""
        count = 0
        try:
            for local, batch in enumerate(self._make_epoch()):
                count += 1
                index = local if self._sampler is None else local * self._world + self._rank
                if index >= skip and self._mine(index):
                    yield index, batch if self._epochs is None else self._epochs.batch_at(self._epoch, batch)
        except Exception as e:
            raise data_raised(e, self._epoch, count) from e
        if self._sampler is None:  # else `count` is this rank's share, which may be empty
            check_epoch_length(count, skip, self._epoch)

    def epoch_length(self, epoch: int) -> int | None:
        """Of Epochs, or a list every rank holds whole; not of a presharded loader or an iterable."""
        if self._epochs is not None:
            return self._epochs.length(epoch)
        return len(self._data) if isinstance(self._data, Sequence) else None

    def next_batch(self) -> tuple[int, Batch] | EndOfEpoch:
        if self._it is None:
            skip, self._skip = self._skip, 0  # only the first epoch resumes mid-way
            self._it = self._shard(skip)
        item = next(self._it, None)
        if item is None:
            self._it = None  # the next call starts the next epoch
            self._epoch += 1
            return END
        return item
