"""A round's exchange landed one round later (`overlap_averaging`), the steps since kept on top of the average.

The header and a snapshot of the state go out after the round's local work, without waiting, and
land after the next round's steps (DeltaAverager).

With an outer optimizer this is Streaming DiLoCo's overlapped outer step (Douillard et al., 2025,
arXiv 2501.18512, τ = one round): when round r lands, every worker computes the same outer step
from the same average, θ' = OuterOpt(anchor, Δ = anchor − avg(snapshots_r)), and moves its
parameters by (1 − α)(θ' − its snapshot), keeping the local progress it made since: Streaming
DiLoCo's merge of its local and the global parameters with mixing factor α = OUTER_MIX
(docs/design.md has the maths). The part of the outer step a worker did not follow goes into its
next snapshot, and so into the next round's pseudo-gradient. A round landed at once (no step since)
puts every worker on θ' itself.

With `fragments(n)`, the state is cut into n fragments of about equal bytes (whole tensors, in
the state's order). Fragment p < n − 1 is snapshotted and sent after local step round((p + 1)·k/n)
of a round (or at the round's end, for a worker that took fewer steps), weighted by the samples
trained since its last launch, and lands just before its next launch, a round later; the last
fragment goes with the round's header, as with n = 1. Each collective carries about 1/n of the
bytes, and they are spread through the round. A round that lands at once (an epoch's end, a
checkpoint, a validation, a stop) lands every fragment still in flight and then averages the
whole state once, so that every replica holds the same state there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import Config
from ..delta_averaging import DeltaAverager
from .clock import Clock
from .exchange import average_anew
from .header import HEADER_LEN, RoundTotals, Work, check_diverged, read_header, round_header
from .state import agree_on_optimizer_layout, averaged_tensors, exact_tensors, state_layout
from .trainer import Trainer

# Streaming DiLoCo's mixing factor α: where an outer step lands a round late, a worker keeps this
# share of its own snapshot against the step's result. 0 (the step followed in full) diverged on
# MNIST with DiLoCo's outer SGD (lr 0.7, Nesterov momentum 0.9; docs/design.md, benchmarks/results/overlap_outer.json).
OUTER_MIX = 0.5


@dataclass(frozen=True)
class Launched:
    """A round sent by StreamExchange.launch, still being summed."""

    layout: int | None  # as declared in the header
    weight: float  # this worker's weight in the payload
    skipped: bool  # this worker's contribution was dropped: its state is not worth keeping
    local_steps: int  # Trainer.local_steps at the launch
    steady: bool = True  # it went as every later round will: coded where a codec is set (DeltaAverager.steady)


@dataclass
class _Fragment:
    """One of the first n − 1 fragments: its averager, when a round launches it, and what this
    worker trained since its last launch."""

    delta: DeltaAverager
    at_step: int  # launched after this local step of a round
    samples: int = 0  # since its last launch
    losses: list[torch.Tensor] = field(default_factory=list)  # loss·n of each step since
    flight: Launched | None = None  # its last launch, until it lands
    sent: bool = False  # launched in the round in progress


def cut_fragments(tensors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """The tensors in n runs of about equal bytes, in order, none empty (fewer than n when there
    are fewer tensors)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    runs: list[list[torch.Tensor]] = [[]]
    done = 0
    for i, t in enumerate(tensors):
        left = len(tensors) - i  # tensors from here on, this one included
        wanted = min(n, len(tensors))
        if runs[-1] and len(runs) < wanted and (done >= total * len(runs) / wanted or left <= wanted - len(runs)):
            runs.append([])
        runs[-1].append(t)
        done += t.numel() * t.element_size()
    return runs


def _place(p: int, n: int, k: int) -> int:
    """The local step of a round of k after which fragment p of n launches."""
    return max(1, round((p + 1) * k / n))


