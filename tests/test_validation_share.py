"""Each worker loads only its share of a map-style validation DataLoader: it draws the batches'
sample indices as iterating the loader would and loads its own (batch i on worker i mod N), so
the same batches are scored, by the same workers, as when every worker iterated the whole loader
and kept its share; an iterable keeps being iterated that way. Fast tier for the share itself;
spawned workers and real gloo for the validation."""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from parallelwrapper import ParallelWrapper
from parallelwrapper.feed.shard import rank_share
from tiny import make_batches, mlp

SAMPLES, BATCH = 200, 16  # 13 batches, the last of 8: 7 of them (104 samples) to rank 0, 6 (96) to rank 1


# -- module level: these travel to spawned workers ------------------------------------------------


class CountedSamples(TensorDataset):
    """A TensorDataset that counts the samples read from it: in this object, and, given a folder,
    one line a sample in a file of the reading process (its pid and name)."""

    def __init__(self, *tensors: torch.Tensor, folder: str | None = None) -> None:
        super().__init__(*tensors)
        self.folder, self.read = folder, 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.read += 1
        if self.folder is not None:
            with open(Path(self.folder) / f"{os.getpid()}.txt", "a") as f:
                f.write(f"{multiprocessing.current_process().name}\n")
        return super().__getitem__(index)


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Any:
        return iter(zip(self.x, self.y))


def samples(n: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)


def as_kept_before(loader: Any, rank: int, world: int) -> list[Any]:
    """What a worker scored before: the whole loader iterated, every world-th batch kept."""
    return [batch for i, batch in enumerate(loader) if i % world == rank]


def same_batches(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(all(torch.equal(s, t) for s, t in zip(x, y, strict=True)) for x, y in zip(a, b))


# -- the share, in this process --------------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("shuffle", [False, True], ids=["in order", "shuffled"])
def test_a_map_style_loader_is_loaded_by_index_only_for_this_ranks_batches(shuffle: bool) -> None:
    """The batches a rank scored before, in the same order, and the global RNG left where
    iterating the whole loader leaves it; only the rank's own samples read."""
    for rank, expected_reads in ((0, 104), (1, 96)):
        before = CountedSamples(*samples())
        torch.manual_seed(7)
        kept = as_kept_before(DataLoader(before, batch_size=BATCH, shuffle=shuffle), rank, 2)
        rng_before = torch.get_rng_state()
        now = CountedSamples(*samples())
        torch.manual_seed(7)
        share = list(rank_share(DataLoader(now, batch_size=BATCH, shuffle=shuffle), rank, 2))
        assert same_batches(share, kept)
        assert torch.equal(torch.get_rng_state(), rng_before)
        assert (before.read, now.read) == (SAMPLES, expected_reads)


@pytest.mark.fast
def test_the_loaders_collate_function_and_its_own_generator_are_used() -> None:
    dataset = CountedSamples(*samples(40))
    loader = DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(4), collate_fn=list)
    kept = as_kept_before(loader, 1, 3)
    loader.generator.manual_seed(4)
    state = torch.get_rng_state()
    share = list(rank_share(loader, 1, 3))
    assert torch.equal(torch.get_rng_state(), state)  # the loader's generator drew, not the global one
    assert [[int(s[1]) for s in batch] for batch in share] == [[int(s[1]) for s in batch] for batch in kept]
    assert all(isinstance(batch, list) and len(batch) == 8 for batch in share)  # collated by `list`


@pytest.mark.fast
def test_iterables_and_presharded_loaders_are_iterated_as_before() -> None:
    x, y = samples(64)
    dataset = CountedSamples(x, y)
    presharded = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False))
    assert same_batches(list(rank_share(presharded, 1, 2)), list(presharded))  # the sampler's share, all of it
    stream = DataLoader(Stream(x, y), batch_size=BATCH)
    assert same_batches(list(rank_share(stream, 0, 2)), as_kept_before(stream, 0, 2))
    batches = make_batches(5)
    assert same_batches(list(rank_share(batches, 1, 2)), batches[1::2])


# -- spawned workers --------------------------------------------------------------------------------


def validate(data: Any) -> list[dict[str, float]]:
    """The validations of a deterministic 2-worker fit, 3 rounds, each validated, on `data`."""
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1).workers(2).threads_per_worker(1)
        .averaging_frequency(2).deterministic(True).validation(data, every=1)
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(make_batches(12))
        assert len(history.validations) == 3
        last = w.evaluate(data)
    assert history.validations[-1].metrics["val_loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert history.validations[-1].metrics["val_accuracy"] == pytest.approx(last["accuracy"])
    return [v.metrics for v in history.validations]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("processes", [0, 2], ids=["loader", "loader with processes"])
def test_each_worker_loads_about_half_of_a_map_style_validation_loader(tmp_path: Path, processes: int) -> None:
    """Per validation, worker 0 reads the 104 samples of its 7 batches and worker 1 the 96 of its
    6, where each read all 200 before; the metrics are exactly those of the same batches as a
    list, which the workers deal as before, and the last is the final model's, scored here. A
    loader with processes of its own loads in the workers too (daemons, which may start none)."""
    x, y = samples()
    loader = DataLoader(CountedSamples(x, y, folder=str(tmp_path)), batch_size=BATCH, num_workers=processes)
    metrics = validate(loader)
    reads = {pid: Counter(p.read_text().splitlines()) for pid, p in ((p.stem, p) for p in tmp_path.iterdir())}
    workers = {pid: sum(names.values()) for pid, names in reads.items() if all(n.startswith("parallelwrapper") for n in names)}
    assert sorted(workers.values()) == [3 * 96, 3 * 104], reads  # 3 validations
    assert str(os.getpid()) not in workers
    assert metrics == validate(list(DataLoader(TensorDataset(x, y), batch_size=BATCH)))
