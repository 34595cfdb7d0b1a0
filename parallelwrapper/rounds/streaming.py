"""A round's exchange, landed one round later (`overlap_averaging`): the header and a snapshot of
the state go out after the round's local work, without waiting, and land after the next round's
steps, which are kept on top of the average (DeltaAverager).

With an outer optimizer this is Streaming DiLoCo's overlapped outer step (Douillard et al., 2025,
arXiv 2501.18512, τ = one round): when round r lands, every worker computes the same outer step
from the same average, θ' = OuterOpt(anchor, Δ = anchor − avg(snapshots_r)), and moves its current
weights by θ' − its snapshot, keeping the local progress it made since (docs/design.md has the
maths). The next snapshot is then θ' plus the next round's progress, so its Δ is that round's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..averaging import DeltaAverager
from ..config import Config
from .exchange import average_anew
from .header import HEADER_LEN, RoundTotals, Work, check_diverged, read_header, round_header
from .state import averaged_tensors, state_layout
from .trainer import Trainer


@dataclass(frozen=True)
class Launched:
    """A round sent by StreamExchange.launch, still being summed."""

    layout: int | None  # as declared in the header
    weight: float  # this worker's weight in the payload
    skipped: bool  # this worker's contribution was dropped: its state is not worth keeping
    local_steps: int  # Trainer.local_steps at the launch


class StreamExchange:
    """One worker's snapshot buffers and their averaging in the background."""

    def __init__(self, trainer: Trainer, config: Config, device: torch.device, group: dist.ProcessGroup | None, world_size: int) -> None:
        self.trainer, self.config, self.device, self.group, self.world_size = trainer, config, device, group, world_size
        self._delta: DeltaAverager | None = None
        self._layout = 0  # the state layout the buffers were built for

    def reset(self) -> None:
        """The trainer's tensors were replaced (a fit() loads new state): build buffers afresh."""
        self._delta = None

    def _state_layout(self) -> int:
        return state_layout(self.trainer.optimizer, self.config.average_updaters)

    def _build(self) -> DeltaAverager:
        self._layout = self._state_layout()
        tensors = averaged_tensors(self.trainer.model, self.trainer.optimizer, self.config.average_updaters)
        self._delta = DeltaAverager(tensors, self.device, HEADER_LEN, self.config.wire_dtype)
        return self._delta

    def launch(self, work: Work, stop: bool) -> Launched:
        """Snapshot the state and send it, with the round's header; do not wait."""
        delta = self._delta or self._build()
        header, layout = round_header(work, self._state_layout(), self._layout, stop)
        delta.launch(work.weight, header, self.group)
        return Launched(layout, work.weight, work.skipped, self.trainer.local_steps)

    def land(self, launched: Launched, skipped_since: bool, at_average: Callable[[], None] | None = None) -> RoundTotals:
        """Wait for a launched round and move the state by its average (and the outer step).

        A worker adopts the average outright when its progress since is worthless (a non-finite
        loss then or since) or nil (no step since). When the layouts disagreed, the buffers still
        matched (they keep their layout), so the average applies; then the state is averaged anew.
        `at_average` is called while the worker holds the average (DeltaAverager.land).
        """
        assert self._delta is not None
        totals = read_header(self._delta.wait(), launched.layout, self.world_size)
        check_diverged(totals)
        worthless = launched.skipped or skipped_since
        adopt = worthless or self.trainer.local_steps == launched.local_steps
        transform = self.trainer.averaged if totals.samples > 0 else None
        self._delta.land(totals.samples, adopt, transform, at_average if totals.layouts_agree else None)
        if not totals.layouts_agree:
            share = launched.weight / totals.samples if totals.samples > 0 else 1.0 / self.world_size
            average_anew(self.trainer, self.config, self.device, self.group, 0.0 if worthless else share, agree=True).release()
            self._build()
        return totals


__all__ = ["Launched", "StreamExchange"]
