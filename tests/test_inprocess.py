"""`.workers(1)` on the CPU trains in the caller's process (inprocess.py): the same results as a
spawned worker, and none of the caller's state touched but the model and optimizer it gave."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallelwrapper import ParallelWrapper, Score, WorkerError
from parallelwrapper.feed.data import FeedError
from parallelwrapper.hosts.inprocess import InProcessWorker
from parallelwrapper.hosts.spawned import WorkerPool
from parallelwrapper.messages import FitCommand
from parallelwrapper.types import Counters, TrainingState

pytestmark = pytest.mark.timeout(120)


def dropout_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def one_worker(model: nn.Module) -> Any:
    return ParallelWrapper.builder(model).workers(1).threads_per_worker(1).averaging_frequency(3)


def test_in_process_worker_trains_as_a_spawned_worker_0_bitwise() -> None:
    """Dropout draws from the worker's RNG stream: seeded as spawned worker 0's, and carried
    from one fit() to the next."""
    data = make_batches(10)
    with one_worker(dropout_mlp()).optimizer(torch.optim.Adam, lr=0.01).build() as w:
        config, job = w.config, w._job

    def two_fits(worker: Any) -> tuple[list[float], dict[str, Any], dict[str, Any]]:
        scores: list[float] = []

        def keep(report: Any) -> None:
            if isinstance(report, Score):
                scores.append(report.score)

        try:
            state = TrainingState(dropout_mlp().state_dict(), job.make_optimizer(dropout_mlp()).state_dict())
            counters = Counters()
            for until_epoch in (2, 3):
                state = worker.fit(FitCommand(until_epoch, counters, state, None, time.monotonic()), data, keep)
                counters = Counters(epoch=until_epoch)
        finally:
            worker.close()
        return scores, state.model, state.optimizer

    spawned = two_fits(WorkerPool(config, job))
    in_process = two_fits(InProcessWorker(config, job))
    assert len(in_process[0]) == 3 * 4 and in_process[0] == spawned[0]  # 10 batches, k = 3: 4 rounds an epoch
    for k, v in spawned[1].items():
        assert torch.equal(in_process[1][k], v), k
    for i, st in spawned[2]["state"].items():
        for k, v in st.items():
            assert torch.equal(in_process[2]["state"][i][k], v), (i, k)


def test_one_worker_leaves_the_callers_process_as_it_was() -> None:
    """No process spawned, no default group made; the caller's RNG state and thread count are
    theirs again after fit(); and a fit() that fails leaves the model as it was."""
    model = dropout_mlp()
    torch.manual_seed(123)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    during: list[tuple[int, int]] = []

    def look(score: Score) -> None:
        children = [p for p in multiprocessing.active_children() if p.name.startswith("parallelwrapper")]
        during.append((len(children), torch.get_num_threads()))

    builder = one_worker(model).threads_per_worker(threads + 1).listeners(look)
    with builder.build() as w:
        w.fit(make_batches(6))
        assert during == [(0, threads + 1)] * 2
        assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads
        assert not dist.is_initialized()

        trained = {k: v.clone() for k, v in model.state_dict().items()}

        def fails_after_two_rounds() -> Any:
            yield from make_batches(6)
            raise OSError("disk went away")

        with pytest.raises(FeedError, match="disk went away"):
            w.fit(fails_after_two_rounds)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
        assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads


def fails_on_batch_4(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    if int(y[0]) == 7:
        raise RuntimeError("boom on batch 4")
    return nn.functional.cross_entropy(model(x), y)


def nan_on_batch_4(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y.clamp(max=2))
    return loss * float("nan") if int(y[0]) == 7 else loss


def test_a_nan_with_an_outer_optimizer_names_the_outer_settings_too() -> None:
    """DiLoCo's outer lr 0.7 and momentum 0.9 at pw-fit's k = 3 drove LeNet's loss to NaN in 17
    steps; the message named only the learning rate."""
    data = make_batches(8)
    data[4] = (data[4][0], torch.full_like(data[4][1], 7))
    builder = one_worker(dropout_mlp()).training_step(nan_on_batch_4).outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    with builder.build() as w, pytest.raises(WorkerError, match=r"^worker 0 failed in epoch 0 \(local step 4\): loss is nan .*; lower the learning rate or the outer optimizer's \(DiLoCo's"):
        w.fit(data)


@pytest.mark.parametrize(
    ("step", "first_line"),
    [
        (fails_on_batch_4, "worker 0 failed while training on batch 4 of epoch 0 (float32[16, 10], int64[16]) (local step 4): RuntimeError: boom on batch 4"),
        (nan_on_batch_4, "worker 0 failed in epoch 0 (local step 4): loss is nan at local step 4 (epoch 0); lower the learning rate"),
    ],
    ids=["raise", "nan"],
)
def test_a_failure_is_the_same_worker_error_as_from_spawned_workers(step: Any, first_line: str) -> None:
    """Before, one worker raised the bare TrainingError or FloatingPointError."""
    data = make_batches(8)
    data[4] = (data[4][0], torch.full_like(data[4][1], 7))
    model = dropout_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with one_worker(model).training_step(step).build() as w:
        with pytest.raises(WorkerError) as info:
            w.fit(data)
    error = info.value
    assert str(error).splitlines()[0].startswith(first_line)
    assert (error.rank, error.epoch, error.local_step) == (0, 0, 4) and "Traceback" in str(error)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("updaters", [True, False])
def test_one_worker_with_a_coded_payload_or_the_autopilot_trains_as_with_float32(updaters: bool) -> None:
    """A coded payload needs the rank of the worker's group, which the group of one answers
    itself (it failed with 'Default process group has not been initialized'); and a worker alone
    takes its change exactly, so int8, int4 and the autopilot (which starts in int8) train
    bitwise as float32 does."""
    data = make_batches(12)

    def trained(**options: Any) -> list[torch.Tensor]:
        builder = one_worker(dropout_mlp()).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9).average_updaters(updaters)
        for name, value in options.items():
            builder = getattr(builder, name)(value)
        with builder.build() as w:
            assert w.placement.in_process
            w.fit(data, epochs=2)
            return [p.detach().clone() for p in w.model.parameters()]

    full = trained(payload_dtype="float32")
    for options in ({"payload_dtype": "int8"}, {"payload_dtype": "int4"}, {"averaging_frequency": "auto"}):
        if "averaging_frequency" in options and not updaters:
            options = {**options, "payload_dtype": "int8"}  # the builder keeps what is set: the autopilot's k alone
        got = trained(**options)
        if "averaging_frequency" in options:
            continue  # another k: trained, not the same steps
        assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True)), options


@pytest.mark.parametrize(
    "configure",
    [
        lambda b: b.training_mode("shared-gradients").gradient_encoding(threshold=1e-3),
        lambda b: b.overlap_averaging(True).payload_dtype("int8").average_updaters(False).fragments(2),
        lambda b: b.outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True).overlap_averaging(True).payload_dtype("int8"),
        lambda b: b.average_updaters(every=4).warmup_sync_steps(2),
    ],
    ids=["threshold-encoded", "overlap-int8-fragments", "outer-overlap-int8", "des-loc-warmup"],
)
def test_one_worker_in_process_trains_with_each_lever(configure: Any) -> None:
    """Each lever on a worker alone, in the caller's process, whose group of one knows no global
    ranks: threshold-encoded gradients asked for one ('... is not registered') and failed."""
    model = dropout_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with configure(one_worker(model).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)).build() as w:
        assert w.placement.in_process
        history = w.fit(make_batches(12), epochs=2)
    assert history.scores and not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
