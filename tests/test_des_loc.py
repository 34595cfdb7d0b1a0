"""`.average_updaters(every=m)` (DES-LOC, arXiv 2505.22549): the optimizer's state travels in
every m-th round over the wrapper's life, and wherever replicas must be equal (an epoch's end, a
checkpoint, a validation, a stop); between, each worker keeps its own. Parity: two workers with
Adam in real gloo processes hold, after each round, what a one-process computation of the same
schedule says; a resumed deterministic run is bitwise the uninterrupted one; the options that
carry the optimizer's state with the parameters refuse it, with the reason."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from groups import run_each
from parallelwrapper import ParallelWrapper
from parallelwrapper.config import Config, Pipeline
from parallelwrapper.job import Job
from parallelwrapper.rounds import Rounds
from parallelwrapper.worker import Replica
from test_round_protocol import CPU, ListSource, one_thread
from tiny import make_batches, mlp

pytestmark = pytest.mark.timeout(120)

K, ROUNDS, SIZES = 2, 4, (8, 4)  # k = 2; four rounds an epoch; rank 0's batches of 8, rank 1's of 4: weights 2:1
LR = 0.01


@pytest.mark.fast
def test_every_must_be_a_positive_int_and_refuses_what_carries_the_state_with_the_parameters() -> None:
    b = ParallelWrapper.builder(mlp()).workers(1)
    with pytest.raises(ValueError, match=r"average_updaters_every must be an int >= 1, got 0; e\.g\. \.average_updaters\(\.\.\., every=4\)"):
        b.average_updaters(every=0).build()
    with pytest.raises(ValueError, match=r"average_updaters_every must be an int >= 1, got 2\.5"):
        b.average_updaters(every=2.5).build()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"average_updaters\(every=3\) does not go with average_updaters\(False\), which never sends the optimizer state"):
        b.average_updaters(False, every=3).build()
    refused: dict[str, dict[str, Any]] = {
        "overlap_averaging, whose rounds average the whole state in the background": {"overlap_averaging": True},
        "payload_dtype 'int8', which codes the optimizer state with the parameters": {"payload_dtype": "int8"},
        "payload_dtype 'bfloat16'": {"payload_dtype": "bfloat16"},
        r"hierarchy\('node'\), whose shards carry the optimizer state": {"hierarchy": "node"},
        r"on_worker_failure\('replace'\), which redoes a round from any survivor's copy": {"on_worker_failure": "replace"},
        "a pipeline, which this version does not run it with": {"pipeline": Pipeline()},
    }
    for reason, options in refused.items():
        with pytest.raises(ValueError, match=rf"^average_updaters\(every=4\) does not go with {reason}"):
            Config(average_updaters_every=4, **options)
        Config(average_updaters_every=1, **options)  # every round: as before
    with pytest.raises(ValueError, match=r"average_updaters\(every=4\) does not go with overlap_averaging"):
        b.average_updaters(every=4).overlap_averaging(True).build()
    assert b.average_updaters(True, every=4).overlap_averaging(False)._options["average_updaters_every"] == 4
    assert b.average_updaters(False)._options["average_updaters_every"] == 1  # False resets every=


def _batches(rank: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * epoch + rank)
    size = SIZES[rank]
    return [(torch.randn(size, 10, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(K * ROUNDS)]


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {f"{i}.{k}": v.detach().clone() for i, p in enumerate(params) for k, v in optimizer.state[p].items()}


def _des_loc(rank: int, world: int, every: int, epochs: int) -> list[dict[str, torch.Tensor]]:
    """Each round's end as this worker holds it: the parameters and Adam's state, taken at the
    next round's first step (the state has landed there) and after each fit()."""
    model = mlp()
    job = Job(model, torch.optim.Adam, {"lr": LR}, nn.functional.cross_entropy, None)
    config = Config(workers=world, averaging_frequency=K, average_updaters_every=every)
    replica = Replica(model, job, config, CPU, rank, world)
    rounds = Rounds(replica, config, CPU, rank, world)
    held: list[dict[str, torch.Tensor]] = []

    def take() -> None:
        held.append({f"p{i}": p.detach().clone() for i, p in enumerate(model.parameters())} | _optimizer_state(replica.optimizer))

    steps = [0]

    def before_step(*_: Any) -> None:
        if steps[0] % K == 0 and steps[0] % (K * ROUNDS) != 0:
            take()
        steps[0] += 1

    replica.optimizer.register_step_pre_hook(before_step)  # after the exchange's: the state has landed
    for epoch in range(epochs):
        rounds.run(epoch + 1, ListSource(_batches(rank, epoch), rank, world), lambda r: None)
        take()
    return held


