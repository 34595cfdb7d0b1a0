"""The averaging maths and the round protocol, with real gloo collectives in two processes.

Parity: the state after a round equals the sample-weighted mean of the replicas' states computed
in one process (params, BatchNorm buffers, SGD momentum, Adam moments and step), and every replica
holds it bitwise.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from groups import run_each, run_group
from parallelwrapper import rounds
from parallelwrapper.averaging import FlatAverager
from parallelwrapper.averaging import all_reduce_values as reduce_header
from parallelwrapper.config import Config
from parallelwrapper.feed.protocols import END
from parallelwrapper.job import Job
from parallelwrapper.rounds import make_header, read_header
from parallelwrapper.worker import Replica

CPU = torch.device("cpu")


class ListSource:
    """Rank `rank`'s shard of an epoch, as the deterministic feed deals it: its i-th batch is the
    epoch's batch i·world + rank (rounds are cut by those indices). `known`: it tells the epoch's
    length (world shards as long as this one), as a list's feed does."""

    def __init__(self, batches: list[Any], rank: int = 0, world: int = 1, known: bool = False) -> None:
        self._items = [(i * world + rank, batch) for i, batch in enumerate(batches)]
        self._length = len(batches) * world if known else None

    def epoch_length(self, epoch: int) -> int | None:
        return self._length

    def next_batch(self) -> Any:
        return self._items.pop(0) if self._items else END


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 3))


def batches(seed: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


OPTIMIZERS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]
# Rank 0 trains on three batches (20 samples), rank 1 on one (8): unequal weights.
SIZES = {0: [8, 8, 4], 1: [8]}


def flat_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in optimizer.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt.{i}.{k}"] = v.detach().clone()
    return out


