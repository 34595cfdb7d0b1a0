"""Beyond plain averaging: the outer optimizer (DiLoCo / SlowMo) and the post-local-SGD warm-up,
with real gloo collectives. Outer parity: after each round every replica equals a one-process
computation of the outer step on the averaged pseudo-gradient; warm-up: the first steps are
SHARED_GRADIENTS exactly, and the switch loses and repeats no batch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from groups import run_each, run_group
from parallelwrapper import ParallelWrapper, TrainingMode
from parallelwrapper.averaging import FlatAverager
from parallelwrapper.config import Config
from parallelwrapper.delta_averaging import DeltaAverager
from parallelwrapper.job import Job, OuterSpec
from parallelwrapper.outer import OuterStep
from parallelwrapper.rounds import Rounds
from parallelwrapper.worker import Replica
from test_round_protocol import CPU, ListSource, batches, bn_model, one_thread
from tiny import make_batches, mlp, weights_and_outer_momenta

pytestmark = pytest.mark.timeout(120)

OUTERS: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.05}),
]
K, ROUNDS = 2, 3
SIZES = [8] * (K * ROUNDS)  # each worker: three rounds of k = 2 steps


def _rounds_with_outer(rank: int, world: int, which: int, overlap: bool) -> dict[str, Any]:
    model = bn_model()
    job = Job(model, torch.optim.SGD, {"lr": 0.1}, nn.functional.cross_entropy, None, outer_optimizer=OuterSpec(*OUTERS[which]))
    config = Config(workers=world, averaging_frequency=K, overlap_averaging=overlap)
    replica = Replica(model, job, config, CPU, rank, world)
    Rounds(replica, config, CPU, rank, world).run(1, ListSource(batches(rank, SIZES), rank, world), lambda r: None)
    assert replica.parts.outer is not None
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "outer": replica.parts.outer.state_dict()}


def _outer(which: int | None, anchor: list[nn.Parameter]) -> torch.optim.Optimizer:
    """OUTERS[which] on `anchor`; None: plain averaging's outer step, SGD(lr=1)."""
    cls, kwargs = (torch.optim.SGD, {"lr": 1.0}) if which is None else OUTERS[which]
    return cls(anchor, **kwargs)


@one_thread()
def reference(which: int | None, world: int = 2, share: float = 1.0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The rounds in one process: each worker's k steps from the round's start, the mean of the
    replicas' states, then the outer step from the start on Δ = share · (start − mean)."""
    model = bn_model()
    anchor = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    outer = _outer(which, anchor)
    data = {rank: batches(rank, SIZES) for rank in range(world)}
    for r in range(ROUNDS):
        states = []
        for rank in range(world):
            replica = bn_model()
            replica.load_state_dict(model.state_dict())
            inner = torch.optim.SGD(replica.parameters(), lr=0.1)
            for x, y in data[rank][K * r : K * r + K]:
                inner.zero_grad()
                nn.functional.cross_entropy(replica(x), y).backward()
                inner.step()
            states.append(replica.state_dict())
        mean = {k: sum(s[k].double() for s in states) / world for k in states[0]}
        model.load_state_dict({k: v.round().long() if k.endswith("num_batches_tracked") else v.float() for k, v in mean.items()})
        with torch.no_grad():
            for a, p in zip(anchor, model.parameters(), strict=True):
                a.grad = (a - p) * share
            outer.step()
            for a, p in zip(anchor, model.parameters(), strict=True):
                p.copy_(a)
    return model.state_dict(), outer.state_dict()


VARIANTS = [(which, overlap) for which in range(len(OUTERS)) for overlap in (False, True)]


@pytest.fixture(scope="module")
def with_outer() -> dict[tuple[int, bool], list[dict[str, Any]]]:
    """`_rounds_with_outer` of every variant, in one group of two processes: by variant, by rank."""
    return dict(zip(VARIANTS, run_each(_rounds_with_outer, 2, VARIANTS, timeout=120)))


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "streaming"])
@pytest.mark.parametrize("which", range(len(OUTERS)), ids=["sgd-nesterov", "adam"])
def test_outer_step_equals_a_one_process_computation_on_the_averaged_delta(which: int, overlap: bool, with_outer: dict[tuple[int, bool], list[dict[str, Any]]]) -> None:
    """Synchronous: the outer step from each round's average. Streaming (overlap_averaging): the
    outer step from the round that landed, moving weights that carry the next round's progress."""
    results = with_outer[(which, overlap)]
    expected, outer = (streaming_reference if overlap else reference)(which)
    rtol = 1e-5 if overlap else 1e-6  # streaming: the moves add and subtract snapshots, in another order
    for key, value in expected.items():
        assert torch.equal(results[0]["state"][key], results[1]["state"][key]), f"{key}: replicas differ"
        torch.testing.assert_close(results[0]["state"][key], value, rtol=rtol, atol=1e-6, msg=key)
    for i, state in outer["state"].items():  # the outer optimizer's state: the same on both, as one process has it
        for name, value in state.items():
            assert torch.equal(results[0]["outer"]["state"][i][name], results[1]["outer"]["state"][i][name])
            torch.testing.assert_close(results[0]["outer"]["state"][i][name], value, rtol=rtol, atol=1e-6)


