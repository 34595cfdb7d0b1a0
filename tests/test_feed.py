"""The shard a worker reads (torchrun, one worker, spawned workers given a list or a map-style
DataLoader): rank-strided batches, resumed positions, DataLoaders that a DistributedSampler
shards already, and a map-style loader's batches loaded only by the worker they are dealt to;
and the source a host gets of the transport it names (feed.source)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from parallelwrapper import feed
from parallelwrapper.config import Config
from parallelwrapper.feed.claims import ClaimSource
from parallelwrapper.feed.epochs import shardable, shards_of
from parallelwrapper.feed.protocols import EndOfEpoch
from parallelwrapper.feed.shard import ShardSource
from parallelwrapper.types import Counters

pytestmark = pytest.mark.fast


def drain(source: ShardSource) -> list[Any]:
    out = []
    while not isinstance(item := source.next_batch(), EndOfEpoch):
        out.append(item)
    return out


def test_rank_strided_shard_and_resumed_position() -> None:
    data = list(range(7))
    assert [i for i, _ in drain(ShardSource(data, 1, 2))] == [1, 3, 5]
    source = ShardSource(data, 0, 2, skip=3)
    assert [i for i, _ in drain(source)] == [4, 6]  # the first epoch resumes after batch 2
    assert [i for i, _ in drain(source)] == [0, 2, 4, 6]  # the next is whole


def test_distributed_sampler_is_not_sharded_twice_and_gets_the_epoch() -> None:
    dataset = TensorDataset(torch.arange(20))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    source = ShardSource(loader, 1, 2, epoch=3)
    taken = drain(source)
    assert [i for i, _ in taken] == [1, 3, 5, 7, 9]  # indices in the epoch of both ranks, as dealt
    first = [int(v) for _, (b,) in taken for v in b]
    second = [int(v) for _, (b,) in drain(source) for v in b]
    assert len(first) == len(second) == 10  # all of this rank's half, not a quarter
    sampler.set_epoch(3)
    assert first == [int(i) for i in sampler]  # the epoch was passed on
    assert first != second


def test_spawned_workers_read_a_list_or_tuple_in_shards_unless_told_or_replacing() -> None:
    batches = [(torch.zeros(2, 3), torch.zeros(2))]
    assert shardable(batches, "auto", replaces=False) and shardable(tuple(batches), "auto", replaces=False)
    assert not shardable(batches, "queue", replaces=False)  # first-come, or dealt through the queue
    assert not shardable(batches, "auto", replaces=True)  # a replacement feeds a round again from the ledger
    assert not shardable(lambda: batches, "auto", replaces=False) and not shardable(iter(batches), "auto", replaces=False)
    with pytest.raises(ValueError, match=r"feed must be one of \['auto', 'queue'\], got 'shards'"):
        Config(feed="shards")


class Counted(TensorDataset):
    """A TensorDataset that counts the samples read from it (in this process)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.read = 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.read += 1
        return super().__getitem__(index)


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.arange(4))


def test_a_map_style_loader_is_read_in_shards_of_sample_indices_drawn_once() -> None:
    dataset = Counted(torch.arange(20), torch.arange(20) % 3)
    loader = DataLoader(dataset, batch_size=3, shuffle=True)  # 7 batches, the last of 2
    assert shardable(loader, "auto", replaces=False) and not shardable(loader, "queue", replaces=False)
    assert not shardable(DataLoader(dataset, batch_size=3, num_workers=1), "auto", replaces=False)  # its own workers load
    assert not shardable(DataLoader(Stream(), batch_size=2), "auto", replaces=False)  # no indices to deal
    # What cannot go to the workers goes through the queue: a collate function or a dataset that does not pickle.
    assert not shardable(DataLoader(dataset, batch_size=3, collate_fn=lambda samples: samples), "auto", replaces=False)
    unpicklable = Counted(torch.arange(4))
    unpicklable.lock = threading.Lock()  # type: ignore[attr-defined]
    assert not shardable(DataLoader(unpicklable, batch_size=2), "auto", replaces=False)
    torch.manual_seed(0)
    shards = shards_of(loader, 2, 4)  # epochs 2 and 3, drawn here: one shuffle each, as the loader would
    torch.manual_seed(0)
    expected = [[b for b, _ in loader] for _ in range(2)]
    assert dataset.read == 40  # the loader's own two epochs, just now; drawing the shards read nothing
    source = ShardSource(shards, 1, 2, epoch=2, skip=2)
    for epoch, skip in ((0, 2), (1, 0)):  # the first epoch resumes after batch 1
        taken = drain(source)
        assert [i for i, _ in taken] == [i for i in range(7) if i % 2 == 1 and i >= skip]
        assert all(torch.equal(x, expected[epoch][i]) for i, (x, _) in taken)
    assert dataset.read == 40 + 3 * 2 + 3 * 3  # this worker loaded batches 3 and 5, then 1, 3 and 5


