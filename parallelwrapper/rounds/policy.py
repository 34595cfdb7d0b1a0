"""What sets each averaging round's k and payload: the `Policy` that the round loop asks once per landed round.

The loop (engine.py) has one path for every policy. Before an averaging round it asks `steps` for the
round's local steps and `header` for the policy's part of the round's header (summed over the
workers with the state, header.py); once the round has landed, `landed` with what it measured: its
header summed (samples, loss, batches, the policy's part), and the worker's exchange seconds in the
clock (clock.py), which the exchange filled. `landed` returns the change, if any, and the loop sends
the rounds after it as `choice` says (k, the payload, the optimizer state's period, overlap). A
policy's state goes in each worker's own state in a checkpoint.

`Fixed` is a fixed setting, the simplest policy: averaging_frequency's k and the config's payload
every round, nothing in the header, no state. `Steered` is the autopilot (`.averaging_frequency("auto")`,
autopilot.Pilot), fed as its measuring rules say: each round's local work, the exchange that the
last header could measure (its seconds, its codec's, the wait before it), the model's sizes; a
measure it lacks to decide on is summed over the workers at once, a round sooner.

A new policy implements `Policy` and is chosen in `policy_for`; the loop does not change. It must
decide the same on every worker: from the header's sums (the autopilot's part carries the choice
each worker ran, so a round whose workers disagree fails), not from one worker's own seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from ..autopilot import Change, Choice, Pilot, Sizes, in_config
from ..averaging import all_reduce_values
from ..config import Config
from ..types import StateDict
from .clock import Clock
from .header import RoundTotals, Work
from .state import exact_tensors, optimizer_state_tensors, trained_parameters
from .trainer import Trainer


class Epoch(Protocol):
    """The epoch being trained, as a policy sees it (cut.RoundCut): each worker's steps in it, and
    left in it after the last round, where the source knows its length (None: not known)."""

    def steps(self) -> int | None: ...

    def steps_left(self) -> int | None: ...


class Policy(Protocol):
    """What the round loop asks of whatever sets its averaging rounds, once a round."""

    @property
    def choice(self) -> Choice:
        """What the next averaging round runs with."""

    @property
    def meets(self) -> bool:
        """The workers meet before each exchange landed at once, so that its seconds are the
        link's and the codec's, not a wait for a slower worker (SyncExchange.launch)."""

    def steps(self, epoch: Epoch) -> int:
        """The local steps of the averaging round about to start; `epoch`: each worker's steps in
        the epoch and left in it, where the source knows them."""

    def header(self, work: Work) -> list[float]:
        """Its part of the header of an averaging round after `work` (at most autopilot.PILOT_LEN
        numbers; none: zeros)."""

    def landed(self, totals: RoundTotals, rounds: int, late: bool) -> Change | None:
        """An averaging round landed: `totals`, its header summed; `rounds` landed so far over the
        wrapper's life; `late`: after the next round's local work (overlapped). The change from the
        next round on (None: `choice` stays)."""

    def state_dict(self) -> StateDict:
        """Its part of a worker's own state in a checkpoint, by key (none: empty)."""

    def load_state_dict(self, own: StateDict) -> bool:
        """Take its part of `own` (a checkpoint's); whether there was one."""


def start(config: Config) -> Choice:
    """What `config` sends its rounds with: k, the payload, the optimizer state's period (0: never)."""
    return Choice(config.averaging_frequency, config.payload_dtype, config.average_updaters_every if config.average_updaters else 0)


class Fixed:
    """A fixed setting: averaging_frequency's k and the config's payload, every round."""

    meets = False

    def __init__(self, config: Config) -> None:
        self.choice = start(config)

    def steps(self, epoch: Epoch) -> int:
        return self.choice.k

    def header(self, work: Work) -> list[float]:
        return []

    def landed(self, totals: RoundTotals, rounds: int, late: bool) -> Change | None:
        return None

    def state_dict(self) -> StateDict:
        return {}

    def load_state_dict(self, own: StateDict) -> bool:
        return False


