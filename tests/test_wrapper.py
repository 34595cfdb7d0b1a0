"""ParallelWrapper end to end: spawned worker processes, the shared queue, real gloo collectives.

Each test builds a small pool (two workers, one thread each); the hygiene fixture in conftest.py
fails any test that leaves a worker process behind.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from parallelwrapper import ParallelWrapper, Score, TrainingMode, WorkerError

pytestmark = pytest.mark.timeout(120)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def make_batches(n: int, size: int = 16, last: int | None = None, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [size] * (n - 1) + [last or size]
    return [(torch.randn(s, 10, generator=g), torch.randint(0, 3, (s,), generator=g)) for s in sizes]


def builder(model: nn.Module, **options: Any) -> Any:
    b = ParallelWrapper.builder(model).workers(2).threads_per_worker(1)
    for name, value in options.items():
        getattr(b, name)(value)
    return b


# -- training steps the workers import (module level: they travel to spawned processes) -----------


def recording_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]) -> torch.Tensor:
    """Cross-entropy, and a record of which worker trained on which batch ids. Rank 1 is slow."""
    x, y, ids, record_dir = batch
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(0.02)
    with open(Path(record_dir) / f"{rank}.txt", "a") as f:
        f.write("".join(f"{i}\n" for i in ids.tolist()))
    return nn.functional.cross_entropy(model(x), y)


def failing_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    if dist.get_rank() == 1 and int(y[0]) == -1:
        raise RuntimeError("boom from the training step")
    return nn.functional.cross_entropy(model(x), y.clamp(min=0))


# -- invariants -------------------------------------------------------------------------------------


def test_k1_averaging_shared_gradients_and_one_process_agree() -> None:
    """Invariant 3: plain SGD, k = 1, equal batches: all three are the same training."""
    data = make_batches(8)
    finals = {}
    for mode in TrainingMode:
        model = mlp()
        with builder(model, training_mode=mode).optimizer(torch.optim.SGD, lr=0.1).deterministic(True).build() as w:
            w.fit(data, epochs=1)
        finals[mode] = model.state_dict()
    reference = mlp()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for t in range(0, len(data), 2):
        x = torch.cat([data[t][0], data[t + 1][0]])
        y = torch.cat([data[t][1], data[t + 1][1]])
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    for key, value in reference.state_dict().items():
        for mode in TrainingMode:
            torch.testing.assert_close(finals[mode][key], value, rtol=1e-5, atol=1e-6, msg=f"{mode} {key}")
    assert not torch.equal(value, mlp().state_dict()[key]), "the model did not train"


@pytest.mark.parametrize(
    ("mode", "overlap"), [(TrainingMode.AVERAGING, False), (TrainingMode.SHARED_GRADIENTS, False), (TrainingMode.AVERAGING, True)]
)
def test_every_batch_once_in_an_uneven_epoch(mode: TrainingMode, overlap: bool, tmp_path: Path) -> None:
    """Invariant 4: 23 batches (not a multiple of N·k = 6), a short last batch, a slow worker."""
    base = make_batches(23, last=5)
    data = [(x, y, torch.arange(100 * i, 100 * i + len(y)), str(tmp_path)) for i, (x, y) in enumerate(base)]
    scores: list[Score] = []
    model = mlp()
    w = (
        builder(model, averaging_frequency=3, training_mode=mode, overlap_averaging=overlap)
        .training_step(recording_step).listeners(scores.append).build()
    )  # fmt: skip
    with w:
        history = w.fit(data, epochs=2)
    seen = [int(line) for f in sorted(tmp_path.glob("*.txt")) for line in f.read_text().split()]
    expected = [int(i) for _, _, ids, _ in data for i in ids]
    assert sorted(seen) == sorted(expected * 2)  # each sample exactly once per epoch
    assert len(list(tmp_path.glob("*.txt"))) == 2, "both workers trained"
    samples = sum(len(y) for _, y, _, _ in data)
    assert [e.samples for e in history.epochs] == [samples, 2 * samples]
    assert [e.iteration for e in history.epochs] == [23, 46]
    assert scores == history.scores and scores[-1].samples == 2 * samples
    assert all(s.score > 0 for s in scores)
    # Rank 0 reports where its time went: its own steps, and the exchanges, where it waits for the
    # slow rank 1 (20 ms a step). Averaging rounds claim batches first-come (feed/claims.py): the fast
    # rank 0 trains more of each round; synchronous gradients wait for rank 1 at every step.
    assert all(s.training_s > 0 and s.exchange_s > 0 for s in scores)
    assert sum(s.training_s + s.exchange_s for s in scores) <= scores[-1].seconds
    taken = [len((tmp_path / f"{rank}.txt").read_text().split()) for rank in (0, 1)]
    if mode is TrainingMode.AVERAGING:
        assert taken[0] > taken[1]
    else:
        assert sum(s.exchange_s for s in scores) > 0.2
    rounds = [s.round for s in scores]
    if mode is TrainingMode.AVERAGING:  # a score per averaging
        assert rounds == list(range(1, len(scores) + 1))
    else:  # a score every k = 3 steps, and at each epoch's end (12 steps an epoch: 23 batches, 2 workers)
        assert rounds == [3, 6, 9, 12, 15, 18, 21, 24]


def test_overlap_lets_the_faster_worker_take_more_of_each_round(tmp_path: Path) -> None:
    """With overlap_averaging and the first-come feed a round is N·k batches in all: the slow
    worker (rank 1) takes fewer of them instead of holding rank 0 up at every landing, and each
    epoch of 60 batches is 10 rounds of 6."""
    base = make_batches(60)
    data = [(x, y, torch.arange(100 * i, 100 * i + len(y)), str(tmp_path)) for i, (x, y) in enumerate(base)]
    w = builder(mlp(), averaging_frequency=3, overlap_averaging=True, feed="queue").training_step(recording_step).build()
    with w:
        history = w.fit(data, epochs=2)
    batches = {f.stem: len(f.read_text().split()) // 16 for f in tmp_path.glob("*.txt")}
    assert batches["0"] + batches["1"] == 120 and [e.iteration for e in history.epochs] == [60, 120]
    assert batches["0"] > 1.5 * batches["1"], batches  # with k each, both would train 60
    assert [s.iteration for s in history.scores] == list(range(6, 121, 6))


def test_a_list_is_read_in_shards_and_trains_as_the_dealt_queue() -> None:
    """feed "auto", deterministic: spawned workers read a list of batches in dealt shards, batch i
    on worker i mod N, and the main process feeds nothing; the model is bitwise the one the dealt
    queue trains from the same batches given as a function (which only the queue can feed), over
    two fit() calls and an epoch with an uneven end. (Not deterministic, they claim the batches
    first-come: tests/test_claims.py.)"""
    data = make_batches(13, last=7)
    finals = []
    for given in (data, lambda: data):
        with builder(mlp(), averaging_frequency=2, deterministic=True).build() as w:
            for _ in range(2):
                w.fit(given)
            assert (w.counters.epoch, w.samples) == (2, 2 * sum(len(y) for _, y in data))
            finals.append(copy.deepcopy(w.model.state_dict()))
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k


class CountedSamples(TensorDataset):
    """A TensorDataset that counts the samples read from it, in the process that holds it."""

    read = 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.read += 1
        return super().__getitem__(index)


def test_a_map_style_loader_is_read_in_shards_and_trains_as_the_dealt_queue() -> None:
    """feed "auto" with a shuffling DataLoader over a map-style dataset: the main process draws
    each epoch's sample indices and reads no sample; each worker loads its own batches. Dealt
    (deterministic), the model, and the global RNG after fit(), are bitwise those of the dealt
    queue fed from the same loader."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(199, 10, generator=g), torch.randint(0, 3, (199,), generator=g)  # 13 batches of 16, the last of 7
    finals, rngs = [], []
    for feed in ("auto", "queue"):
        dataset = CountedSamples(x, y)
        loader = DataLoader(dataset, batch_size=16, shuffle=True)
        torch.manual_seed(5)
        with builder(mlp(), averaging_frequency=2, deterministic=True, feed=feed).build() as w:
            w.fit(loader, epochs=2)
            assert (w.counters.epoch, w.samples) == (2, 2 * len(y))
            finals.append(copy.deepcopy(w.model.state_dict()))
        rngs.append(torch.get_rng_state())
        assert dataset.read == (0 if feed == "auto" else 2 * len(y))
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k
    assert torch.equal(rngs[0], rngs[1])


