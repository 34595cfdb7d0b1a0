"""A resume trains every sample of the interrupted epoch exactly once, whatever the loader (issue 50).

The model counts: its one parameter `seen` gains exactly 1/N at a sample's index each time one
of N workers trains on that sample (SGD at lr 1 on the loss -Σ seen[ids], averaged every step
over N equal weights),
so N·seen after an epoch is how often each sample was trained. A fit is stopped mid-epoch by a
listener, after a checkpoint every round, and resumed by a new wrapper: every count must be 1.
Before the epochs' orders were kept, a shuffled loader drew another order on resume and counted
0 and 2.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from parallelwrapper import ParallelWrapper, Score
from parallelwrapper.checkpoint import checkpoint_counters
from parallelwrapper.feed.order import ORDER_FILE, set_epoch

SAMPLES, BATCH = 64, 4


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen = nn.Parameter(torch.zeros(SAMPLES))


def count_step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return -model.seen[batch[0]].sum()


_STEPS = [0]  # steps this process took through `slowed`


def slowed(model: nn.Module, batch: list[torch.Tensor], step: Any) -> torch.Tensor:
    """`step`, taking 0.3 s from each process's fourth step on: a listener's stop at round 3 then
    reaches spawned workers long before the epoch's end, however loaded the machine (they raced
    through the whole epoch first once in CI, and the checkpoint was at its end)."""
    _STEPS[0] += 1
    if _STEPS[0] > 3:
        time.sleep(0.3)
    return step(model, batch)


def stopping(step: Any) -> Any:
    """`step` slowed, for a run that a listener stops at round 3 (`stop_at`)."""
    _STEPS[0] = 0  # one worker in this process: it counts from here
    return functools.partial(slowed, step=step)


class Stop(RuntimeError):
    pass


def stop_at(round_: int):  # type: ignore[no-untyped-def]
    def listener(score: Score) -> None:
        if score.round == round_:
            raise Stop("stopped by the test")

    return listener


def shuffled(generator: torch.Generator | None = None) -> DataLoader[tuple[torch.Tensor]]:
    return DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=BATCH, shuffle=True, generator=generator)


def counting(workers: int, directory: Path, *listeners: object, feed: str = "auto", step: Any = count_step) -> ParallelWrapper:
    """k = 1 and batches dealt (worker i takes batch i mod N, through the queue or from its shard),
    so that every round averages one batch of each worker, N equal weights: first come, one
    worker may take two of a round's batches, and its samples would count 2 (seen under load)."""
    return (
        ParallelWrapper.builder(Counts()).workers(workers).threads_per_worker(1).training_step(step)
        .optimizer(torch.optim.SGD, lr=1.0).feed(feed).deterministic(workers > 1)
        .checkpoint(directory, every=1).listeners(*listeners).build()
    )  # fmt: skip


@pytest.mark.parametrize(("workers", "feed"), [(1, "auto"), (2, "auto"), (2, "queue")], ids=["in-process", "shards", "queue"])
def test_a_shuffled_loader_resumed_mid_epoch_trains_every_sample_once(tmp_path: Path, workers: int, feed: str) -> None:
    with counting(workers, tmp_path, stop_at(3), feed=feed, step=stopping(count_step)) as wrapper, pytest.raises(Exception, match='stopped by the test'):
        wrapper.fit(shuffled(), epochs=1)
    position = checkpoint_counters(tmp_path)["position"]
    assert 0 < position < SAMPLES // BATCH, "the checkpoint is mid-epoch"
    assert (tmp_path / ORDER_FILE).is_file()
    torch.manual_seed(1234)  # a resumed process draws from another RNG state
    with counting(workers, tmp_path, feed=feed) as resumed:
        resumed.fit(shuffled(), epochs=1, resume=tmp_path)
    counts = resumed.model.seen.detach() * workers
    assert torch.equal(counts, torch.ones(SAMPLES)), f"trained twice: {(counts > 1).sum()}, never: {(counts < 1).sum()}"


