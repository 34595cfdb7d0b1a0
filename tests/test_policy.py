"""The round loop's seam for policies (rounds/policy.py): the loop asks its policy once per landed
averaging round, with the round's header summed, and runs the next rounds as the policy's choice
says; a fixed averaging_frequency is the simplest policy, and the autopilot another.

Fast tier: a scripted policy in a worker on a process group of this process alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelwrapper.autopilot import Autopilot, levers
from parallelwrapper.config import Config
from parallelwrapper.hosts.inprocess import group_of_one
from parallelwrapper.job import Job
from parallelwrapper.rounds import Rounds, RoundTotals
from parallelwrapper.rounds.header import Work
from parallelwrapper.rounds.policy import Change, Choice, Epoch, Fixed, Steered
from parallelwrapper.types import Score, StateDict
from parallelwrapper.worker import Replica
from test_round_protocol import CPU, ListSource

pytestmark = pytest.mark.fast


class Scripted:
    """k = 2, then 4 from the round after the first landed one; its header part is each worker's
    batches, and every landing it is asked about is kept."""

    meets = False

    def __init__(self) -> None:
        self.choice = Choice(2, "float32", 1)
        self.asked: list[tuple[int, int, float, bool]] = []  # (rounds landed, batches, its header part summed, late)

    def steps(self, epoch: Epoch) -> int:
        return self.choice.k

    def header(self, work: Work) -> list[float]:
        return [float(work.batches)]

    def landed(self, totals: RoundTotals, rounds: int, late: bool) -> Change | None:
        self.asked.append((rounds, totals.batches, totals.policy[0], late))
        if self.choice.k == 4:
            return None
        self.choice = Choice(4, "float32", 1)
        return Change(rounds + 1, self.choice, "a longer round")

    def state_dict(self) -> StateDict:
        return {"scripted": self.choice.k}

    def load_state_dict(self, own: StateDict) -> bool:
        return False


def _rounds(config: Config) -> Rounds:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    job = Job(model, torch.optim.SGD, {"lr": 0.1}, nn.functional.cross_entropy, None)
    return Rounds(Replica(model, job, config, CPU, 0, 1), config, CPU, 0, 1, group=group_of_one(config))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 4, generator=g), torch.randint(0, 2, (3,), generator=g)) for _ in range(n)]


def test_the_loop_asks_its_policy_once_per_landed_round_and_runs_its_choice() -> None:
    rounds = _rounds(Config(workers=1, averaging_frequency=2))
    assert isinstance(rounds.policy, Fixed) and rounds.policy.choice.k == 2  # a fixed k is a policy too
    rounds.policy = scripted = Scripted()
    scores: list[Score] = []
    rounds.run(1, ListSource(_data(10)), lambda r: scores.append(r) if isinstance(r, Score) else None)
    assert [(s.k, s.why) for s in scores] == [(2, "a longer round"), (4, None), (4, None)]
    # Asked after each landed round, with its header summed: its batches, and the policy's part.
    assert scripted.asked == [(1, 2, 2.0, False), (2, 4, 4.0, False), (3, 4, 4.0, False)]
    assert rounds.own_state()["scripted"] == 4  # its state goes in the worker's own, for a checkpoint


def test_the_autopilot_is_the_steered_policy() -> None:
    rounds = _rounds(Config(**levers({"workers": 1, "autopilot": Autopilot(k_max=8)})))
    assert isinstance(rounds.policy, Steered) and rounds.policy.choice == Choice(4, "int8", 0)  # its start
    assert "autopilot" in rounds.own_state()


class Shortening(Scripted):
    """k = 4, then 2 from the round after the first landed one, then 8 after the second."""

    def __init__(self) -> None:
        super().__init__()
        self.choice = Choice(4, "float32", 1)

    def landed(self, totals: RoundTotals, rounds: int, late: bool) -> Change | None:
        after = {1: 2, 2: 8}.get(rounds)
        if after is None:
            return None
        self.choice = Choice(after, "float32", 1)
        return Change(rounds + 1, self.choice, f"k = {after}")


def test_an_outer_momentum_shrinks_with_rounds_that_shorten_and_is_kept_where_they_lengthen() -> None:
    """The velocity an outer Nesterov SGD gathered over rounds of 4 steps is halved when rounds of
    2 follow (a velocity of long rounds carries each short one as far: docs/guides/autopilot.md),
    and kept when rounds of 8 follow; its learning rate and momentum stay as set."""
    from parallelwrapper.job import OuterSpec

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    config = Config(workers=1, averaging_frequency=4)
    outer = OuterSpec(torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    job = Job(model, torch.optim.SGD, {"lr": 0.1}, nn.functional.cross_entropy, None, outer_optimizer=outer)
    replica = Replica(model, job, config, CPU, 0, 1)
    rounds = Rounds(replica, config, CPU, 0, 1, group=group_of_one(config))
    rounds.policy = Shortening()
    step = replica.parts.outer
    assert step is not None
    seen: list[tuple[int, torch.Tensor]] = []
    original = step.rounds_changed

    def watched(before: int, after: int) -> None:
        buffer = step.optimizer.state[step.anchor[0]]["momentum_buffer"]
        held = buffer.clone()
        original(before, after)
        seen.append((after, buffer.clone()))
        torch.testing.assert_close(buffer, held * min(1.0, after / before), rtol=0, atol=0)

    step.rounds_changed = watched  # type: ignore[method-assign]
    rounds.run(1, ListSource(_data(16)), lambda r: None)
    assert [after for after, _ in seen] == [2, 8]  # once a change of k, from the loop
    assert step.optimizer.param_groups[0]["lr"] == 0.7 and step.optimizer.param_groups[0]["momentum"] == 0.9
