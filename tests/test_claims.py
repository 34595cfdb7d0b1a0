"""First-come claims (feed/claims.py): workers that claim from one counter at any pace train every
batch of every epoch once, in index order, and each ends its epoch (END) by claiming past it.
Fast tier: one process, the workers interleaved by hand."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from parallelwrapper.feed.claims import ClaimSource
from parallelwrapper.feed.epochs import DatasetEpochs, ListEpochs
from parallelwrapper.feed.protocols import END

pytestmark = pytest.mark.fast


class Count:
    def __init__(self) -> None:
        self._it = itertools.count()

    def claim(self) -> int:
        return next(self._it)


def _run(workers: int, length: int, epoch: int, skip: int, until: int, seed: int) -> list[list[list[int]]]:
    """Each epoch's indices as each worker got them, the workers taking turns at random (one of
    them many times faster), each stopping at its END until all have had theirs."""
    counter, pick = Count(), random.Random(seed)
    sources = [ClaimSource(ListEpochs(list(range(length))), counter, epoch, skip, until) for _ in range(workers)]
    epochs = []
    for _ in range(epoch, until):
        got: list[list[int]] = [[] for _ in range(workers)]
        ended: set[int] = set()
        while len(ended) < workers:
            w = pick.choices(range(workers), weights=[5] + [1] * (workers - 1))[0]
            if w in ended:
                continue
            item = sources[w].next_batch()
            if item is END:
                ended.add(w)
            else:
                assert isinstance(item, tuple) and item[0] == item[1]  # the batch is the one at its index
                got[w].append(item[0])
        epochs.append(got)
    return epochs


@pytest.mark.parametrize(("workers", "length", "skip", "seed"), [(2, 10, 0, 0), (3, 7, 0, 1), (2, 9, 4, 2), (4, 3, 0, 3), (5, 2, 1, 4)])
def test_every_batch_of_every_epoch_is_claimed_once_in_index_order(workers: int, length: int, skip: int, seed: int) -> None:
    epochs = _run(workers, length, epoch=2, skip=skip, until=5, seed=seed)
    assert len(epochs) == 3
    for e, got in enumerate(epochs):
        first = skip if e == 0 else 0
        assert sorted(itertools.chain(*got)) == list(range(first, length))
        assert all(mine == sorted(mine) for mine in got)


def test_the_faster_worker_takes_more() -> None:
    (got,) = _run(2, 600, epoch=0, skip=0, until=1, seed=5)
    assert len(got[0]) > 3 * len(got[1]) > 0


def test_a_map_style_loader_is_read_by_index_as_it_would_batch() -> None:
    dataset = TensorDataset(torch.arange(20.0), torch.arange(20))
    loader = DataLoader(dataset, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0))
    epochs = DatasetEpochs.of(loader, 0, 2)
    assert epochs.length(0) == epochs.length(1) == 7
    batches = [epochs.batch_at(1, i) for i in range(epochs.length(1))]
    assert [len(b[1]) for b in batches] == [3] * 6 + [2]
    drawn = epochs.epochs[1]
    assert isinstance(drawn, tuple)  # integer keys: packed in tensors
    assert [int(i) for b in batches for i in b[1]] == drawn[0].tolist()  # epoch 1's shuffle, in its order
    assert sorted(drawn[0].tolist()) == list(range(20))