def mlp_step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x = batch[0].float().unsqueeze(1) / SAMPLES
    return nn.functional.mse_loss(model(x), torch.sin(3 * x))


def deterministic(directory: Path, *listeners: object, step: Any = mlp_step) -> ParallelWrapper:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    return (
        ParallelWrapper.builder(model).workers(2).threads_per_worker(1).deterministic(True).averaging_frequency(2)
        .training_step(step).optimizer(torch.optim.SGD, lr=0.1).checkpoint(directory, every=1).listeners(*listeners).build()
    )  # fmt: skip


def test_deterministic_resume_with_a_shuffling_loader_is_bitwise(tmp_path: Path) -> None:
    with deterministic(tmp_path / "whole") as whole:
        whole.fit(shuffled(), epochs=2)  # the loader shuffles from the global RNG, seeded above
    with deterministic(tmp_path / "cut", stop_at(3), step=stopping(mlp_step)) as cut, pytest.raises(Exception, match='stopped by the test'):
        cut.fit(shuffled(), epochs=2)
    assert checkpoint_counters(tmp_path / "cut")["position"] > 0, "the checkpoint is mid-epoch"
    with deterministic(tmp_path / "cut") as resumed:
        torch.manual_seed(99)  # a resumed process draws from another RNG state
        resumed.fit(shuffled(), epochs=2, resume=tmp_path / "cut")
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.fast
def test_a_resume_mid_epoch_without_a_kept_order_is_refused_for_a_shuffling_loader(tmp_path: Path) -> None:
    with counting(1, tmp_path, stop_at(3)) as wrapper, pytest.raises(Exception, match='stopped by the test'):
        wrapper.fit(shuffled(), epochs=1)
    (tmp_path / ORDER_FILE).unlink()  # as a checkpoint from before the orders were kept
    with counting(1, tmp_path) as resumed, pytest.raises(ValueError, match=r"keeps no record of that epoch's order .* train some samples twice"):
        resumed.fit(shuffled(), epochs=1, resume=tmp_path)
    plain = DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=BATCH)  # one order: skipping by position is exact
    with counting(1, tmp_path) as resumed:
        resumed.fit(plain, epochs=1, resume=tmp_path)


class Stream(IterableDataset[torch.Tensor]):
    """A streaming dataset that shuffles by its epoch, as Hugging Face `datasets` does."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.epoch)).split(BATCH)


TRAINED: list[int] = []  # the samples that `record` trained on, in order


def record(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    TRAINED.extend(batch.tolist())
    return -model.seen[batch].sum()


@pytest.mark.fast
def test_a_streaming_dataset_is_told_each_epoch_and_its_epochs_differ(tmp_path: Path) -> None:
    stream = Stream()
    loader = DataLoader(stream, batch_size=None)
    TRAINED.clear()
    wrapper = ParallelWrapper.builder(Counts()).workers(1).training_step(record).build()  # one worker: in this process
    wrapper.fit(loader, epochs=3)
    epochs = [TRAINED[i : i + SAMPLES] for i in range(0, 3 * SAMPLES, SAMPLES)]
    assert len(TRAINED) == 3 * SAMPLES and all(sorted(o) == list(range(SAMPLES)) for o in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and stream.epoch == 2
    set_epoch(loader, 7)
    assert stream.epoch == 7


@pytest.mark.fast
def test_a_stateful_dataloader_resumes_from_its_own_state(tmp_path: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader() -> DataLoader[tuple[torch.Tensor]]:
        return stateful.StatefulDataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=BATCH, shuffle=True)

    with counting(1, tmp_path, stop_at(5)) as wrapper, pytest.raises(Exception, match="stopped by the test"):
        wrapper.fit(loader(), epochs=1)
    assert 0 < checkpoint_counters(tmp_path)["position"] < SAMPLES // BATCH
    torch.manual_seed(4321)
    with counting(1, tmp_path) as resumed:
        resumed.fit(loader(), epochs=1, resume=tmp_path)
    assert torch.equal(resumed.model.seen.detach(), torch.ones(SAMPLES))
