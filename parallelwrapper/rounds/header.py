"""A round's header: what every worker says about its round, summed exactly in the same all-reduce as the state.

It rides in the payload's trailer (averaging.py): samples, loss, batches, the finished, skipped and
stop flags, the policy's part (policy.py: the autopilot's measures and sizes; zeros for a fixed setting), and a check that
every worker sends the same state layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..autopilot import PILOT_LEN


@dataclass
class Work:
    """One worker's local work in a round: what its header says."""

    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)  # loss·n per step
    samples: int = 0
    batches: int = 0
    first_step: int = 0
    k: int = 1  # the local steps it may take: the k in force at its start (Policy.steps: an epoch's last may be longer)
    steps: int = 0  # the local steps it took (with its lockstep group: the group's steps, not their batches)
    loss_sum: float = 0.0
    skipped: bool = False  # dropped by the NaN policy
    finished: bool = False  # this worker (with a hierarchy: its node) has no batch left in the epoch
    policy: list[float] = dataclasses.field(default_factory=list)  # the policy's part of the header (Policy.header)
    seconds: float = 0.0  # in its steps (not waiting for the last round's state): its Score's, and the policy's measure

    @property
    def weight(self) -> float:
        return 0.0 if self.skipped else float(self.samples)


@dataclass(frozen=True)
class RoundTotals:
    """The header of a round, summed over all workers."""

    samples: float  # Σw: samples trained on in this round
    loss_sum: float  # Σ loss·batch_size
    batches: int
    finished: int  # workers that have reached the end of the epoch
    skipped: int  # workers whose contribution was dropped (non-finite loss, NanPolicy.SKIP)
    stop: int  # workers asked to stop after this round
    layouts_agree: bool
    workers: int  # whose headers these are: the round's group
    policy: tuple[float, ...] = (0.0,) * PILOT_LEN  # the policy's part, summed

    @property
    def epoch_done(self) -> bool:
        """Every worker has reached the end of the epoch."""
        return self.finished == self.workers

    @property
    def score(self) -> float:
        """The sample-weighted mean loss of the round (NaN when nobody trained)."""
        return self.loss_sum / self.samples if self.samples > 0 else float("nan")


_LAYOUT_BITS = 20
_SAMPLES_SPLIT = 1 << 12  # samples go as (w // 4096, w % 4096): sums exact in float32 to 2**36
HEADER_LEN = 8 + PILOT_LEN + _LAYOUT_BITS  # numbers in a header


def make_header(
    *, samples: int, loss_sum: float, batches: int, finished: bool, skipped: bool, layout: int | None, stop: bool = False, policy: Sequence[float] = ()
) -> list[float]:
    """The round's header: HEADER_LEN numbers to sum over the workers. `layout` is a hash of the
    sender's state layout, or None (stale) when its state no longer matches the buffers it sends.
    Every count sums exactly even in float32, the dtype of the buffer the header usually rides
    in: the sample count goes in two parts, the hash as one 0/1 number per bit."""
    bits = [0.0] * _LAYOUT_BITS if layout is None else [float(layout >> i & 1) for i in range(_LAYOUT_BITS)]
    flags = [float(finished), float(skipped), float(stop), float(layout is None)]
    high, low = divmod(samples, _SAMPLES_SPLIT)
    part = [*map(float, policy), *[0.0] * (PILOT_LEN - len(policy))]
    return [float(high), float(low), float(loss_sum), float(batches), *flags, *part, *bits]


def read_header(summed: Sequence[float], layout: int | None, world_size: int) -> RoundTotals:
    """The totals of a summed header. The layouts agree iff nobody was stale and every bit's sum
    is N times this worker's bit: all 0 or all 1."""
    high, low, loss, nb, fin, skip, stp, stale, *rest = summed
    part, bits = tuple(rest[:PILOT_LEN]), rest[PILOT_LEN:]
    agree = layout is not None and stale == 0 and all(b == world_size * (layout >> i & 1) for i, b in enumerate(bits))
    samples = float(round(high) * _SAMPLES_SPLIT + round(low))
    return RoundTotals(samples, loss, round(nb), round(fin), round(skip), round(stp), agree, world_size, part)


def round_header(work: Work, layout: int, built: int | None, stop: bool) -> tuple[list[float], int | None]:
    """A round's header, and the layout it declares: the state's `layout`, or stale (None) when
    the optimizer has created state since the buffers in use were built for layout `built`
    (None: no buffers yet), so that every worker learns that the layout must be agreed again."""
    declared = None if built is not None and layout != built else layout
    header = make_header(
        samples=0 if work.skipped else work.samples,
        loss_sum=0.0 if work.skipped else work.loss_sum,
        batches=work.batches,
        finished=work.finished,
        skipped=work.skipped,
        stop=stop,
        layout=declared,
        policy=work.policy,
    )
    return header, declared


def check_diverged(totals: RoundTotals) -> None:
    if totals.samples == 0 and totals.skipped > 0:
        raise FloatingPointError(
            f"the loss of every worker that trained in this round was non-finite ({totals.skipped} "
            f"workers): training has diverged; lower the learning rate"
        )
