"""on_worker_failure("replace"): the fault matrix with real spawned processes and real gloo. A
fault (SIGKILL, a raise, a stall) strikes once, on one batch; fit() completes, every batch counts
once, and with the deterministic feed the model equals the fault-free run's. A batch that fails
two workers, and more failures than allowed, raise; the conftest fixture checks no process is left."""

from __future__ import annotations

import collections
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parallelwrapper import ParallelWrapper, WorkerError
from parallelwrapper.feed import END_SLOT
from parallelwrapper.hosts.ledger import Entry, Ledger, split

from tiny import mlp

pytestmark = pytest.mark.timeout(120)

BATCHES, SIZE = 12, 8


def batches(n: int = BATCHES) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(inputs, targets, batch id): the id lets a step name the batch it trains on."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(SIZE, 10, generator=g), torch.randint(0, 3, (SIZE,), generator=g), torch.tensor([i])) for i in range(n)]


# -- the training step and its faults (module level: spawned workers import it) ---------------------


def _strike(fault: str) -> None:
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    elif fault == "raise":
        raise RuntimeError("boom on a marked batch")
    elif fault == "stall":
        time.sleep(600)


def step(model: nn.Module, batch: Any) -> torch.Tensor:
    """Records each batch id it trains on (a line in $PW_TEST_LOG), and strikes $PW_TEST_FAULT on
    the batch ids in $PW_TEST_AT: once per id (the first time: a flag file), or on every take
    with $PW_TEST_EVERY_TIME."""
    x, y, ids = batch
    batch_id = int(ids[0])
    with open(os.environ["PW_TEST_LOG"], "a") as log:
        log.write(f"{batch_id}\n")
    if str(batch_id) in os.environ.get("PW_TEST_AT", "").split(","):
        flag = Path(os.environ["PW_TEST_LOG"] + f".struck-{batch_id}")
        if os.environ.get("PW_TEST_EVERY_TIME") or not flag.exists():
            flag.touch()
            _strike(os.environ["PW_TEST_FAULT"])
    return nn.functional.cross_entropy(model(x), y)


class Heard:
    """A listener that keeps what on_worker_replaced hears."""

    def __init__(self) -> None:
        self.replaced: list[tuple[int, WorkerError, int]] = []

    def on_worker_replaced(self, rank: int, reason: WorkerError, lost_round: int) -> None:
        self.replaced.append((rank, reason, lost_round))