class Keyed(torch.utils.data.Dataset[torch.Tensor]):
    """A map-style dataset indexed by names."""

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.tensor(float(ord(key)))

    def __len__(self) -> int:
        return 3


def test_a_loader_whose_sampler_yields_keys_is_dealt_by_its_keys() -> None:
    loader = DataLoader(Keyed(), batch_size=2, sampler=["b", "a", "c"])
    assert shardable(loader, "auto", replaces=False)
    shards = shards_of(loader, 0, 1)
    assert [(i, b.tolist()) for i, b in drain(ShardSource(shards, 0, 2))] == [(0, [98.0, 97.0])]
    assert [(i, b.tolist()) for i, b in drain(ShardSource(shards, 1, 2))] == [(1, [99.0])]


def test_a_tensor_dataset_is_indexed_once_a_batch_into_the_loaders_own_batches() -> None:
    dataset = TensorDataset(torch.randn(20, 3), torch.arange(20) % 3)
    loader = DataLoader(dataset, batch_size=6, shuffle=True)
    torch.manual_seed(1)
    shards = shards_of(loader, 0, 1)
    torch.manual_seed(1)
    expected = list(loader)
    taken = drain(ShardSource(shards, 0, 1))
    assert len(taken) == len(expected) == 4
    for (_, got), want in zip(taken, expected, strict=True):
        assert type(got) is type(want) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))


def test_a_source_tells_the_epochs_length_only_where_every_rank_knows_it() -> None:
    """The autopilot cuts an epoch's last rounds by it (Pilot.steps): every rank must answer alike."""
    data = list(range(7))
    assert ShardSource(data, 1, 2).epoch_length(0) == ShardSource(data, 0, 2).epoch_length(5) == 7  # a list: every batch of both ranks
    assert ShardSource(lambda: iter(data), 0, 2).epoch_length(0) is None  # a function's epochs are known as they end
    dataset = TensorDataset(torch.arange(20))
    presharded = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    assert ShardSource(presharded, 0, 2).epoch_length(0) is None  # this rank's share only
    loader = DataLoader(dataset, batch_size=3)  # 7 batches
    shards = shards_of(loader, 2, 4)  # epochs 2 and 3, read by index
    assert ShardSource(shards, 1, 2, epoch=2).epoch_length(3) == 7
    claims = ClaimSource(shards, Count(), 2, 0, 4)
    assert (claims.epoch_length(2), claims.epoch_length(3), claims.epoch_length(4)) == (7, 7, None)  # past the fit: none


class Count:
    def __init__(self) -> None:
        self.next = 0

    def claim(self) -> int:
        self.next += 1
        return self.next - 1


def test_a_host_names_its_transport_and_the_feed_picks_the_source() -> None:
    """Data read by index is claimed where the host has a counter, else dealt; other data, which
    every rank iterates (a DataLoader under torchrun), is dealt even with a counter."""
    batches = [torch.full((1,), float(i)) for i in range(5)]
    at = Counters(epoch=1, position=2)  # a resumed fit: epoch 1, after its first two batches
    claimed = feed.source(batches, 1, 2, at, until_epoch=2, claims=Count())
    assert isinstance(claimed, ClaimSource) and [i for i, _ in drain(claimed)] == [2, 3, 4]  # every batch: one worker here
    assert isinstance(feed.source(shards_of(batches, 1, 2), 1, 2, at, 2, Count()), ClaimSource)  # sent to spawned workers
    dealt = feed.source(batches, 1, 2, at, 2)
    assert isinstance(dealt, ShardSource) and [i for i, _ in drain(dealt)] == [3]
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    held = feed.source(loader, 0, 2, Counters(), 1, Count())
    assert isinstance(held, ShardSource) and [i for i, _ in drain(held)] == [0, 2]