class StreamExchange:
    """One worker's snapshot buffers and their averaging in the background."""

    def __init__(self, trainer: Trainer, config: Config, device: torch.device, group: dist.ProcessGroup | None, world_size: int, clock: Clock, redoes: bool = False) -> None:
        """`redoes`: a lost round is redone from a copy of the whole state kept at its start (feature.Feature.redoes)."""
        self.trainer, self.config, self.device, self.group, self.world_size = trainer, config, device, group, world_size
        self.clock, self._redoes = clock, redoes
        self._delta: DeltaAverager | None = None  # the last fragment's, which carries the header
        self._fragments: list[_Fragment] = []  # the others
        self._steps = 0  # local steps in the round in progress
        self._layout = 0  # the state layout the buffers were built for

    def reset(self) -> None:
        """The trainer's tensors were replaced (a fit() loads new state): build buffers afresh."""
        self._delta, self._fragments = None, []

    def use(self, config: Config) -> None:
        """Another k (the autopilot's, overlapped; everything else as it was): the fragments
        launch at its places from the next round on."""
        self.config = config
        for p, f in enumerate(self._fragments):
            f.at_step = _place(p, len(self._fragments) + 1, config.averaging_frequency)

    def _state_layout(self) -> int:
        return state_layout(self.trainer.optimizer, self.config.average_updaters)

    def _build(self) -> DeltaAverager:
        """The buffers, once every worker has the union of the optimizers' layouts (one that has
        not stepped yet has no state): each worker's first step of a fit, or its first launch."""
        if self.config.average_updaters:
            agree_on_optimizer_layout(self.trainer.optimizer, self.group)
        self._layout = self._state_layout()
        runs = cut_fragments(averaged_tensors(self.trainer.model, self.trainer.optimizer, self.config.average_updaters), self.config.fragments)
        k, wire = self.config.averaging_frequency, self.config.payload_dtype
        exact = exact_tensors(self.trainer.optimizer) if self.config.average_updaters else []
        self._fragments = [_Fragment(DeltaAverager(run, self.device, 1, wire, exact), _place(p, len(runs), k)) for p, run in enumerate(runs[:-1])]
        self._delta = DeltaAverager(runs[-1], self.device, HEADER_LEN, wire, exact)
        return self._delta

    def start_from_average(self) -> None:
        """Every replica holds the same state now (a round just landed at once): build the buffers
        now, and code the first round's deltas from this state with a coded payload, instead of
        sending it in full precision. A collective where the optimizer's state is averaged: every
        worker calls it at the same point."""
        self._build()
        for delta in (self._delta, *(f.delta for f in self._fragments)):
            assert delta is not None
            delta.start_coding(self.group)

    def prepare(self) -> None:
        """Before an averaging round's local work. At a fit's first round with a coded payload of
        the parameters alone, every replica holds the same parameters (a fit starts from one
        state, and the last one ended on the average): the buffers are built now and code the
        first round too. With the optimizer's state, which an optimizer makes at its first step,
        they are built at the first step, and the first round goes in full precision."""
        if self._delta is None and not self.config.average_updaters and self.config.payload_dtype != "float32":
            self.start_from_average()

    # -- the first n − 1 fragments, through the round --------------------------------------------

    def stepped(self, loss: torch.Tensor, samples: int) -> None:
        """After each local step of an averaging round: launch the fragments due now (the first
        step of a fit builds the buffers, once the optimizer has made its state)."""
        if self._delta is None:
            self._build()
        self._steps += 1
        for f in self._fragments:
            f.samples += samples
            f.losses.append(loss)
        for f in self._fragments:
            if not f.sent and f.at_step <= self._steps:
                self._relaunch(f)

    def _relaunch(self, f: _Fragment) -> None:
        """Land a fragment's last launch, then launch it with what this worker trained since."""
        self._land_fragment(f)
        skipped = bool(f.losses) and not math.isfinite(float(torch.stack(f.losses).sum()))
        weight = 0.0 if skipped else float(f.samples)
        f.delta.launch(weight, [weight], self.group)
        f.flight, f.sent, f.samples, f.losses = Launched(None, weight, skipped, self.trainer.local_steps), True, 0, []

    def _land_fragment(self, f: _Fragment) -> None:
        if f.flight is None:
            return
        (total,) = f.delta.wait()
        self._move(f.delta, f.flight, total)
        f.flight = None

    def _move(self, delta: DeltaAverager, launched: Launched, total: float, skipped_since: bool = False, at_average: Callable[[], None] | None = None) -> None:
        """Move the state by a landed average of Σw `total` (and the outer step). A worker adopts
        the average outright when its progress since is worthless (a non-finite loss then or
        since) or nil (no step since)."""
        adopt = launched.skipped or skipped_since or self.trainer.local_steps == launched.local_steps
        outer = self.trainer.parts.outer
        mixed = () if outer is None else {id(p) for p in outer.params}  # the parameters an outer step moves
        delta.land(total, adopt, self.trainer.averaged if total > 0 else None, at_average, mixed, OUTER_MIX)

    # -- the round -------------------------------------------------------------------------------

    def launch(self, work: Work, stop: bool) -> Launched:
        """Launch the fragments a short round did not reach, then snapshot the last fragment and
        send it with the round's header; do not wait."""
        delta = self._delta or self._build()
        for f in self._fragments:
            if not f.sent:
                self._relaunch(f)
            f.sent = False
        self._steps = 0
        header, layout = round_header(work, self._state_layout(), self._layout, stop)
        steady = delta.steady and all(f.delta.steady for f in self._fragments)
        delta.launch(work.weight, header, self.group)
        return Launched(layout, work.weight, work.skipped, self.trainer.local_steps, steady)

    def land(self, launched: Launched, skipped_since: bool, at_once: bool, at_average: Callable[[], None] | None = None) -> RoundTotals:
        """Wait for a launched round and move the state by its average (and the outer step).

        When the layouts disagreed, the buffers still matched (they keep their layout), so the average applies; then the state is averaged anew.
        With fragments, a round landed `at_once` or that ends the epoch first lands the other
        fragments and then averages the whole state. `at_average` is called while the worker
        holds the average (DeltaAverager.land; with one fragment only).
        """
        assert self._delta is not None
        totals = read_header(self._delta.wait(), launched.layout, self.world_size)
        check_diverged(totals)
        self._move(self._delta, launched, totals.samples, skipped_since, at_average if totals.layouts_agree else None)
        gather = bool(self._fragments) and (at_once or totals.epoch_done)
        # Landed late, as every later round will (coded where a codec is set, and not with the
        # whole state averaged anew): what it still cost a worker measures overlapped rounds.
        self.clock.landed(whole=not at_once and launched.steady and not gather and totals.layouts_agree)
        if gather or not totals.layouts_agree:
            for f in self._fragments:
                self._land_fragment(f)
            share = launched.weight / totals.samples if totals.samples > 0 else 1.0 / self.world_size
            worthless = launched.skipped or skipped_since
            average_anew(self.trainer, self.config, self.device, self.group, 0.0 if worthless else share, agree=not totals.layouts_agree, redoes=self._redoes).release()
            if not totals.layouts_agree:
                self._build()
        return totals


__all__ = ["Launched", "StreamExchange", "cut_fragments"]