def _one_round(rank: int, world: int, k: int, sizes: dict[int, list[int]], overlap: bool = False) -> list[dict[str, torch.Tensor]]:
    out = []
    for cls, kwargs in OPTIMIZERS:
        model = bn_model()
        job = Job(model, cls, kwargs, nn.functional.cross_entropy, None)
        config = Config(workers=world, averaging_frequency=k, overlap_averaging=overlap)
        replica = Replica(model, job, config, CPU, rank, world)
        rounds.Rounds(replica, config, CPU, rank, world).run(1, ListSource(batches(rank, sizes[rank]), rank, world), lambda r: None)
        out.append(flat_state(replica.model, replica.optimizer))
    return out


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One-process references run on one thread, as the workers do (the thread count changes the
    rounding of a matrix product)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_replicas_match(results: list[dict[str, Any]], expected: dict[str, torch.Tensor]) -> None:
    """Both replicas end bitwise equal, and close to the one-process reference."""
    for key, value in expected.items():
        assert torch.equal(results[0]["state"][key], results[1]["state"][key]), f"{key}: replicas differ"
        torch.testing.assert_close(results[0]["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@one_thread()
def reference(rank: int, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], sizes: list[int]) -> dict[str, torch.Tensor]:
    """One replica trained alone in this process, without any averaging."""
    model = bn_model()
    opt = cls(model.parameters(), **kwargs)
    for x, y in batches(rank, sizes):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return flat_state(model, opt)


def test_average_equals_sample_weighted_mean_and_replicas_are_bitwise_equal() -> None:
    results = run_group(_one_round, 2, 3, SIZES)
    w = [sum(SIZES[0]), sum(SIZES[1])]
    for o, (cls, kwargs) in enumerate(OPTIMIZERS):
        r0, r1 = results[0][o], results[1][o]
        assert r0.keys() == r1.keys()
        refs = [reference(r, cls, kwargs, SIZES[r]) for r in (0, 1)]
        for key in r0:
            assert torch.equal(r0[key], r1[key]), f"{cls.__name__} {key}: replicas differ"
            expect = (refs[0][key].double() * w[0] + refs[1][key].double() * w[1]) / sum(w)
            if not r0[key].is_floating_point():
                expect = expect.round()
            torch.testing.assert_close(r0[key].double(), expect, rtol=1e-6, atol=1e-7, msg=f"{cls.__name__} {key}")
        assert any(k.endswith("exp_avg_sq") or k.endswith("momentum_buffer") for k in r0)
        assert "model.2.running_mean" in r0 and "model.2.num_batches_tracked" in r0


@pytest.mark.parametrize("overlap", [False, True], ids=["at-once", "overlap"])
def test_worker_without_batches_receives_the_average_and_adopts_optimizer_state(overlap: bool) -> None:
    # Rank 1 has no batch at all: it has no optimizer state yet (a different layout) and weight 0.
    # Overlapped, the workers agree on the layout before their first snapshot.
    results = run_group(_one_round, 2, 2, {0: [8, 8], 1: []}, overlap)
    for o, (cls, kwargs) in enumerate(OPTIMIZERS):
        alone = reference(0, cls, kwargs, [8, 8])
        for key, value in results[0][o].items():
            assert torch.equal(value, alone[key]), f"{cls.__name__} {key}"
            assert torch.equal(results[1][o][key], alone[key]), f"{cls.__name__} {key}"


def _flat_average(rank: int, world: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    tensors = [
        torch.full((3, 2), float(rank + 1)),
        torch.full((4,), float(rank * 10), dtype=torch.float16),
        torch.tensor([rank * 7], dtype=torch.int64),
        torch.full((2,), float("nan") if rank == 1 else 5.0, dtype=torch.float64),
    ]
    averager = FlatAverager(tensors, CPU)
    weight = [3, 0][rank]  # rank 1 is dropped (as NanPolicy.SKIP does): it declares no samples
    header = make_header(samples=weight, loss_sum=2.0 * weight, batches=1, finished=rank == 1, skipped=False, layout=123)
    totals = read_header(reduce_header(header, CPU), 123, world)
    averager.average(weight / totals.samples)  # share 0 sends zeros: rank 1's NaN must not arrive
    mismatched = make_header(samples=0, loss_sum=0.0, batches=0, finished=True, skipped=False, layout=rank)
    agree_after_mismatch = read_header(reduce_header(mismatched, CPU), rank, world).layouts_agree
    return tensors, {
        "totals": totals,
        "agree_after_mismatch": agree_after_mismatch,
        "collectives": averager.collectives,
        "numel": averager.numel,
    }


def test_flat_averager_dtypes_header_and_dropped_worker() -> None:
    (t0, m0), (t1, m1) = run_group(_flat_average, 2)
    for a, b in zip(t0, t1):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert torch.equal(t0[0], torch.full((3, 2), 1.0))  # rank 0's values, whole
    assert t0[0].dtype == torch.float32 and t0[1].dtype == torch.float16 and t0[2].dtype == torch.int64
    assert torch.equal(t0[3], torch.full((2,), 5.0, dtype=torch.float64))
    totals = m0["totals"]
    assert (totals.samples, totals.loss_sum, totals.batches, totals.finished) == (3, 6.0, 2, 1)
    assert totals.score == 2.0 and totals.layouts_agree
    assert not m0["agree_after_mismatch"] and not m1["agree_after_mismatch"]
    assert m0["collectives"] == 2  # float32 (with the float16 tensor) and float64 (with the int)
    assert m0["numel"] == 6 + 4 + 1 + 2


def test_header_counts_sum_exactly_in_float32() -> None:
    # Three workers of 30M samples a round: past 2**24, where float32 stops counting by ones.
    headers = [make_header(samples=30_000_001 + r, loss_sum=1.0, batches=3, finished=r == 0, skipped=False, layout=0xABCDE) for r in range(3)]
    summed = torch.tensor(headers, dtype=torch.float32).sum(dim=0).tolist()
    totals = read_header(summed, 0xABCDE, 3)
    assert totals.samples == 90_000_006 and totals.batches == 9 and totals.finished == 1 and totals.layouts_agree
    assert not read_header(summed, 0xABCDF, 3).layouts_agree


def test_reduce_header_single_process_group_is_identity() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = bn_model()
        before = copy.deepcopy(model.state_dict())
        header = make_header(samples=5, loss_sum=1.5, batches=2, finished=True, skipped=False, layout=9)
        totals = read_header(reduce_header(header, CPU), 9, 1)
        FlatAverager(list(model.parameters()) + list(model.buffers()), CPU).average(1.0)
        assert totals.layouts_agree and totals.finished == 1 and totals.score == pytest.approx(0.3)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k])
    finally:
        dist.destroy_process_group()


# -- several rounds: the header rides in the payload, pre-scaled by the last round's Σw --------------


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


ROUNDS_SIZES = {0: [8, 8, 8, 8, 8, 4, 8], 1: [8, 8, 8]}  # rank 1 finishes rounds before rank 0


@contextlib.contextmanager
def counting_all_reduce() -> Iterator[list[int]]:
    """The numel of every all-reduce this process sends while inside."""
    sent: list[int] = []
    all_reduce = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        yield sent
    finally:
        dist.all_reduce = all_reduce


