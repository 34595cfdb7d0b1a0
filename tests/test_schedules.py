"""Learning-rate schedules in lockstep: the learning rate of local step j of a round that starts
at the agreed global step s is the schedule's value at s + j, on every worker (schedule.py), the
wrapper's scheduler ends in step with its optimizer, a second fit() continues, and a resumed run is bitwise the uninterrupted one.
Spawned workers (their learning rates logged from `before_step`) and real gloo."""

from __future__ import annotations

import functools
import math
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, MultiplicativeLR, OneCycleLR, ReduceLROnPlateau, StepLR

from parallelwrapper import ParallelWrapper, TrainingMode
from parallelwrapper.config import Config
from parallelwrapper.job import Job, SchedulerSpec
from parallelwrapper.rounds.cut import RoundCut
from parallelwrapper.schedule import Schedule, planned_length, sizing_warning
from parallelwrapper.types import Counters
from parallelwrapper.worker import Replica
from tiny import make_batches, mlp

pytestmark = pytest.mark.timeout(180)


class Net(nn.Module):
    """pytorch/examples' MNIST network (mnist/main.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return F.log_softmax(self.fc2(x), dim=1)


class LrLog:
    """A before_step that appends each local step's learning rates to a file per process."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(self.directory / f"{rank}.txt", "a") as f:
            f.write(f"{optimizer.param_groups[0]['lr']!r}\n")

    def per_worker(self) -> list[list[float]]:
        """Each worker's learning rates (the first group's), step by step, in rank order."""
        logs = sorted(self.directory.glob("*.txt"))
        return [[float(line) for line in log.read_text().splitlines()] for log in logs]


def one_cycle(optimizer: torch.optim.Optimizer, total: int = 24) -> OneCycleLR:
    return OneCycleLR(optimizer, max_lr=0.1, total_steps=total)


def reference_lrs(total: int) -> list[float]:
    """A one-process OneCycleLR's learning rate at counters 0 .. total."""
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.01)
    scheduler = one_cycle(optimizer, total)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(total):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_pytorch_examples_recipe_steps_every_worker_per_epoch(mnist_dir: Path, tmp_path: Path) -> None:
    """Their Net, Adadelta lr 1.0, StepLR(step_size=1, gamma=0.7) per epoch; 2 workers, 2 epochs:
    every local step of epoch e runs at 1.0 * 0.7**e on both workers, and after the fit the
    wrapper's optimizer and scheduler are at 0.7**2."""
    from parallelwrapper.app.mnist import load_mnist

    train = load_mnist(mnist_dir, "train", download=False).batches(32, shuffle=True, seed=0)[:16]
    log = LrLog(tmp_path)
    builder = (
        ParallelWrapper.builder(Net()).optimizer(torch.optim.Adadelta, lr=1.0).loss_fn(F.nll_loss)
        .lr_scheduler(StepLR, step_size=1, gamma=0.7).workers(2).threads_per_worker(1).deterministic(True)
        .before_step(log)
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(train, epochs=2)
        assert w.optimizer.param_groups[0]["lr"] == pytest.approx(0.49)
        assert w.lr_scheduler.last_epoch == 2 and w.lr_scheduler.get_last_lr() == [pytest.approx(0.49)]
    assert history.epochs[1].score < history.epochs[0].score < math.log(10)
    workers = log.per_worker()
    assert len(workers) == 2
    for lrs in workers:  # 8 local steps an epoch on each worker
        assert lrs == [pytest.approx(1.0)] * 8 + [pytest.approx(0.7)] * 8


@pytest.mark.parametrize(
    ("mode", "k", "batches"),
    [(TrainingMode.AVERAGING, 3, 12), (TrainingMode.SHARED_GRADIENTS, 1, 12), (TrainingMode.AVERAGING, 2, 11)],
    ids=["averaging-k3", "shared-gradients", "averaging-uneven-end"],
)
def test_per_step_one_cycle_follows_a_one_process_schedule_at_the_agreed_counter(
    tmp_path: Path, mode: TrainingMode, k: int, batches: int
) -> None:
    """2 workers, 2 epochs: local step j of a round runs at the reference's lr at s + j, s =
    ceil(I / 2) and I the batches of every landed round; with 11 batches an epoch the counter
    ends at ceil(22 / 2)."""
    total = math.ceil(2 * batches / 2)
    log = LrLog(tmp_path)
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.01, momentum=0.9).workers(2).threads_per_worker(1)
        .training_mode(mode).averaging_frequency(k).deterministic(True).before_step(log)
        .lr_scheduler(OneCycleLR, interval="step", max_lr=0.1, total_steps=total)
    )  # fmt: skip
    with builder.build() as w:
        w.fit(make_batches(batches), epochs=2)
        reference = reference_lrs(total)
        assert w.lr_scheduler.last_epoch == total
        assert w.optimizer.param_groups[0]["lr"] == reference[total]
    # Batch i of an epoch goes to worker i mod 2: the expected counters of each worker's steps.
    expected: list[list[float]] = [[], []]
    counter = 0
    for _ in range(2):
        for start in range(0, batches, 2 * k):
            in_round = list(range(start, min(start + 2 * k, batches)))
            for rank in (0, 1):
                steps = sum(1 for i in in_round if i % 2 == rank)
                expected[rank] += [reference[counter + j] for j in range(steps)]
            counter = math.ceil((counter * 2 + len(in_round)) / 2)
    assert log.per_worker() == expected


