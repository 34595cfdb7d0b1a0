"""What one round sends per worker: its payload's bytes and collectives, from the workers' own flat-buffer layout.

Computed, not measured: `round_payload` builds the buffers a worker would (averaging.FlatAverager)
over copies of the model's tensors, so the model itself is left as it was. A round of
SHARED_GRADIENTS sends gradients | buffers; of AVERAGING, params | buffers (| the optimizer's
state with `.average_updaters`), one all-reduce per dtype, the first carrying the round's header.
With a payload dtype other than float32 a round's floats go to every other worker encoded
(codec.py), beside the header in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .averaging import FlatAverager
from .config import TrainingMode
from .rounds import HEADER_LEN
from .rounds.state import exact_tensors, later_tensors, optimizer_state_tensors

__all__ = ["RoundPayload", "round_payload"]


@dataclass(frozen=True)
class RoundPayload:
    """What one round of a model sends, per worker, before any collective's own overhead."""

    header_bytes: ClassVar[int] = HEADER_LEN * 8  # the header, in float64: alone in a fit()'s first round

    nbytes: int  # the flat buffers of one full-precision round, all dtypes, with the header they carry
    collectives: int  # one all-reduce per dtype (the optimizer state's own buffers among them)
    wire_bytes: int | None = None  # one worker's encoded payload in a coded round, without the header (None: float32)


def round_payload(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    training_mode: TrainingMode = TrainingMode.AVERAGING,
    payload_dtype: str = "float32",
    replace: bool = False,
) -> RoundPayload:
    """The payload of one round of `model`'s training.

    Args:
        model: the model, whose trainable parameters and buffers a round sends (its gradients
            in place of its parameters with SHARED_GRADIENTS).
        optimizer: with `.average_updaters`, the optimizer whose state goes too, as it stands (an
            optimizer builds its state at its first step: step it once on zero gradients first).
        training_mode: the training mode.
        payload_dtype: `.payload_dtype`: with AVERAGING, anything but float32 is a coded round.
        replace: `.replace_workers`: the optimizer's state then goes with the parameters, not
            in buffers of its own.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if training_mode is TrainingMode.SHARED_GRADIENTS:
        tensors = [torch.zeros_like(p) for p in params] + [b.detach().clone() for b in model.buffers()]
        later: list[torch.Tensor] = []
        exact: list[torch.Tensor] = []
    else:
        state = optimizer_state_tensors(optimizer) if optimizer is not None else []
        settled = later_tensors(optimizer, True, replace) if optimizer is not None else []
        copies = {id(t): t.detach().clone() for t in [*params, *model.buffers(), *state]}
        tensors = [copies[id(t)] for t in [*params, *model.buffers(), *state]]
        later = [copies[id(t)] for t in settled]
        exact = [copies[id(t)] for t in exact_tensors(optimizer)] if optimizer is not None else []
    wired = training_mode is TrainingMode.AVERAGING and payload_dtype != "float32"
    cpu = torch.device("cpu")
    flat = FlatAverager(tensors, cpu, HEADER_LEN, later=[] if wired else later)  # a coded payload's goes at once
    if not wired:
        return RoundPayload(flat.nbytes, flat.collectives)
    cast = FlatAverager(tensors, cpu, HEADER_LEN, payload_dtype, exact=exact)
    return RoundPayload(flat.nbytes, flat.collectives, cast.nbytes - RoundPayload.header_bytes)
