"""A batch's tensors reach the workers' forward as the data made them: channels_last images stay
channels_last, and keep their dtype, whichever way the batches travel (the main process's queue
and shared-memory slots, first-come or dealt; a list, or a map-style DataLoader, read in shards;
the in-process worker). Spawned workers, real gloo. The slots' own round trip, layout by layout,
is in test_slots.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from parallelwrapper import ParallelWrapper
from parallelwrapper.feed.epochs import shards_of
from parallelwrapper.feed.shard import ShardSource

pytestmark = pytest.mark.timeout(180)

BATCHES, BATCH = 12, 8


# -- module level: these travel to spawned workers and to the loader's processes ------------------


class Images(Dataset[tuple[torch.Tensor, int]]):
    """uint8 images of 3 x 8 x 8, row-major each, with a class of 3."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def channels_last_collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of images in channels_last, as a vision pipeline makes them for convolutions."""
    images = torch.stack([x for x, _ in samples]).contiguous(memory_format=torch.channels_last)
    return images, torch.tensor([y for _, y in samples])


class RecordsItsInputs(nn.Module):
    """A small convnet whose forward writes, one line an input, whether the input is channels_last
    and its dtype, to a file of its process in `folder`."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.folder = folder
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(Path(self.folder) / f"{os.getpid()}.txt", "a") as f:
            f.write(f"{x.is_contiguous(memory_format=torch.channels_last)} {x.dtype}\n")
        return self.head(self.conv(x.float() / 255).mean(dim=(2, 3)))


def seen(folder: Path) -> dict[str, list[str]]:
    """Each process's lines: {pid: ["True torch.uint8", ...]}."""
    return {p.stem: p.read_text().splitlines() for p in folder.iterdir()}


FEEDS: dict[str, tuple[dict[str, Any], str]] = {
    # name: (builder options, data: a loader with processes of its own, one loading here, or a list)
    "loader with 2 processes, first-come queue": ({}, "loader 2"),
    "loader with 2 processes, dealt queue": ({"deterministic": True}, "loader 2"),
    "map-style loader, read in shards": ({}, "loader 0"),
    "map-style loader, queue": ({"feed": "queue"}, "loader 0"),
    "list, read in shards": ({}, "list"),
    "list, queue": ({"feed": "queue"}, "list"),
    "in-process worker": ({"workers": 1}, "loader 0"),
}


@pytest.mark.parametrize("name", FEEDS)
def test_every_input_a_workers_forward_sees_is_still_channels_last(tmp_path: Path, name: str) -> None:
    options, data = FEEDS[name]
    loader = DataLoader(Images(BATCHES * BATCH), batch_size=BATCH, collate_fn=channels_last_collate, num_workers=2 if data == "loader 2" else 0)
    batches = list(loader) if data == "list" else loader
    builder = ParallelWrapper.builder(RecordsItsInputs(str(tmp_path))).optimizer(torch.optim.SGD, lr=0.1).workers(2).threads_per_worker(1).averaging_frequency(2)
    for option, value in options.items():
        getattr(builder, option)(value)
    with builder.build() as w:
        w.fit(batches)
        assert w.counters.iterations == BATCHES
    lines = seen(tmp_path)
    assert sum(len(v) for v in lines.values()) == BATCHES, lines  # one forward a batch, all of them in workers
    assert (str(os.getpid()) in lines) == (options.get("workers") == 1)  # spawned workers forward in processes of their own
    assert {line for v in lines.values() for line in v} == {"True torch.uint8"}, lines


@pytest.mark.fast
@pytest.mark.parametrize("data", ["list", "loader 0"])
def test_a_rank_reading_its_shard_in_its_own_process_gets_the_batches_as_made(data: str) -> None:
    """torchrun's ranks and the in-process worker read their shard where it is made (ShardSource),
    as spawned workers read a list or a map-style loader's DatasetEpochs: no copy in between."""
    loader = DataLoader(Images(5 * BATCH), batch_size=BATCH, collate_fn=channels_last_collate)
    source = ShardSource(list(loader) if data == "list" else shards_of(loader, 0, 1), rank=1, world_size=2)
    got = []
    while isinstance(item := source.next_batch(), tuple):
        got.append(item)
    assert [index for index, _ in got] == [1, 3]
    assert all(x.is_contiguous(memory_format=torch.channels_last) and x.dtype == torch.uint8 for _, (x, _) in got)
