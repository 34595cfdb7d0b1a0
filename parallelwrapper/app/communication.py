"""What a run of `pw-fit compare` sends: the bytes and collectives of its rounds, computed, not measured.

From the same flat-buffer layout the workers build (`parallelwrapper.round_payload`).

A round of SHARED_GRADIENTS sends gradients | buffers; of AVERAGING, params | buffers (| the
optimizer's state with average_updaters), one all-reduce per dtype, the first carrying the round's
header. An outer optimizer (DiLoCo, SlowMo) sends nothing more: every worker steps it on the same
average. With a payload dtype other than float32 a round's floats go to every other worker as
their change since the last average, encoded (codec.py: cast to 16 bits, or block-quantized to
int8 or int4 with a scale per 256 numbers), beside the header in float64. A fit()'s first round
goes in float32 where the state it averages does not exist at the fit's start (an optimizer
creates its state at the first step: the first fit()'s, and every fit()'s with plain SGD);
otherwise every worker starts from the same state, and it goes encoded too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelwrapper import RoundPayload, TrainingMode, round_payload

from .options import OPTIMIZERS, RunOptions, initial_model

HEADER_BYTES = RoundPayload.header_bytes  # the header's all-reduce, float64: a fit()'s first round (checked by a test)


@dataclass(frozen=True)
class Communication:
    """What one round sends, per worker. Computed from the layout, not measured."""

    payload_bytes: int  # the flat buffers of one full-precision round, all dtypes, with the header they carry
    payload_collectives: int  # one all-reduce per dtype
    workers: int
    wire_bytes: int | None = None  # one worker's encoded payload in a coded round, without the header (None: float32)
    fragments: int = 1  # Builder.fragments: n collectives a round, and a full average at each fit()'s end
    full_fits: int | None = None  # coded: the fit() calls whose first round goes in float32, at most (None: every one)

    def ring_bytes(self, size: int) -> float:
        """Bytes each worker sends in a ring all-reduce of `size` bytes: 2(N-1)/N · size."""
        return 2 * (self.workers - 1) / self.workers * size

    def gather_bytes(self, size: int) -> float:
        """Bytes each worker sends when its `size` bytes go to each of the others: (N-1) · size."""
        return (self.workers - 1) * size

    def collectives(self, rounds: int, fits: int) -> int:
        """Payloads, one per round, which carry the header, and the header a fit()'s first round
        sends alone before the buffers exist (counted for every fit(): an overcount of at most
        one per call). A coded round adds the header's own all-reduce; fragments, a collective
        each (and, coded, its trailer's) and the full average at each fit()'s end."""
        wired = 0 if self.wire_bytes is None else self._wired(rounds, fits)
        pieces = (self.fragments - 1) * (rounds + wired) + (fits if self.fragments > 1 else 0)
        return fits + rounds * self.payload_collectives + wired + pieces

    def bytes_per_worker(self, rounds: int, fits: int) -> float:
        """The bytes of the rounds (fragments: the same bytes in n pieces, their trailers of one
        number each left out) and of each fit()'s closing full average, with fragments."""
        closing = self.ring_bytes(self.payload_bytes) * fits if self.fragments > 1 else 0.0
        if self.wire_bytes is None:
            return self.ring_bytes(HEADER_BYTES) * fits + self.ring_bytes(self.payload_bytes) * rounds + closing
        wired = self._wired(rounds, fits)
        return closing + (
            self.ring_bytes(HEADER_BYTES) * (fits + wired)
            + self.ring_bytes(self.payload_bytes) * (rounds - wired)
            + self.gather_bytes(self.wire_bytes) * wired
        )

    def _wired(self, rounds: int, fits: int) -> int:
        """Coded rounds among `rounds` in `fits` fit() calls: all but the float32 first rounds."""
        return max(rounds - (fits if self.full_fits is None else min(fits, self.full_fits)), 0)


def estimated_communication(options: RunOptions, payload_dtype: str | None = None) -> Communication:
    """The payload of one round of `options` (its training mode, optimizer, average_updaters and
    payload_dtype, or `payload_dtype` where given: one the autopilot chose). A rank-local
    throwaway optimizer takes one step on zero gradients to create its lazily built state (SGD
    momentum: one buffer per parameter; Adam: two, and a step count; plain SGD: none)."""
    c = options.config
    model = initial_model(options)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None
    full_fits: int | None = None if c.overlap_averaging else 0  # streamed rounds start coding after a first one
    if c.training_mode is not TrainingMode.SHARED_GRADIENTS and c.average_updaters:
        optimizer = OPTIMIZERS[options.optimizer].make(params, options.learning_rate)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        if not all(optimizer.state.get(p) for p in params):  # plain SGD: a state that never exists
            full_fits = None
        elif full_fits is not None:  # the state exists once the first fit() has stepped
            full_fits = 1
    dtype = payload_dtype or c.payload_dtype
    payload = round_payload(model, optimizer, training_mode=c.training_mode, payload_dtype=dtype, replace=c.on_worker_failure == "replace")
    fragments = c.fragments if c.training_mode is TrainingMode.AVERAGING else 1
    if payload.wire_bytes is None:
        return Communication(payload.nbytes, payload.collectives, c.workers, fragments=fragments)
    return Communication(payload.nbytes, payload.collectives, c.workers, payload.wire_bytes, fragments, full_fits)


__all__ = ["HEADER_BYTES", "Communication", "estimated_communication"]