def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, *, fault: str = "", at: str = "", k: int = 2,
          deterministic: bool = True, max_replacements: int = 3, epochs: int = 2, every_time: bool = False,
          fits: int = 1, workers: int = 2, mode: str = "averaging", momentum: float = 0.0) -> tuple[nn.Module, Any, Heard, list[int]]:  # fmt: skip
    log = tmp_path / f"{name}.log"
    monkeypatch.setenv("PW_TEST_LOG", str(log))
    monkeypatch.setenv("PW_TEST_FAULT", fault)
    monkeypatch.setenv("PW_TEST_AT", at)
    monkeypatch.setenv("PW_TEST_EVERY_TIME", "1" if every_time else "")
    heard = Heard()
    model = mlp()
    b = (
        ParallelWrapper.builder(model).workers(workers).threads_per_worker(1).deterministic(deterministic)
        .optimizer(torch.optim.SGD, lr=0.1, momentum=momentum).training_step(step).averaging_frequency(k).training_mode(mode)
        .stall_timeout(3).on_worker_failure("replace", max_replacements=max_replacements).listeners(heard)
    )  # fmt: skip
    with b.build() as wrapper:
        for _ in range(fits):  # a fit() ends holding no slot, whatever it took
            history = wrapper.fit(batches(), epochs=epochs // fits)
        assert wrapper.samples == epochs * BATCHES * SIZE  # every batch landed once, by the counters
    trained = [int(line) for line in log.read_text().split()] if log.exists() else []
    return model, history, heard, trained


def assert_each_batch_counted_once(trained: list[int], epochs: int, lost: set[int]) -> None:
    """Every batch was trained `epochs` times, plus once more for those of the lost round
    (trained before the fault, then again from the average)."""
    counts = collections.Counter(trained)
    assert set(counts) == set(range(BATCHES))
    extra = {i: c - epochs for i, c in counts.items() if c != epochs}
    assert set(extra) <= lost and all(c == 1 for c in extra.values()), extra


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> nn.Module:
    with pytest.MonkeyPatch.context() as mp:
        model, _, heard, trained = train(tmp_path_factory.mktemp("fault-free"), mp, "clean", fits=2)
    assert not heard.replaced and sorted(trained) == sorted(list(range(BATCHES)) * 2)
    return model


@pytest.mark.parametrize("fault", ["kill", "raise", "stall"])
def test_a_fault_once_replaces_the_worker_and_ends_as_the_fault_free_run(
    fault: str, fault_free: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batch 5 is worker 1's (5 mod 2) in round 2 (batches 4-7, k = 2) of epoch 0.
    started = time.monotonic()
    model, history, heard, trained = train(tmp_path, monkeypatch, fault, fault=fault, at="5")
    assert [(rank, lost_round) for rank, _, lost_round in heard.replaced] == [(1, 2)]
    reason = heard.replaced[0][1]
    assert reason.rank == 1 and reason.batch == 5 and reason.epoch == 0
    if fault == "raise":
        assert "boom on a marked batch" in str(reason) and "Traceback" in reason.details
    if fault == "stall":
        assert "stalled" in reason.summary
    assert [(r.rank, r.lost_round) for r in history.replacements] == [(1, 2)]
    assert_each_batch_counted_once(trained, epochs=2, lost={4, 5, 6, 7})
    assert_same_model(model, fault_free)
    assert time.monotonic() - started < 60


@pytest.mark.filterwarnings("ignore:3 workers on 2 CPU cores")
def test_three_workers_sharing_gradients_with_momentum_end_bitwise_equal_to_the_fault_free_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batch 7 is worker 1's (7 mod 3) in step 3 (batches 6-8) of epoch 0.
    run = {"workers": 3, "mode": "shared-gradients", "k": 1, "momentum": 0.9}
    model, _, heard, trained = train(tmp_path, monkeypatch, "kill", fault="kill", at="7", **run)  # type: ignore[arg-type]
    reference, _, _, _ = train(tmp_path, monkeypatch, "clean", **run)  # type: ignore[arg-type]
    assert [(rank, lost_round) for rank, _, lost_round in heard.replaced] == [(1, 3)]
    assert_each_batch_counted_once(trained, epochs=2, lost={6, 7, 8})
    for name, x in model.state_dict().items():
        assert torch.equal(x, reference.state_dict()[name]), name


def test_first_come_feed_counts_every_batch_once_after_a_kill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, history, heard, trained = train(tmp_path, monkeypatch, "first-come", fault="kill", at="5", deterministic=False, epochs=1)
    assert len(heard.replaced) == 1 and heard.replaced[0][1].batch == 5
    assert history.scores[-1].iteration == BATCHES
    assert_each_batch_counted_once(trained, epochs=1, lost=set(range(BATCHES)))


def test_a_poison_batch_raises_naming_it_after_two_workers_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(WorkerError, match=r"batch 5 of epoch 0 failed on two workers in turn") as raised:
        train(tmp_path, monkeypatch, "poison", fault="raise", at="5", every_time=True)
    assert raised.value.batch == 5 and "fix or drop that batch" in str(raised.value).splitlines()[0]


def test_more_failures_than_allowed_raise_the_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(WorkerError, match=r"worker 0 failed while training on batch 8 of epoch 0") as raised:
        train(tmp_path, monkeypatch, "too-many", fault="raise", at="5,8", max_replacements=1)
    assert "boom on a marked batch" in str(raised.value)


# -- the fast tier: the ledger's bookkeeping ------------------------------------------------------


@pytest.mark.fast
def test_the_ledger_frees_landed_rounds_and_keeps_the_round_taken_ahead_and_the_epochs_end() -> None:
    import multiprocessing

    ledger = Ledger(multiprocessing.get_context("spawn"), 6)
    ledger.cut(1, 0, finished=False)
    for slot in (10, 11):
        ledger.take(slot)
    ledger.tag = 2  # the batch looked ahead at, for round 2
    ledger.take(12)
    assert ledger.cut(2, 0, finished=False) == [10, 11]
    ledger.take(END_SLOT)
    assert ledger.entries() == [Entry(2, 12, 0), Entry(2, END_SLOT, 0)]
    assert ledger.cut(3, 0, finished=True) == [12]
    assert ledger.entries() == [Entry(2, END_SLOT, 0)]  # the end stays while the epoch lasts
    assert ledger.cut(4, 1, finished=False) == [] and ledger.entries() == []


@pytest.mark.fast
def test_a_redo_feeds_again_what_was_taken_for_its_round_or_later() -> None:
    entries = [Entry(3, 1, 0), Entry(3, 2, 0), Entry(4, 5, 0), Entry(3, END_SLOT, 0), Entry(1, END_SLOT, -1)]
    # A survivor whose round 3 landed for the others: round 4 is redone.
    again, free = split(entries, 4, 0)
    assert again == [Entry(4, 5, 0), Entry(3, END_SLOT, 0)] and free == [1, 2]
    assert split(entries, 3, 0) == ([Entry(3, 1, 0), Entry(3, 2, 0), Entry(4, 5, 0), Entry(3, END_SLOT, 0)], [])
