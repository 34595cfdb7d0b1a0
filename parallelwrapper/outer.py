"""The outer optimizer of DiLoCo and SlowMo: one step of a second optimizer on each round's pseudo-gradient.

At a round's start every worker holds the same parameters θ_start (the anchor). After the round's
local steps and the averaging, each worker sets Δ = θ_start − average(θ) as the anchor's gradient
and takes one step of the outer optimizer on the anchor; the result is the next round's θ_start,
and the model's parameters are set to it. Every worker computes the same step from the same
average and the same state, so the outer optimizer's state never needs averaging. Plain
averaging is the outer step SGD(lr=1): θ_start − 1·Δ = average(θ).

Buffers and the inner optimizer's state are averaged as without an outer optimizer. With
overlap_averaging the step lands a round late (docs/design.md, "The outer step with overlap").

A fleet's round of n live processes, fewer than the N it is planned for, steps on its `share`
n/N of Δ: it averaged n/N of the samples a planned round does, and moves the model as far on
them (parts.Parts; without an outer optimizer, the share's step is plain averaging's, SGD(lr=1)).
"""

from __future__ import annotations

import torch

from .job import OuterSpec
from .types import StateDict


class OuterStep:
    """One worker's anchor (θ_start) and outer optimizer, over the model's trainable parameters."""

    def __init__(self, spec: OuterSpec, params: list[torch.Tensor], share: float = 1.0) -> None:
        self.params, self.share = params, share
        self.anchor: list[torch.Tensor] = [torch.nn.Parameter(p.detach().clone()) for p in params]
        self.optimizer = spec.build(self.anchor)

    @torch.no_grad()
    def restart(self) -> None:
        """The model's parameters were loaded (a fit() starts, a checkpoint resumes, a best state
        is restored): they are the anchor now."""
        for a, p in zip(self.anchor, self.params, strict=True):
            a.copy_(p)

    @torch.no_grad()
    def step(self, averages: list[torch.Tensor | None] | None = None) -> None:
        """After an averaging: `averages` (by default the model's parameters) hold average(θ);
        move the anchor by the outer optimizer on Δ = share · (anchor − average(θ)) and put the result in
        them. With overlap_averaging the model holds its own progress since on top of the average,
        which is kept: the averages are a buffer's, and the parameters move half way from their
        snapshot to the result (Streaming DiLoCo's mixing, rounds/streaming.py).
        A parameter whose average is None (another fragment's, or a still group's) does not step."""
        pairs = list(zip(self.anchor, self.params if averages is None else averages, strict=True))
        anchors, targets = [a for a, t in pairs if t is not None], [t for _, t in pairs if t is not None]
        if not targets:
            return
        deltas = torch._foreach_sub(anchors, targets)
        if self.share != 1.0:
            torch._foreach_mul_(deltas, self.share)
        for a, delta in zip(anchors, deltas, strict=True):
            a.grad = delta
        self.optimizer.step()
        torch._foreach_copy_(targets, anchors)
        for a in anchors:
            a.grad = None

    @torch.no_grad()
    def rounds_changed(self, before: int, after: int) -> None:
        """The rounds go from `before` local steps to `after` from the next one on (the
        autopilot's choice). Where they shorten, the momentum gathered over the longer rounds
        shrinks with them, by after / before: it is a sum of rounds' changes, and a velocity of
        long rounds' changes would carry each short round as far as a long one. Where they
        lengthen it is kept, and the learning rate and momentum are kept as set
        (docs/guides/autopilot.md, "With an outer optimizer"). An outer optimizer without a
        momentum buffer (Adam's moments, whose ratio sets its step) is left as it is."""
        if after >= before:
            return
        for state in self.optimizer.state.values():
            buffer = state.get("momentum_buffer")
            if isinstance(buffer, torch.Tensor):
                buffer.mul_(after / before)

    def state_dict(self) -> StateDict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        self.optimizer.load_state_dict(state)


__all__ = ["OuterStep"]
