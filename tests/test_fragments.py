"""`.fragments(n)`: the state in n fragments, each averaged at its own point of the round and
landed a round later (Streaming DiLoCo's fragments). Parity: two workers in real gloo processes
end as a one-process computation of the same schedule, with and without an outer step;
composition: with an outer optimizer, an int8 payload and a warm-up, the replicas end equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from groups import run_each
from parallelwrapper import ParallelWrapper
from parallelwrapper.config import Config
from parallelwrapper.job import Job, OuterSpec
from parallelwrapper.rounds import Rounds
from parallelwrapper.rounds.streaming import cut_fragments
from parallelwrapper.worker import Replica
from test_composition import SaveState
from test_round_protocol import CPU, ListSource, batches, bn_model, one_thread
from tiny import make_batches, mlp

pytestmark = pytest.mark.timeout(120)

K, ROUNDS, SIZE = 4, 3, 8  # each worker: three rounds of four steps


@pytest.mark.fast
def test_fragments_are_runs_of_about_equal_bytes_in_order_and_never_empty() -> None:
    tensors = [torch.zeros(n) for n in (48, 8, 8, 8, 24, 3, 8, 8)]
    runs = cut_fragments(tensors, 2)
    assert [t for run in runs for t in run] == tensors  # in order, each once
    assert [sum(t.numel() for t in run) for run in runs] == [64, 51]
    assert [len(run) for run in cut_fragments(tensors, 8)] == [1] * 8
    assert [len(run) for run in cut_fragments(tensors[:3], 5)] == [1, 1, 1]  # fewer tensors than fragments
    assert cut_fragments(tensors, 1) == [tensors]


@pytest.mark.fast
def test_fragments_need_overlap_and_refuse_replacement() -> None:
    b = ParallelWrapper.builder(mlp()).workers(1)
    with pytest.raises(ValueError, match=r"fragments\(2\) spreads each round's averaging .* needs \.overlap_averaging\(True\)"):
        b.fragments(2).build()
    with pytest.raises(ValueError, match=r'on_worker_failure\("replace"\) restarts every worker from one landed average'):
        b.fragments(2).overlap_averaging(True).on_worker_failure("replace").build()
    with pytest.raises(ValueError, match=r"fragments must be an int >= 1, got 0"):
        b.fragments(0).build()


OUTER = (torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})
MIX = 0.5  # Streaming DiLoCo's mixing factor: a parameter moves half way from its snapshot to the outer step's result


def _fragments(rank: int, world: int, outer: bool) -> dict[str, Any]:
    model = bn_model()
    job = Job(model, torch.optim.SGD, {"lr": 0.1}, nn.functional.cross_entropy, None, outer_optimizer=OuterSpec(*OUTER) if outer else None)
    config = Config(workers=world, averaging_frequency=K, overlap_averaging=True, fragments=2)
    Rounds(Replica(model, job, config, CPU, rank, world), config, CPU, rank, world).run(1, ListSource(batches(rank, [SIZE] * K * ROUNDS), rank, world), lambda r: None)
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}}


@one_thread()
def fragments_reference(outer: bool, world: int = 2) -> dict[str, torch.Tensor]:
    """The schedule in one process. Fragment 0 (the first parameters, about half the bytes) is
    sent after each round's step k/2 and lands at step k/2 of the next round; fragment 1 (the
    rest, buffers included) is sent at each round's end and lands after the next round's steps.
    A landing moves each replica by mean(snapshots) − its snapshot. With an outer optimizer, a
    landing first steps it on the fragment's parameters alone, from their anchor on
    anchor − mean, and each parameter moves by (1 − α)(the step's result − its snapshot). At the
    epoch's end the last fragment 1 lands (no step since: the mean, or the step's result, itself),
    then fragment 0, then the whole state is averaged once."""
    replicas = [bn_model() for _ in range(world)]
    anchor = {name: nn.Parameter(p.detach().clone()) for name, p in replicas[0].named_parameters()}
    outer_step = OUTER[0](anchor.values(), **OUTER[1]) if outer else None
    inner = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    data = {rank: batches(rank, [SIZE] * K * ROUNDS) for rank in range(world)}
    state, params = replicas[0].state_dict(), [name for name, _ in replicas[0].named_parameters()]
    order = params + [k for k in state if k not in params]  # as averaged_tensors: parameters, then buffers
    cut = len(cut_fragments([state[k] for k in order], 2)[0])
    parts, keys = [order[:cut], order[cut:]], list(state)

    def mean(sent: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
        value = sum(s[key].double() for s in sent) / world
        return value.round().long() if key.endswith("num_batches_tracked") else value.float()

    def snap(part: list[str]) -> list[dict[str, torch.Tensor]]:
        return [{k: r.state_dict()[k].clone() for k in part} for r in replicas]

    def land(sent: list[dict[str, torch.Tensor]], part: list[str], adopt: bool = False) -> None:
        target, mixed = {k: mean(sent, k) for k in part}, [k for k in part if k in anchor and outer_step is not None]
        with torch.no_grad():
            if outer_step is not None and mixed:
                for k in mixed:
                    anchor[k].grad = anchor[k] - target[k]
                outer_step.step()  # the other fragment's parameters have no gradient: they stay
                for k in mixed:
                    target[k], anchor[k].grad = anchor[k].detach().clone(), None
            for r, own in zip(replicas, sent, strict=True):
                state = r.state_dict()
                for k in part:
                    keep = MIX if k in mixed and not adopt else 0.0
                    state[k].copy_(target[k] if adopt else state[k] + (1 - keep) * (target[k] - own[k]))

    in_flight: list[Any] = [None, None]
    for rnd in range(ROUNDS):
        for j in range(K):
            for rank, (r, opt) in enumerate(zip(replicas, inner, strict=True)):
                x, y = data[rank][rnd * K + j]
                opt.zero_grad()
                nn.functional.cross_entropy(r(x), y).backward()
                opt.step()
            if j + 1 == K // 2:
                if in_flight[0] is not None:
                    land(in_flight[0], parts[0])
                in_flight[0] = snap(parts[0])
        if in_flight[1] is not None:
            land(in_flight[1], parts[1])
        in_flight[1] = snap(parts[1])
    land(in_flight[1], parts[1], adopt=True)
    land(in_flight[0], parts[0])
    states = [r.state_dict() for r in replicas]
    return {k: mean(states, k) for k in keys}


@pytest.fixture(scope="module")
def fragment_runs() -> dict[bool, list[dict[str, Any]]]:
    """`_fragments` without and with an outer step, in one group of two processes: by outer, by rank."""
    return dict(zip((False, True), run_each(_fragments, 2, [(False,), (True,)], timeout=120)))


@pytest.mark.parametrize("outer", [False, True], ids=["averaging", "outer-step"])
def test_two_fragments_equal_a_one_process_computation_of_their_schedule(outer: bool, fragment_runs: dict[bool, list[dict[str, Any]]]) -> None:
    results = fragment_runs[outer]
    expected = fragments_reference(outer)
    for key, value in expected.items():
        assert torch.equal(results[0]["state"][key], results[1]["state"][key]), f"{key}: replicas differ"
        torch.testing.assert_close(results[0]["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_fragments_compose_with_an_outer_step_an_int8_payload_and_a_warmup(tmp_path: Path) -> None:
    start = {k: v.clone() for k, v in mlp().state_dict().items()}
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9).workers(2).threads_per_worker(1)
        .averaging_frequency(3).overlap_averaging(True).fragments(3).payload_dtype("int8").warmup_sync_steps(2)
        .outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        .validation(make_batches(2), every=None, step=SaveState(tmp_path))
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(make_batches(29), epochs=1)
        final = w.model.state_dict()
    assert all(s.score == s.score for s in history.scores)
    replicas = [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)]
    for key, value in final.items():
        assert torch.equal(replicas[0][key], replicas[1][key]) and torch.equal(replicas[0][key], value), key
    assert any(not torch.equal(final[k], start[k]) for k in start), "nothing trained"