MIX = 0.5  # α: the share of its snapshot against the outer step's result a worker keeps (Streaming DiLoCo)


@one_thread()
def streaming_reference(which: int | None, world: int = 2, share: float = 1.0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Streaming DiLoCo with one round of delay and mixing factor α, in one process, as
    docs/design.md writes it. Each worker trains round 0 from θ0 and sends its snapshot S_i, then
    trains round 1 on top. Round 0 lands: θ' = outer step from the anchor on Δ = anchor − mean(S),
    and each worker's parameters go to θ' + (x − S_i) + α(S_i − θ'), its buffers to
    mean(S) + (x − S_i). It sends that as its next snapshot, and so on; the last round lands with
    no step since, on θ'' itself (the buffers on their mean). Δ is scaled by `share`; without an
    outer optimizer (`which` None) the step is plain averaging's, followed in full (no α)."""
    start = bn_model()
    replicas = [bn_model() for _ in range(world)]
    anchor = [nn.Parameter(p.detach().clone()) for p in start.parameters()]
    outer, mix = _outer(which, anchor), 0.0 if which is None else MIX
    data = {rank: batches(rank, SIZES) for rank in range(world)}
    names = [name for name, _ in start.named_parameters()]

    def train(r: int) -> None:
        for rank, replica in enumerate(replicas):
            inner = torch.optim.SGD(replica.parameters(), lr=0.1)
            for x, y in data[rank][K * r : K * r + K]:
                inner.zero_grad()
                nn.functional.cross_entropy(replica(x), y).backward()
                inner.step()

    def snapshots() -> list[dict[str, torch.Tensor]]:
        return [{k: v.clone() for k, v in replica.state_dict().items()} for replica in replicas]

    def land(sent: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The average of the snapshots, with the parameters replaced by the outer step's result."""
        mean = {k: sum(s[k].double() for s in sent) / world for k in sent[0]}
        mean = {k: v.round().long() if k.endswith("num_batches_tracked") else v.float() for k, v in mean.items()}
        with torch.no_grad():
            for a, name in zip(anchor, names, strict=True):
                a.grad = (a - mean[name]) * share
            outer.step()
            return mean | {name: a.detach().clone() for a, name in zip(anchor, names, strict=True)}

    train(0)
    for r in range(1, ROUNDS):
        sent = snapshots()
        train(r)
        target = land(sent)
        for replica, own in zip(replicas, sent, strict=True):
            moved = {k: v + (target[k] - own[k]) for k, v in replica.state_dict().items()}
            replica.load_state_dict(moved | {name: moved[name] + mix * (own[name] - target[name]) for name in names})
    return land(snapshots()), outer.state_dict()


def _fleet_rounds(rank: int, world: int, which: int | None, overlap: bool, rescale: bool) -> dict[str, torch.Tensor]:
    """The rounds of a fleet planned for world + 1 processes, run by `world` of them (one lost)."""
    model = bn_model()
    outer = None if which is None else OuterSpec(*OUTERS[which])
    job = Job(model, torch.optim.SGD, {"lr": 0.1}, nn.functional.cross_entropy, None, outer_optimizer=outer)
    config = Config(averaging_frequency=K, overlap_averaging=overlap, fleet="tcp://127.0.0.1:29400", fleet_processes=world + 1, fleet_rescale=rescale, on_worker_failure="replace")
    replica = Replica(model, job, config, CPU, rank, world)
    Rounds(replica, config, CPU, rank, world).run(1, ListSource(batches(rank, SIZES), rank, world), lambda r: None)
    return {k: v.clone() for k, v in model.state_dict().items()}


FLEET = [(None, False, True), (None, True, True), (0, False, True), (None, False, False)]


@pytest.mark.parametrize("at", range(len(FLEET)), ids=["plain", "plain-streaming", "sgd-nesterov", "rescale-off"])
def test_a_fleet_short_of_a_process_moves_its_share_of_the_way_to_each_average(at: int, fleet_rounds: list[list[dict[str, torch.Tensor]]]) -> None:
    """Two live processes of a fleet planned for three: each round moves the model 2/3 of the way
    from the round's start to the average (the outer optimizer on 2/3 of Δ), so that a sample
    weighs what it does in the planned fleet; with rescale=False, all the way. The replicas agree
    bitwise, and equal a one-process computation."""
    which, overlap, rescale = FLEET[at]
    results = fleet_rounds[at]
    expected, _ = (streaming_reference if overlap else reference)(which, 2, 2 / 3 if rescale else 1.0)
    for key, value in expected.items():
        assert torch.equal(results[0][key], results[1][key]), f"{key}: replicas differ"
        torch.testing.assert_close(results[0][key], value, rtol=1e-5 if overlap else 1e-6, atol=1e-6, msg=key)
    if rescale:  # the share is what moved it: the whole way to the average is elsewhere
        whole, _ = (streaming_reference if overlap else reference)(which, 2)
        assert not all(torch.allclose(results[0][key], whole[key]) for key in whole)


@pytest.fixture(scope="module")
def fleet_rounds() -> list[list[dict[str, torch.Tensor]]]:
    """`_fleet_rounds` of every FLEET variant, in one group of two processes: by variant, by rank."""
    return run_each(_fleet_rounds, 2, FLEET, timeout=120)


PROGRESS = {  # per rank: its steps in rounds 0, 1 and 2 (the last, which lands with no step since)
    0: [torch.tensor([0.3, -0.2]), torch.tensor([0.1, 0.4]), torch.tensor([-0.2, 0.1])],
    1: [torch.tensor([-0.1, -0.3]), torch.tensor([0.5, 0.0]), torch.tensor([0.2, 0.2])],
}
NESTEROV = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def _mixed_rounds(rank: int, world: int) -> dict[str, torch.Tensor]:
    """One parameter and one buffer through overlapped rounds with an outer Nesterov SGD, in the
    order the engine runs them (steps, launch, the next round's steps, land, launch, ...), the
    last round landing with no step since: what each holds after each landing."""
    p, b = nn.Parameter(torch.tensor([1.0, -2.0])), torch.tensor([4.0, 4.0])
    step, averager = OuterStep(OuterSpec(torch.optim.SGD, NESTEROV), [p]), DeltaAverager([p, b], CPU, trailer=1)
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        p.add_(PROGRESS[rank][0])
        b.add_(PROGRESS[rank][0])
    for r in range(3):
        averager.launch(1.0, [1.0])
        if r < 2:  # the next round's steps
            with torch.no_grad():
                p.add_(PROGRESS[rank][r + 1])
                b.add_(PROGRESS[rank][r + 1])
        (total,) = averager.wait()
        averager.land(total, r == 2, lambda averages: step.step([averages[id(p)]]), mixed={id(p)}, keep=MIX)
        seen[f"parameter {r}"], seen[f"buffer {r}"] = p.detach().clone(), b.clone()
    return seen


def test_overlapped_outer_steps_move_the_parameters_half_way_from_the_snapshot() -> None:
    """docs/design.md's formulas by hand, for PyTorch's Nesterov SGD (buf ← β·buf + g; θ ← θ −
    lr·(g + β·buf)): at each landing θ' = OuterOpt(θ, θ − mean(S)), the same on both ranks; the
    parameter goes to θ' + (x − S_i) + ½(S_i − θ'), the buffer (no outer step) to mean(S) + (x − S_i);
    a round with no step since lands on θ' and mean(S), bitwise equal on both ranks."""
    results = run_group(_mixed_rounds, 2)
    lr, beta = NESTEROV["lr"], NESTEROV["momentum"]
    theta, buf = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    x = [theta + PROGRESS[rank][0].double() for rank in (0, 1)]
    y = [torch.tensor([4.0, 4.0], dtype=torch.float64) + PROGRESS[rank][0].double() for rank in (0, 1)]
    for r in range(3):
        sent, sent_buffer = [xi.clone() for xi in x], [yi.clone() for yi in y]
        g = theta - (sent[0] + sent[1]) / 2
        buf = beta * buf + g  # the first step's buffer is g itself: β·0 + g
        theta = theta - lr * (g + beta * buf)
        for rank in (0, 1):
            if r < 2:
                since = PROGRESS[rank][r + 1].double()
                x[rank] = theta + since + MIX * (sent[rank] - theta)
                y[rank] = (sent_buffer[0] + sent_buffer[1]) / 2 + since
            else:
                x[rank], y[rank] = theta, (sent_buffer[0] + sent_buffer[1]) / 2
            torch.testing.assert_close(results[rank][f"parameter {r}"].double(), x[rank], rtol=0, atol=1e-6)
            torch.testing.assert_close(results[rank][f"buffer {r}"].double(), y[rank], rtol=0, atol=1e-6)
    assert torch.equal(results[0]["parameter 2"], results[1]["parameter 2"])
    assert torch.equal(results[0]["buffer 2"], results[1]["buffer 2"])


@pytest.mark.parametrize("overlap", [False, True], ids=["at-once", "overlap"])
def test_outer_state_survives_fits_and_resume_bitwise(tmp_path: Path, overlap: bool) -> None:
    """Overlapped, the replicas are equal at each epoch's end (every worker on the outer step's
    result) and nothing else of the mixing is kept: a resumed run is the uninterrupted one."""

    def builder(directory: Path) -> Any:
        return (
            ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9).workers(2).threads_per_worker(1)
            .averaging_frequency(2).deterministic(True).checkpoint(directory, every=100).overlap_averaging(overlap)
            .outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        )  # fmt: skip

    data = make_batches(6)
    with builder(tmp_path / "a").build() as w:
        w.fit(data, epochs=3)
        straight = weights_and_outer_momenta(w)
        assert len(straight) == 8  # 4 parameters, 4 momentum buffers of the outer step
    with builder(tmp_path / "b").build() as w:
        w.fit(data, epochs=2)
        w.fit(data)
        assert all(torch.equal(a, b) for a, b in zip(straight, weights_and_outer_momenta(w), strict=True))
    with builder(tmp_path / "c").build() as w:
        w.fit(data, epochs=2)
    with builder(tmp_path / "c").build() as w:
        w.fit(data, epochs=3, resume=tmp_path / "c")
        assert all(torch.equal(a, b) for a, b in zip(straight, weights_and_outer_momenta(w), strict=True))


def test_outer_optimizer_refuses_what_has_no_round_average() -> None:
    base = ParallelWrapper.builder(mlp()).workers(1).outer_optimizer(torch.optim.SGD, lr=0.7)
    with pytest.raises(ValueError, match=r"outer_optimizer steps on each round's average, which SHARED_GRADIENTS has not"):
        base.training_mode(TrainingMode.SHARED_GRADIENTS).build()
    base.training_mode(TrainingMode.AVERAGING).overlap_averaging(True).build().close()  # streaming: it composes
    with pytest.raises(ValueError, match=r"outer_optimizer takes a torch.optim optimizer class"):
        ParallelWrapper.builder(mlp()).outer_optimizer(torch.optim.SGD(mlp().parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^outer_optimizer: torch.optim.sgd.SGD\(\{'lr': -1\}\) failed: ValueError"):
        ParallelWrapper.builder(mlp()).workers(1).outer_optimizer(torch.optim.SGD, lr=-1).build()


# -- warm-up ----------------------------------------------------------------------------------------


def state_of(w: Any) -> list[torch.Tensor]:
    momenta = [s["momentum_buffer"] for s in w.optimizer.state_dict()["state"].values()]
    return [p.detach().clone() for p in w.model.parameters()] + momenta


def test_warmup_is_shared_gradients_exactly_then_averaging_without_a_lost_batch() -> None:
    """3 synchronous steps (6 batches on 2 workers), then rounds of k = 2: the same model, bitwise,
    as SHARED_GRADIENTS on the first 6 batches followed by averaging on the other 4."""
    data = make_batches(10)

    def builder(mode: TrainingMode, warmup: int = 0) -> Any:
        return (
            ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1, momentum=0.9).workers(2).threads_per_worker(1)
            .deterministic(True).training_mode(mode).averaging_frequency(2).warmup_sync_steps(warmup)
        )  # fmt: skip

    with builder(TrainingMode.AVERAGING, warmup=3).build() as w:
        history = w.fit(data)
        warmed = state_of(w)
        assert (w.counters.rounds, w.counters.iterations, w.counters.samples) == (3 + 1, 10, 10 * 16)
        assert history.epochs[0].iteration == 10
    with builder(TrainingMode.SHARED_GRADIENTS).build() as shared:
        shared.fit(data[:6])
        with builder(TrainingMode.AVERAGING).build() as averaging:
            averaging.model.load_state_dict(shared.model.state_dict())
            averaging.optimizer.load_state_dict(shared.optimizer.state_dict())
            averaging.fit(data[6:])
            assert all(torch.equal(a, b) for a, b in zip(warmed, state_of(averaging), strict=True))
    with builder(TrainingMode.AVERAGING, warmup=5).build() as w:  # the warm-up outlasts the epoch
        w.fit(data)
        assert w.counters.rounds == 5
        with builder(TrainingMode.SHARED_GRADIENTS).build() as shared:
            shared.fit(data)
            assert all(torch.equal(a, b) for a, b in zip(state_of(w), state_of(shared), strict=True))
    assert math.isfinite(history.epochs[0].score)


def test_warmup_needs_averaging_rounds_to_switch_to() -> None:
    with pytest.raises(ValueError, match=r"warmup_sync_steps switches from shared gradients to averaging rounds"):
        ParallelWrapper.builder(mlp()).workers(1).training_mode(TrainingMode.SHARED_GRADIENTS).warmup_sync_steps(10).build()
    with pytest.raises(ValueError, match=r"warmup_sync_steps must be an int >= 0"):
        ParallelWrapper.builder(mlp()).workers(1).warmup_sync_steps(-1).build()


# -- payload dtype ----------------------------------------------------------------------------------


def _rounds_of_casts(rank: int, world: int, rounds: int) -> dict[str, torch.Tensor]:
    """A tensor that each worker moves by its own delta every round, then averages with a
    bfloat16 wire: what every average moved it by, summed, against the exact mean deltas."""
    x = torch.zeros(1000)
    averager = FlatAverager([x], CPU, trailer=2, wire=torch.bfloat16)
    averager.average(1.0 / world)  # the first round, in full precision: the start
    g = torch.Generator().manual_seed(rank)
    applied, exact = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for _ in range(rounds):
        before = x.clone()
        mine = torch.randn(1000, generator=g) * 0.01
        x.add_(mine)
        averager.send(1.0 / world, [1.0, float(rank)])
        assert averager.wait() == [float(world), float(sum(range(world)))]
        averager.apply(1.0)
        applied += (x - before).double()
        deltas = [torch.zeros(1000) for _ in range(world)]
        dist.all_gather(deltas, mine)
        exact += sum(d.double() for d in deltas) / world
    return {"applied": applied, "exact": exact, "x": x.clone()}


def test_a_bfloat16_payload_halves_the_bytes_and_loses_nothing_in_total() -> None:
    from parallelwrapper.rounds import HEADER_LEN

    tensors = [p.detach().clone() for p in mlp().parameters()]
    full = FlatAverager([t.clone() for t in tensors], CPU, HEADER_LEN)
    wired = FlatAverager([t.clone() for t in tensors], CPU, HEADER_LEN, wire=torch.bfloat16)
    assert wired.nbytes == full.nbytes // 2 + HEADER_LEN * 6  # the data halved; the header in float64
    results = run_group(_rounds_of_casts, 2, 60)
    assert torch.equal(results[0]["x"], results[1]["x"])  # every replica holds the same average
    # With error feedback, 60 rounds' casts lose no more than one round's: a bfloat16 step of the
    # last delta (|δ| ~ 0.01: 2^-8 relative), not a random walk of 60 of them.
    drift = (results[0]["applied"] - results[0]["exact"]).abs().max().item()
    assert drift < 0.01 * 4 * 2**-8, drift


@pytest.mark.parametrize("overlap", [False, True], ids=["at-once", "overlap"])
def test_a_bfloat16_payload_trains_as_float32_does(overlap: bool) -> None:
    """Landed at once or a round later (the snapshots' change since the last landed average)."""

    def trained(dtype: torch.dtype) -> list[torch.Tensor]:
        builder = (
            ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1, momentum=0.9).workers(2).threads_per_worker(1)
            .averaging_frequency(2).deterministic(True).payload_dtype(dtype).overlap_averaging(overlap)
        )  # fmt: skip
        with builder.build() as w:
            w.fit(make_batches(12), epochs=3)
            return [p.detach().clone() for p in w.model.parameters()]

    for wired, full in zip(trained(torch.bfloat16), trained(torch.float32), strict=True):
        torch.testing.assert_close(wired, full, rtol=0, atol=2e-3)


def test_an_unknown_payload_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"payload_dtype must be one of float32, bfloat16, float16, int8, int4, sparse or sparse:D \(D a density in \(0, 0.25\], e.g. sparse:0.03125\), got 'int16'"):
        ParallelWrapper.builder(mlp()).workers(1).payload_dtype(torch.int16).build()


def test_hierarchy_needs_averaging_rounds_and_is_noted_outside_torchrun() -> None:
    with pytest.raises(ValueError, match=r"hierarchy\('node'\) averages gradients within a node and the state across nodes"):
        ParallelWrapper.builder(mlp()).workers(1).training_mode(TrainingMode.SHARED_GRADIENTS).hierarchy("node").build()
    with pytest.raises(ValueError, match=r"hierarchy must be one of \['none', 'node'\], got 'rack'; e.g. .hierarchy\('node'\)"):
        ParallelWrapper.builder(mlp()).workers(1).hierarchy("rack").build()
    with pytest.warns(UserWarning, match=r"hierarchy\('node'\) applies under torchrun"):
        ParallelWrapper.builder(mlp()).workers(1).hierarchy("node").build().close()