def _rounds(rank: int, world: int, k: int, epochs: int) -> dict[str, Any]:
    model = plain_model()
    job = Job(model, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, nn.functional.cross_entropy, None)
    config = Config(workers=world, averaging_frequency=k)
    replica = Replica(model, job, config, CPU, rank, world)
    loop = rounds.Rounds(replica, config, CPU, rank, world)
    with counting_all_reduce() as sent:
        loop.run(epochs, ListSource(batches(rank, ROUNDS_SIZES[rank]), rank, world), lambda r: None)
    owns_storage = all(
        t.untyped_storage().nbytes() == t.numel() * t.element_size()
        for t in list(model.parameters()) + [s["momentum_buffer"] for s in replica.optimizer.state.values()]
    )
    return {"state": flat_state(model, replica.optimizer), "rounds": loop.counters.rounds, "sent": sent, "owns": owns_storage}


@one_thread()
def synchronous_reference(k: int) -> dict[str, torch.Tensor]:
    """Two replicas (SGD with momentum) trained and averaged round by round in one process: each
    takes up to k steps from the average, then both adopt the sample-weighted mean of params and
    momentum."""
    models = [plain_model(), plain_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    todo = [batches(r, ROUNDS_SIZES[r]) for r in (0, 1)]
    while todo[0] or todo[1]:
        weights = [0, 0]
        for r in (0, 1):
            for x, y in [todo[r].pop(0) for _ in range(min(k, len(todo[r])))]:
                opts[r].zero_grad()
                nn.functional.cross_entropy(models[r](x), y).backward()
                opts[r].step()
                weights[r] += len(y)
        with torch.no_grad():
            for p0, p1 in zip(models[0].parameters(), models[1].parameters()):
                for a, b in ((p0, p1), (opts[0].state[p0]["momentum_buffer"], opts[1].state[p1]["momentum_buffer"])):
                    average = (a * weights[0] + b * weights[1]) / sum(weights)
                    a.copy_(average)
                    b.copy_(average)
    return flat_state(models[0], opts[0])


def test_rounds_of_changing_weights_send_one_collective_each_and_equal_the_weighted_mean() -> None:
    results = run_group(_rounds, 2, 2, 1)
    expected = synchronous_reference(2)
    assert_replicas_match(results, expected)
    # Σw per round: 32, 24 (rank 1 ends: the sum is rescaled), 16 and 8 (rank 1 sends zeros).
    # The first round sends its header alone, then builds the buffers; each round, one all-reduce
    # of the parameters with the header in it, then one of the momentum, which lands later (at
    # the next step); none closes the epoch (each worker looked ahead).
    assert results[0]["rounds"] == 4
    params = sum(v.numel() for key, v in expected.items() if key.startswith("model.")) + rounds.HEADER_LEN
    momentum = sum(v.numel() for key, v in expected.items() if key.startswith("opt."))
    assert results[0]["sent"] == results[1]["sent"] == [rounds.HEADER_LEN] + [params, momentum] * 4
    assert results[0]["owns"] and results[1]["owns"]  # after fit(), no tensor is a view of a buffer


def test_an_epoch_where_nobody_trains_leaves_the_state_as_it_was() -> None:
    # The second epoch has no batches: its one round (Σw = 0) goes out in the payload of zeros,
    # and every worker drops the sums.
    one, two = run_each(_rounds, 2, [(2, 1), (2, 2)])
    for key, value in one[0]["state"].items():
        assert torch.equal(two[0]["state"][key], value) and torch.equal(two[1]["state"][key], value), key
    # the same two collectives as a trained round (the parameters' with the header, the momentum's)
    assert two[0]["sent"][-2:] == two[0]["sent"][-4:-2] and len(two[0]["sent"]) == len(one[0]["sent"]) + 2


def _reallocated(rank: int, world: int) -> list[torch.Tensor]:
    tensors = [torch.full((3,), float(rank)), torch.full((2,), 10.0 * rank)]
    averager = FlatAverager(tensors, CPU)
    assert tensors[0].data_ptr() == averager._groups[0].data.data_ptr()  # resident: a view of the buffer
    tensors[1].data = torch.full((2,), 10.0 * rank + 4)  # as an optimizer that reallocates its state
    averager.average(0.5)
    averager.release()
    return tensors


def test_a_tensor_reallocated_since_the_buffers_were_built_is_still_averaged() -> None:
    (a0, b0), (a1, b1) = run_group(_reallocated, 2)
    assert torch.equal(a0, torch.full((3,), 0.5)) and torch.equal(a1, a0)
    assert torch.equal(b0, torch.full((2,), 9.0)) and torch.equal(b1, b0)
    assert b0.untyped_storage().nbytes() == 2 * 4  # released: its own storage again


# -- overlap_averaging: the same run, simulated in one process ---------------------------------------


OVERLAP_SIZES = ROUNDS_SIZES


def _overlapped(rank: int, world: int, k: int, momentum: float) -> dict[str, Any]:
    model = plain_model()
    job = Job(model, torch.optim.SGD, {"lr": 0.1, "momentum": momentum}, nn.functional.cross_entropy, None)
    config = Config(workers=world, averaging_frequency=k, overlap_averaging=True)
    replica = Replica(model, job, config, CPU, rank, world)
    loop = rounds.Rounds(replica, config, CPU, rank, world)
    reports: list[Any] = []
    loop.run(1, ListSource(batches(rank, OVERLAP_SIZES[rank]), rank, world), reports.append)
    return {"state": flat_state(replica.model, replica.optimizer), "rounds": loop.counters.rounds, "reports": reports}


@one_thread()
def overlapped_reference(k: int) -> dict[str, torch.Tensor]:
    """Two replicas (plain SGD: no optimizer state) run the overlapped protocol step by step:
    a round's average lands after the next round's steps, which stay on top of it."""
    models = [plain_model(), plain_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    todo = [batches(r, OVERLAP_SIZES[r]) for r in (0, 1)]
    finished = [False, False]
    in_flight: tuple[list[list[torch.Tensor]], list[int], list[bool]] | None = None
    while True:
        stepped = [0, 0]
        samples = [0, 0]
        for r in (0, 1):
            while stepped[r] < k and not finished[r]:
                if not todo[r]:
                    finished[r] = True
                    break
                x, y = todo[r].pop(0)
                opts[r].zero_grad()
                nn.functional.cross_entropy(models[r](x), y).backward()
                opts[r].step()
                stepped[r] += 1
                samples[r] += len(y)
        if in_flight is not None:
            snapshots, weights, was_finished = in_flight
            with torch.no_grad():
                for i in range(len(snapshots[0])):
                    avg = (snapshots[0][i] * weights[0] + snapshots[1][i] * weights[1]) / sum(weights)
                    for r in (0, 1):
                        p = list(models[r].parameters())[i]
                        p.copy_(avg if stepped[r] == 0 else p + (avg - snapshots[r][i]))
            if all(was_finished):
                return flat_state(models[0], opts[0])
        in_flight = ([[p.detach().clone() for p in m.parameters()] for m in models], samples, list(finished))


def test_overlapped_averaging_lands_each_average_under_the_next_rounds_steps() -> None:
    results = run_group(_overlapped, 2, 2, 0.0)
    assert_replicas_match(results, overlapped_reference(2))
    # 7 + 3 batches at k = 2: rounds of 2+2, 2+1 (rank 1 finishes), 2+0, 1+0, and the landing of
    # the last; the score reports arrive one round late but all of them.
    assert results[0]["rounds"] == 4
    reports = results[0]["reports"]
    assert [r.counters.iterations for r in reports[:-1]] == [4, 7, 9, 10] and reports[-1].epoch == 0


def test_overlapped_averaging_agrees_on_optimizer_state_created_after_the_first_launch() -> None:
    # SGD momentum appears at each worker's first step, after the buffers were built: the layout
    # changes under the round in flight, the workers agree on it, and still end bitwise equal.
    results = run_group(_overlapped, 2, 3, 0.9)
    s0, s1 = results[0]["state"], results[1]["state"]
    assert s0.keys() == s1.keys() and any(k.endswith("momentum_buffer") for k in s0)
    for key in s0:
        assert torch.equal(s0[key], s1[key]), key
        assert torch.isfinite(s0[key].float()).all(), key


# -- frozen parameters are not averaged ---------------------------------------------------------------


def _frozen(rank: int, world: int) -> dict[str, Any]:
    model = plain_model()
    model[0].requires_grad_(False)  # the first layer is frozen: 6·8 + 8 numbers nobody moves
    job = Job(model, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, nn.functional.cross_entropy, None)
    config = Config(workers=world, averaging_frequency=2)
    replica = Replica(model, job, config, CPU, rank, world)
    with counting_all_reduce() as sent:
        rounds.Rounds(replica, config, CPU, rank, world).run(1, ListSource(batches(rank, ROUNDS_SIZES[rank]), rank, world), lambda r: None)  # uneven rounds
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "sent": sent}


def test_frozen_parameters_are_not_averaged_and_stay_bitwise_unchanged() -> None:
    results = run_group(_frozen, 2)
    initial = plain_model().state_dict()
    for r in (0, 1):
        for key in ("0.weight", "0.bias"):
            assert torch.equal(results[r]["state"][key], initial[key]), f"rank {r}: frozen {key} moved"
        assert not torch.equal(results[r]["state"]["2.weight"], initial["2.weight"])  # the rest trained
        assert torch.equal(results[r]["state"]["2.weight"], results[0]["state"]["2.weight"])
    # Trainable 3·8 + 3 = 27 numbers with the header, then AdamW's two moments of them and a step
    # per tensor (landing later): 27 + 56, not 139.
    assert set(results[0]["sent"][1:]) == {27 + rounds.HEADER_LEN, 2 * 27 + 2}


def _uneven_start(rank: int, world: int, payload: str) -> dict[str, torch.Tensor]:
    model = bn_model()
    job = Job(model, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, nn.functional.cross_entropy, None)
    config = Config(workers=world, averaging_frequency=2, payload_dtype=payload)
    replica = Replica(model, job, config, CPU, rank, world)
    if rank == 0:  # only this worker's optimizer holds its state at the start: zeros, so the same steps follow
        for p in replica.model.parameters():
            p.grad = torch.zeros_like(p)
        replica.optimizer.step()
    rounds.Rounds(replica, config, CPU, rank, world).run(1, ListSource(batches(rank, [8, 8]), rank, world), lambda r: None)
    return flat_state(replica.model, replica.optimizer)


def test_workers_that_start_a_fit_with_different_layouts_average_the_first_round_in_full() -> None:
    """A coded payload's first round goes encoded only where every worker starts from the same
    state layout: here rank 0 builds its buffers before the round and rank 1 cannot, the header
    says the layouts differ, and both average in full precision, as float32 does, bitwise."""
    coded, full = run_each(_uneven_start, 2, [("int8",), ("float32",)])
    for key, value in full[0].items():
        assert torch.equal(coded[0][key], value) and torch.equal(coded[1][key], value), key


VALIDATIONS = [0]


def _second_best(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    VALIDATIONS[0] += 1
    return {"val_loss": float(abs(VALIDATIONS[0] - 2))}  # 1, 0, 1, 2: the best is the second


class _LandsWhenWaited:
    """An all-reduce that runs only when waited for: a link so slow that nothing sent in the
    background has landed before its wait."""

    def __init__(self, run: Any) -> None:
        self._run = run

    def wait(self, *args: Any) -> bool:
        if self._run is not None:
            run, self._run = self._run, None
            run()
        return True


def _restores_best(rank: int, world: int) -> dict[str, torch.Tensor]:
    """k = 1, four rounds with a validation after each, the second the best; every async
    all-reduce lands only when waited for. The state a worker ends the fit with."""
    from parallelwrapper.listeners import EarlyStopping

    all_reduce = dist.all_reduce

    def deferred(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if not async_op:
            return all_reduce(tensor, *args, **kwargs)
        return _LandsWhenWaited(lambda: all_reduce(tensor, *args, **kwargs))

    dist.all_reduce = deferred
    model = plain_model()
    stopper = EarlyStopping(patience=5, restore_best=True)
    job = Job(model, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, nn.functional.cross_entropy, None,
              validation_data=batches(9, [4, 4]), validation_step=_second_best, early_stopping=stopper)  # fmt: skip
    config = Config(workers=world, averaging_frequency=1, validation_every=1)
    replica = Replica(model, job, config, CPU, rank, world)
    rounds.Rounds(replica, config, CPU, rank, world).run(1, ListSource(batches(rank, [8] * 4), rank, world), lambda r: None)
    return flat_state(model, replica.optimizer)


def test_a_best_state_kept_for_restore_best_holds_the_optimizers_average() -> None:
    """The optimizer's averaged state lands in place after its round (FlatAverager's later sums),
    where the next step reads it. A best state copied before it landed held each worker's own
    share of the momentum, and the replicas ended the fit apart (once on CI, under load)."""
    first, second = run_group(_restores_best, 2)
    for key, value in first.items():
        assert torch.equal(value, second[key]), key