def test_with_overlap_the_round_in_flight_counts_k_steps(tmp_path: Path) -> None:
    """k = 2, 12 batches an epoch, 2 workers: rounds of 4 batches. Round r's step j runs at 2r + j
    although round r - 1 is still in flight; an epoch ends with every round landed."""
    log = LrLog(tmp_path)
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.01).workers(2).threads_per_worker(1)
        .averaging_frequency(2).overlap_averaging(True).deterministic(True).before_step(log)
        .lr_scheduler(OneCycleLR, interval="step", max_lr=0.1, total_steps=12)
    )  # fmt: skip
    with builder.build() as w:
        w.fit(make_batches(12), epochs=2)
        assert w.lr_scheduler.last_epoch == 12
    assert log.per_worker() == [reference_lrs(12)[:12]] * 2


def grouped_with_a_still_group(model: nn.Module) -> torch.optim.Optimizer:
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    return torch.optim.SGD([{"params": first, "lr": 0.0}, {"params": rest}], lr=0.05, momentum=0.9)


def schedule_builder(model: nn.Module, directory: Path, workers: int = 2) -> Any:
    return (
        ParallelWrapper.builder(model).optimizer(grouped_with_a_still_group).workers(workers).threads_per_worker(1)
        .averaging_frequency(3).deterministic(True).checkpoint(directory, every=100)
        .lr_scheduler(StepLR, interval="step", step_size=3, gamma=0.5)
    )  # fmt: skip


