"""The feed: how each rank gets its batches, from a queue the main process fills or from data it reads itself.

Its host names the transport and `source` makes the rank's `BatchSource` of it: a spawned
worker's queue (queue.py), which a feeder thread in the main process fills through shared-memory
slots (slots.py); the epochs that spawned workers are sent once per fit to read themselves
(epochs.py); or the training data as fit() takes it (data.py), which torchrun's ranks and one
worker in the caller's process hold. Of data it reads itself, a rank claims its batches
first-come (claims.py) or reads its dealt shard (shard.py).
"""

from __future__ import annotations

from typing import TypeAlias

from ..types import Counters, DataOrder
from .claims import ClaimSource, Counter
from .data import Batches
from .epochs import ListEpochs
from .protocols import BatchSource, Epochs
from .queue import QueueSource
from .shard import ShardSource

Transport: TypeAlias = "QueueSource | Epochs | Batches"  # what a host names: its queue, epochs sent once per fit, or the data it holds


def source(
    transport: Transport, rank: int, world_size: int, counters: Counters, until_epoch: int, claims: Counter | None = None, order: DataOrder | None = None
) -> BatchSource:
    """Rank `rank`'s batches of a fit that starts where `counters` stand and runs to `until_epoch`:
    a queue as it is; of data the rank reads itself (`Epochs`, or a list or tuple of batches),
    claimed first-come from `claims` where there is a counter, else its dealt shard (a
    DataLoader, a generator or a function: always dealt), its epochs in the order kept for a
    resume (`order`, feed/order.py)."""
    if isinstance(transport, QueueSource):
        return transport
    if claims is not None and isinstance(transport, (list, tuple)):
        transport = ListEpochs(transport)
    if claims is not None and isinstance(transport, Epochs):
        return ClaimSource(transport, claims, counters.epoch, counters.position, until_epoch)
    return ShardSource(transport, rank, world_size, counters.epoch, counters.position, order)


__all__ = ["Transport", "source"]