def test_deterministic_runs_are_bitwise_equal() -> None:
    """Invariant 6: same seed, deterministic feed, CPU: the same model twice."""
    data = make_batches(13, last=7)
    finals = []
    for _ in range(2):
        model = mlp()
        with builder(model, averaging_frequency=2).optimizer(torch.optim.Adam, lr=0.01).deterministic(True).seed(3).build() as w:
            w.fit(data, epochs=2)
            finals.append((copy.deepcopy(model.state_dict()), copy.deepcopy(w.optimizer.state_dict())))
    (m0, o0), (m1, o1) = finals
    for k in m0:
        assert torch.equal(m0[k], m1[k]), k
    for i, st in o0["state"].items():
        for k, v in st.items():
            assert torch.equal(v, o1["state"][i][k]), (i, k)


def test_worker_error_raises_with_rank_and_traceback_without_hanging() -> None:
    """Invariant 5: the failing worker is named, its traceback travels, nobody is left waiting."""
    data = make_batches(40)
    data[25] = (data[25][0], torch.full_like(data[25][1], -1))
    data[26] = (data[26][0], torch.full_like(data[26][1], -1))  # whichever worker takes them
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    w = builder(model, averaging_frequency=2).training_step(failing_step).deterministic(True).build()
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        w.fit(data)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1
    message = str(info.value)
    assert "boom from the training step" in message and "Traceback" in message and "failing_step" in message
    assert "batch 25 of epoch 0" in message
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), "a failed fit() must leave the user's model as it was"
    w.close()