def test_a_second_fit_continues_the_schedule_and_resume_is_bitwise(tmp_path: Path) -> None:
    """Three fits of one epoch equal one fit of three epochs, and an interrupted run resumed from
    its checkpoint; the group with lr 0 stays bitwise as it started (5 batches, k = 3: every
    round is weighted 3 : 2)."""
    data = make_batches(5)
    start = [p.detach().clone() for p in mlp().parameters()][:2]

    def final(w: Any) -> tuple[list[torch.Tensor], float, dict[str, Any]]:
        return [p.detach().clone() for p in w.model.parameters()], w.optimizer.param_groups[1]["lr"], w.lr_scheduler.state_dict()

    with schedule_builder(mlp(), tmp_path / "a").build() as w:
        for _ in range(3):
            w.fit(data)
        three_fits = final(w)
    with schedule_builder(mlp(), tmp_path / "b").build() as w:
        w.fit(data, epochs=3)
        one_fit = final(w)
    with schedule_builder(mlp(), tmp_path / "c").build() as w:
        w.fit(data, epochs=2)
    with schedule_builder(mlp(), tmp_path / "c").build() as w:
        w.fit(data, epochs=3, resume=tmp_path / "c")
        resumed = final(w)
    steps = math.ceil(3 * 5 / 2)  # the counter after 3 epochs: 8, the lr halved twice
    assert one_fit[1] == 0.05 * 0.5 ** (steps // 3) and one_fit[2]["last_epoch"] == steps
    for other in (three_fits, resumed):
        assert all(torch.equal(a, b) for a, b in zip(one_fit[0], other[0], strict=True))
        assert other[1:] == one_fit[1:]
    assert all(torch.equal(a, b) for a, b in zip(start, one_fit[0][:2], strict=True))  # lr 0: bitwise


def constant_metric(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    return {"val_loss": 1.0}  # never improves after the first validation


@pytest.mark.parametrize("workers", [2, 1], ids=["spawned", "in-process"])
def test_reduce_on_plateau_steps_on_the_validation_metric_on_every_worker(tmp_path: Path, workers: int) -> None:
    """patience 0: every validation after the first halves the lr, on every worker alike."""
    log = LrLog(tmp_path)
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1).workers(workers).threads_per_worker(1)
        .deterministic(True).before_step(log).validation(make_batches(2), every=1, step=constant_metric)
        .lr_scheduler(ReduceLROnPlateau, monitor="val_loss", factor=0.5, patience=0)
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(make_batches(4 * workers))  # 4 rounds of one batch per worker, then the epoch's end
        assert len(history.validations) == 4  # after every round, the last one at the epoch's end
        assert w.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert log.per_worker() == [pytest.approx([0.1, 0.1, 0.05, 0.025])] * workers


def constant_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (model(batch[0]) * 0).sum() + 1.0


def test_reduce_on_plateau_without_validation_steps_on_the_epochs_averaged_loss() -> None:
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1).workers(2).threads_per_worker(1)
        .training_step(constant_loss).lr_scheduler(ReduceLROnPlateau, factor=0.5, patience=0)
    )  # fmt: skip
    with builder.build() as w:
        w.fit(make_batches(4), epochs=3)  # the same loss every epoch: the 2nd and 3rd halve the lr
        assert w.lr_scheduler.last_epoch == 3 and w.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def not_a_scheduler(optimizer: torch.optim.Optimizer) -> object:
    return object()


def test_bad_schedulers_fail_at_build_with_a_short_message() -> None:
    base = ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1).workers(1)
    with pytest.raises(ValueError, match=r"^lr_scheduler: interval must be one of \['epoch', 'step'\], got 'batch'"):
        base.lr_scheduler(StepLR, interval="batch", step_size=1).build()
    with pytest.raises(ValueError, match=r"^lr_scheduler: StepLR\(optimizer, \*\*\{\}\) per epoch failed: TypeError"):
        base.lr_scheduler(StepLR).build()
    with pytest.raises(ValueError, match=r"returned a object, not a torch.optim.lr_scheduler scheduler"):
        base.lr_scheduler(not_a_scheduler).build()
    with pytest.raises(ValueError, match=r"monitor= is for ReduceLROnPlateau"):
        base.lr_scheduler(StepLR, monitor="val_loss", step_size=1).build()
    with pytest.raises(ValueError, match=r"monitors 'val_accuracy', a validation metric: add \.validation"):
        base.lr_scheduler(ReduceLROnPlateau, monitor="val_accuracy").build()
    with pytest.raises(ValueError, match=r"lr_scheduler cannot be sent to a spawned worker"):
        ParallelWrapper.builder(mlp()).workers(2).lr_scheduler(lambda o: StepLR(o, 1)).build()


@pytest.mark.fast
def test_a_per_step_schedule_that_fails_at_build_says_how_workers_count_its_steps() -> None:
    base = ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1).workers(2)
    with pytest.raises(ValueError, match=r"OneCycleLR.*total_steps': 4.* per step failed: ZeroDivisionError.*; per step, each of 2 workers "
                       r"takes ceil\(batches / 2\) steps an epoch \(builder.steps_per_epoch\(data\)\)"):
        base.lr_scheduler(OneCycleLR, interval="step", max_lr=0.1, total_steps=4, pct_start=0.25).build()


@pytest.mark.fast
def test_steps_per_epoch_is_the_global_step_count_of_an_epoch() -> None:
    builder = ParallelWrapper.builder(mlp()).workers(2)
    assert builder.steps_per_epoch(make_batches(11)) == 6 and builder.steps_per_epoch(12) == 6
    assert ParallelWrapper.builder(mlp()).workers(3).steps_per_epoch(12) == 4
    with pytest.raises(ValueError, match=r"^steps_per_epoch\(data\): a function has no len\(\); pass batches with a len\(\)"):
        builder.steps_per_epoch(lambda: iter(make_batches(2)))


class Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    """A stream of samples without a len(), as a tokenized corpus read on the fly is."""

    def __iter__(self) -> Any:
        return iter(torch.zeros(8, 2))


@pytest.mark.fast
def test_steps_per_epoch_of_an_iterable_dataset_asks_for_the_batch_count() -> None:
    """It says what the loader lacks and what to pass, not that it wants the DataLoader it got."""
    loader = torch.utils.data.DataLoader(Stream(), batch_size=4)
    message = (
        r"^steps_per_epoch\(data\): this DataLoader reads an IterableDataset, which has no len\(\); pass the number of "
        r"batches an epoch yields, e.g. steps_per_epoch\(1000\)$"
    )
    with pytest.raises(ValueError, match=message):
        ParallelWrapper.builder(mlp()).workers(2).steps_per_epoch(loader)


def _one_cycle_fit(total_steps: int, epochs: int = 2) -> list[str]:
    """The lr_scheduler warnings of a 2-worker fit of `epochs` over a DataLoader of 8 batches."""
    return _per_step_fit(OneCycleLR, epochs, max_lr=0.1, total_steps=total_steps)


def _per_step_fit(factory: Any, epochs: int, **kwargs: Any) -> list[str]:
    """The lr_scheduler warnings of a 2-worker fit of `epochs` over a DataLoader of 8 batches,
    `factory(optimizer, **kwargs)` stepping per step."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 10), torch.randint(0, 3, (64,))), batch_size=8)
    builder = ParallelWrapper.builder(mlp()).workers(2).threads_per_worker(1).optimizer(torch.optim.SGD, lr=0.1).averaging_frequency(2)
    builder.lr_scheduler(factory, interval="step", **kwargs)
    with warnings.catch_warnings(record=True) as caught, builder.build() as wrapper:
        warnings.simplefilter("always")
        wrapper.fit(data, epochs=epochs)
        assert wrapper.lr_scheduler.last_epoch == epochs * wrapper.steps_per_epoch(data)
    return [str(w.message) for w in caught if str(w.message).startswith("lr_scheduler")]


def test_a_schedule_sized_the_one_process_way_warns_once_at_fit_and_one_sized_for_the_split_does_not() -> None:
    epochs, batches = 2, 8
    plain = _one_cycle_fit(total_steps=epochs * batches)
    assert len(plain) == 1, plain
    assert plain[0].startswith("lr_scheduler: OneCycleLR has 16 steps planned (total_steps), one per batch as a one-process loop counts")
    assert "are 8 global steps (each worker's)" in plain[0] and "end 50% of the way through" in plain[0]
    assert _one_cycle_fit(total_steps=epochs * batches // 2) == []


@pytest.mark.fast
def test_a_transformers_warmup_schedule_sized_the_one_process_way_warns_too() -> None:
    """transformers' get_linear_schedule_with_warmup (a LambdaLR over partial(...,
    num_training_steps=...)), as a BERT fine-tune sizes it: one step per batch warns on 2
    workers, epochs * steps_per_epoch does not (issue 50)."""
    transformers = pytest.importorskip("transformers")
    epochs, batches = 1, 8
    steps = epochs * ParallelWrapper.builder(mlp()).workers(2).steps_per_epoch(batches)
    for planned, warns in ((batches, True), (steps, False)):  # len(loader), then sized for the split
        optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=planned)
        message = sizing_warning(Schedule(scheduler, "step", None, world_size=2), iterations=0, batches=epochs * batches)
        assert (message is not None) == warns, message
        if warns:
            assert message.startswith("lr_scheduler: LambdaLR has 8 steps planned (num_training_steps), one per batch as a one-process loop counts")


def closure_schedule(optimizer: torch.optim.Optimizer, num_training_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: 1 - step / num_training_steps)


@pytest.mark.fast
def test_a_lambda_schedules_planned_length_is_read_from_its_partial_or_closure() -> None:
    """transformers' cosine and polynomial warm-ups, a closure's and a MultiplicativeLR's lengths are
    read and checked as OneCycleLR's total_steps is; a lambda that names no length is not checked."""
    transformers = pytest.importorskip("transformers")
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    schedulers = [
        transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=16),
        transformers.get_polynomial_decay_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=16),
        closure_schedule(optimizer, num_training_steps=16),
        MultiplicativeLR(optimizer, functools.partial(shrink, num_training_steps=16)),
    ]
    for scheduler in schedulers:
        assert planned_length(scheduler) == ("num_training_steps", 16)
        message = sizing_warning(Schedule(scheduler, "step", None, world_size=2), iterations=0, batches=16)
        assert message is not None and "16 steps planned (num_training_steps), one per batch" in message
        assert sizing_warning(Schedule(scheduler, "step", None, world_size=2), iterations=0, batches=32) is None
    assert planned_length(LambdaLR(optimizer, lambda step: 1.0)) is None