@one_thread()
def des_loc_reference(every: int, epochs: int, world: int = 2) -> tuple[list[list[dict[str, torch.Tensor]]], list[bool]]:
    """The same schedule in one process: two replicas, each K Adam steps a round on its own
    batches; then the parameters are averaged by samples (2:1), and the optimizer's state too in
    every `every`-th round and at each epoch's end. Each round's end per replica, and whether the
    state travelled."""
    replicas = [mlp() for _ in range(world)]
    optimizers = [torch.optim.Adam(r.parameters(), lr=LR) for r in replicas]
    shares = [s / sum(SIZES) for s in SIZES]
    held: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(world)]
    travelled = []
    for epoch in range(epochs):
        data = [_batches(rank, epoch) for rank in range(world)]
        for rnd in range(ROUNDS):
            for j in range(K):
                for rank, (r, opt) in enumerate(zip(replicas, optimizers)):
                    x, y = data[rank][rnd * K + j]
                    opt.zero_grad()
                    loss: torch.Tensor = nn.functional.cross_entropy(r(x), y)
                    loss.backward()  # type: ignore[no-untyped-call]
                    opt.step()
            with torch.no_grad():
                params = [list(r.parameters()) for r in replicas]
                for group in zip(*params):
                    mean = sum(s * p for s, p in zip(shares, group))
                    for p in group:
                        p.copy_(mean)
                travels = (epoch * ROUNDS + rnd + 1) % every == 0 or rnd == ROUNDS - 1
                if travels:
                    states = [_optimizer_state(o) for o in optimizers]
                    for key in states[0]:
                        mean = sum(s * st[key] for s, st in zip(shares, states))
                        for o in optimizers:
                            ps = [p for g in o.param_groups for p in g["params"]]
                            index, name = key.split(".")
                            o.state[ps[int(index)]][name].copy_(mean)
            travelled.append(travels)
            for rank, (r, o) in enumerate(zip(replicas, optimizers)):
                held[rank].append({f"p{i}": p.detach().clone() for i, p in enumerate(r.parameters())} | _optimizer_state(o))
    return held, travelled


@pytest.fixture(scope="module")
def des_loc_runs() -> dict[int, list[list[dict[str, torch.Tensor]]]]:
    """`_des_loc` at every = 2 and 3 over 2 epochs, in one group of two processes: by period, by rank."""
    return dict(zip((2, 3), run_each(_des_loc, 2, [(2, 2), (3, 2)], timeout=120)))


@pytest.mark.parametrize("every", [2, 3])
def test_the_optimizer_state_travels_every_mth_round_and_at_each_epochs_end(every: int, des_loc_runs: dict[int, list[list[dict[str, torch.Tensor]]]]) -> None:
    epochs = 2
    workers = des_loc_runs[every]
    expected, travelled = des_loc_reference(every, epochs)
    assert travelled == ([False, True] * 4 if every == 2 else [False, False, True, True, False, True, False, True])
    for rnd, travels in enumerate(travelled):
        ours = [workers[rank][rnd] for rank in (0, 1)]
        for key in ours[0]:
            for rank in (0, 1):
                torch.testing.assert_close(ours[rank][key], expected[rank][rnd][key], rtol=1e-5, atol=1e-7, msg=f"round {rnd + 1}, rank {rank}, {key}")
            same = torch.equal(ours[0][key], ours[1][key])
            if key.startswith("p") or travels:  # the parameters every round; the state where it travelled: bitwise equal
                assert same, f"round {rnd + 1}, {key}: the replicas differ"
            elif key.endswith("exp_avg") or key.endswith("exp_avg_sq"):
                assert not same, f"round {rnd + 1}, {key}: each worker should hold its own"


def _builder(directory: Path, every: int) -> Any:
    return (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.Adam, lr=LR).workers(2).threads_per_worker(1)
        .averaging_frequency(2).deterministic(True).checkpoint(directory, every=100).average_updaters(every=every)
    )  # fmt: skip


def _final(w: Any) -> list[torch.Tensor]:
    state = w.optimizer.state_dict()["state"]
    return [p.detach().clone() for p in w.model.parameters()] + [v.clone() for s in state.values() for v in s.values()]


def test_a_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path: Path) -> None:
    """14 batches, k = 2 on 2 workers: 4 rounds an epoch. every=3 over the wrapper's life sends
    the state in rounds 3, 4 (the epoch's end), 6, 8, 9 and 12; a fit() that counted its own
    rounds would send it in 11, not 9. Three epochs, in two fit() calls, against the checkpoint
    after the second resumed in a new wrapper: bitwise the same, and not every=1's."""
    data = make_batches(14)
    with _builder(tmp_path / "a", 3).build() as w:
        w.fit(data, epochs=2)
        shutil.copytree(tmp_path / "a", tmp_path / "b")
        w.fit(data)
        uninterrupted = _final(w)
        assert w.counters.rounds == 12
    with _builder(tmp_path / "b", 3).build() as w:
        w.fit(data, epochs=3, resume=tmp_path / "b")
        resumed = _final(w)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True))
    with _builder(tmp_path / "c", 1).build() as w:
        w.fit(data, epochs=3)
        every_round = _final(w)
    assert not all(torch.equal(a, b) for a, b in zip(uninterrupted, every_round, strict=True))
    with pytest.raises(ValueError, match="average_updaters_every: checkpoint has the default, this run has 3"):  # the fingerprint: another arithmetic
        with _builder(tmp_path / "c", 3).build() as w:
            w.fit(data, epochs=4, resume=tmp_path / "c")


@pytest.mark.fast
def test_pw_fit_maps_its_flag_to_the_builder_and_compare_refuses_it() -> None:
    from click.testing import CliRunner

    from parallelwrapper.app import cli
    from parallelwrapper.app.options import RunOptions, builder

    assert builder(mlp(), RunOptions.of(optimizer="adam", average_updaters_every=4))._options["average_updaters_every"] == 4
    with pytest.raises(ValueError, match=r"average_updaters\(every=4\) does not go with average_updaters\(False\)"):
        builder(mlp(), RunOptions.of(average_updaters=False, average_updaters_every=4)).build()
    result = CliRunner().invoke(cli.main, ["compare", "--average-updaters-every", "4"], prog_name="pw-fit")
    assert result.exit_code == 2 and "drop --average-updaters-every" in result.output
    result = CliRunner().invoke(cli.main, ["--average-updaters-every", "0"], prog_name="pw-fit")
    assert result.exit_code == 2 and "--average-updaters-every" in result.output