class Steered:
    """The autopilot: `pilot` fed with what the loop measured (the clock, filled by the exchange),
    the model's sizes, and, where it lacks a measure to decide on, the last exchange's summed over
    `group` at once (its seconds the exchange's, for the Score). With `together` (a pipeline's
    stages: each stage's group rounds its own part), the sums are summed over it too, so that
    every process of a worker chooses alike from the measures of all: their rounds must start
    and end together (the steps, a validation, a checkpoint cross the stages)."""

    meets = True

    def __init__(self, pilot: Pilot, trainer: Trainer, clock: Clock, device: torch.device, group: dist.ProcessGroup | None,
                 together: dist.ProcessGroup | None = None) -> None:  # fmt: skip
        self.pilot, self.trainer, self.clock = pilot, trainer, clock
        self._device, self._group, self._together = device, group, together

    @property
    def choice(self) -> Choice:
        return self.pilot.choice

    def steps(self, epoch: Epoch) -> int:
        """k; the epoch's rest where the round after would be too short for its exchange (Pilot.steps)."""
        return self.pilot.steps(epoch.steps_left(), epoch.steps())

    def header(self, work: Work) -> list[float]:
        last = self.clock.last
        return self.pilot.header(work.seconds, work.steps, last.exchange_s, last.codec_s, last.wait_s, self._sizes())

    def _sizes(self) -> Sizes:
        """The elements a round may carry, for the autopilot's estimate of another rung's bytes."""
        trainer = self.trainer
        parameters = sum(t.numel() for t in trained_parameters(trainer.model, trainer.optimizer))
        state, exact = (sum(t.numel() for t in tensors(trainer.optimizer)) for tensors in (optimizer_state_tensors, exact_tensors))
        return Sizes(parameters, state, exact)

    def landed(self, totals: RoundTotals, rounds: int, late: bool) -> Change | None:
        """Decide from the last round's measures in `totals`, then take this round's (Clock.measured).
        The exchange is a fair measure of its rung when its header rode with the payload, or when
        the header went alone and the payload after it was the rung's own (a float32 average anew,
        or coded in buffers built before the round): then its seconds alone; not when it averaged
        anew for a coded rung. Overlapped, the measure is what a round landed `late` still cost,
        its launch and its wait to land, where it went as every later round will; of one landed at
        once, none."""
        pilot = self.pilot
        summed, size = self._together_sum(totals.policy)  # the workers of `size` groups
        change = pilot.landed(summed, size * totals.workers, rounds, late)
        fair = self.clock.measured()
        if change is None and pilot.unmeasured:  # the same on every worker: decided from the sums
            # Too few measures of what is in force to decide on: this exchange's, summed now, and
            # not again in the next header (Pilot.measured).
            # Its seconds are the exchange's, for the Score: a worker whose exchange ended first
            # waits here for the others' (1-2 s a fit at 10 Mbit/s, counted nowhere before).
            last = self.clock.take()
            here = self.clock.timed(all_reduce_values, [last.exchange_s, last.codec_s, last.wait_s, float(fair)], self._device, self._group)
            measure, size = self._together_sum(here)
            change = pilot.measured(measure, size * totals.workers, rounds)
        return change

    def _together_sum(self, summed: Sequence[float]) -> tuple[Sequence[float], int]:
        """`summed` over the round's group, summed over `together` too, and how many groups' sums that is."""
        if self._together is None:
            return summed, 1
        return all_reduce_values(summed, self._device, self._together), dist.get_world_size(self._together)

    def state_dict(self) -> StateDict:
        return {"autopilot": self.pilot.state_dict()}

    def load_state_dict(self, own: StateDict) -> bool:
        if "autopilot" not in own:
            return False
        self.pilot.load_state_dict(own["autopilot"])
        return True


def policy_for(config: Config, trainer: Trainer, clock: Clock, device: torch.device, group: dist.ProcessGroup | None,
               together: dist.ProcessGroup | None = None) -> Policy:  # fmt: skip
    """The policy `config` asks for: the autopilot's (choosing with `together`, Steered), or a fixed setting."""
    if config.autopilot is None:
        return Fixed(config)
    return Steered(Pilot(config.autopilot, start(config)), trainer, clock, device, group, together)


def in_force(config: Config, choice: Choice) -> Config:
    """`config` sending rounds as `choice` says: its payload and optimizer-state period (k is read
    at each round's start)."""
    return dataclasses.replace(config, payload_dtype=choice.payload, **in_config(choice.rung))


def overlapped(config: Config, choice: Choice) -> Config:
    """The exchanges' config for an overlapped `choice` (the autopilot's last resort: the rung
    stays, k only lengthens): a fixed setting's, overlapped at its k, which places fragments."""
    return dataclasses.replace(config, autopilot=None, averaging_frequency=choice.k, overlap_averaging=True)


__all__ = ["Change", "Choice", "Epoch", "Fixed", "Policy", "Steered", "in_force", "overlapped", "policy_for"]