def shrink(step: int, num_training_steps: int) -> float:
    return 0.99


def warm_up_from_zero(step: int, num_warmup_steps: int) -> float:
    return min(1.0, step / num_warmup_steps)


def slow_rank_1(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if dist.is_initialized() and dist.get_rank() == 1:
        time.sleep(0.2)


def test_a_warm_up_from_lr_0_on_first_come_workers_averages_every_group() -> None:
    """A per-step warm-up from lr 0 (as transformers' are) on 2 first-come workers, one slow: at
    the first round's end the fast one has stepped past lr 0 and the slow one has not. A group
    at lr 0 used to be left out of the average on the worker that saw 0 alone, so the two sent
    buffers of different sizes and gloo aborted (2 runs in 3, issue 50's BERT recipe); a group
    stands still only where its schedule began at 0."""
    data = make_batches(8, size=8)
    builder = (
        ParallelWrapper.builder(mlp()).workers(2).threads_per_worker(1).optimizer(torch.optim.SGD, lr=0.1).averaging_frequency(2)
        .before_step(slow_rank_1).lr_scheduler(LambdaLR, interval="step", lr_lambda=functools.partial(warm_up_from_zero, num_warmup_steps=2))
    )  # fmt: skip
    with builder.build() as wrapper:
        history = wrapper.fit(data)
    assert history.scores and all(math.isfinite(s.score) for s in history.scores)
    assert wrapper.lr_scheduler.last_epoch == wrapper.steps_per_epoch(data)


@pytest.mark.fast
def test_a_fleet_short_of_a_process_counts_global_steps_of_the_planned_fleet() -> None:
    """Three live processes of a fleet planned for four: a per-step schedule's global step is the
    planned fleet's, ⌈I / 4⌉ at an epoch's start and a step per 4 batches, so that it neither jumps
    ahead when a machine goes (⌈I / 3⌉) nor stands still when it comes back; and a round moves the
    model 3/4 of the way to its average. Five processes (one more than planned) move it all the way."""
    config = Config(fleet="tcp://127.0.0.1:29400", fleet_processes=4, on_worker_failure="replace")
    job = Job(nn.Linear(2, 2), torch.optim.SGD, {"lr": 0.1}, F.mse_loss, None, lr_scheduler=SchedulerSpec(StepLR, {"step_size": 10}, "step"))
    shares = {}
    for live in (3, 4, 5):
        replica = Replica(nn.Linear(2, 2), job, config, torch.device("cpu"), 0, live)
        assert replica.schedule is not None and replica.schedule.world_size == 4
        assert replica.schedule.target(Counters(iterations=120)) == 30
        shares[live] = None if replica.parts.landing is None else replica.parts.landing.share
    assert shares == {3: 0.75, 4: None, 5: None}
    cut = RoundCut(3, config.planned_workers(3))
    cut.epoch_starts(Counters(iterations=120, epoch=2, position=40))
    assert [cut.step_of(i) for i in (40, 43, 44, 48)] == [30, 30, 31, 32]
    off = Config(fleet="tcp://127.0.0.1:29400", fleet_processes=4, fleet_rescale=False, on_worker_failure="replace")
    assert Replica(nn.Linear(2, 2), job, off, torch.device("cpu"), 0, 3).parts.landing is None