def test_workers_live_across_fits_and_the_user_model_holds_the_average() -> None:
    data = make_batches(10)
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    events: list[str] = []

    class Recorder:
        def on_fit_start(self, config: Any, epochs: int) -> None:
            events.append(f"start {epochs}")

        def on_epoch_end(self, epoch: Any) -> None:
            events.append(f"epoch {epoch.epoch}")

        def on_fit_end(self, history: Any) -> None:
            events.append("end")

    w = builder(model, averaging_frequency=2, report_score_after_averaging=False).listeners(Recorder()).optimizer(
        torch.optim.SGD, lr=0.05, momentum=0.9
    ).build()
    with w:
        h1 = w.fit(data, epochs=1)
        pids = [p.pid for p in w._pool._processes]  # type: ignore[union-attr]
        h2 = w.fit(lambda: iter(data), epochs=2)
        assert [p.pid for p in w._pool._processes] == pids  # type: ignore[union-attr]
    assert events == ["start 1", "epoch 0", "end", "start 2", "epoch 1", "epoch 2", "end"]
    assert h1.scores == [] and len(h1.epochs) == 1 and len(h2.epochs) == 2  # no per-round scores
    assert h2.epochs[-1].iteration == 30 and h2.epochs[-1].samples == 30 * 16
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    momentum = w.optimizer.state_dict()["state"]
    assert len(momentum) == 4 and all("momentum_buffer" in s for s in momentum.values())
    with pytest.raises(RuntimeError, match="closed"):
        w.fit(data)


def test_single_worker_runs_the_same_code_path() -> None:
    data = make_batches(6)
    model = mlp()
    reference = mlp()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    with builder(model).workers(1).optimizer(torch.optim.SGD, lr=0.1).averaging_frequency(4).build() as w:
        history = w.fit(data)
    assert len(history.scores) == 2  # rounds of 4 and 2 batches
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-7)
