"""The shard a worker reads (torchrun, one worker, spawned workers given a list): rank-strided
batches, resumed positions, and DataLoaders that a DistributedSampler shards already."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from parallelwrapper.config import Config
from parallelwrapper.feed import ShardSource, shardable
from parallelwrapper.types import EndOfEpoch

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
