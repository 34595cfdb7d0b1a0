"""What an averaging averages and the layout every worker agrees on, and what a synchronous step averages.

Synchronous steps are SHARED_GRADIENTS', a warm-up's and a node's.

AVERAGING's state is the trained parameters, the buffers and (with average_updaters) the
optimizer's state. Frozen parameters (requires_grad=False), those that no param group of the
optimizer holds, and those of a param group that stands still, are left out: they are the same
on every worker and nothing moves them, so averaging them would only cost bytes and, with uneven
weights, an ulp of rounding. Their optimizer state is averaged all the same.

A group stands still where its learning rate is 0 and was 0 when its schedule began
(`initial_lr`, which torch's schedulers set): a group frozen by lr 0, with or without a
schedule. Its lr then changes only where every worker agrees (at a landing, a validation, an
epoch's end), so the layout changes on every worker alike, and the state is averaged anew. A
group that a per-step schedule brings to 0 from elsewhere (a warm-up from 0, as transformers'
are) is averaged: each worker steps its schedule by its own steps within a round, so at a
round's end one worker may be at that 0 while another has moved on, and the two would send
buffers of different layouts.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Iterable, Mapping
from typing import SupportsFloat, cast

import torch
import torch.distributed as dist


def _still(group: Mapping[str, object]) -> bool:
    """A param group that no step moves: its learning rate (a number, or a tensor) is 0, and was
    0 when its schedule began (none: it is its own initial rate)."""
    lr = float(cast(SupportsFloat, group.get("lr", 1.0)))
    return lr == 0.0 and float(cast(SupportsFloat, group.get("initial_lr", lr))) == 0.0


def trained_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model's parameters that the optimizer trains: trainable and in one of its groups, in
    the model's order. A parameter that no group holds never moves (build() warns of it)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [p for p in model.parameters() if p.requires_grad and id(p) in held]


def averaged_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, average_updaters: bool) -> list[torch.Tensor]:
    """Trained, moving params | buffers | optimizer state (with average_updaters), in order."""
    still = {id(p) for group in optimizer.param_groups if _still(group) for p in group["params"]}
    tensors = [p for p in trained_parameters(model, optimizer) if id(p) not in still] + list(model.buffers())
    if average_updaters:
        tensors += optimizer_state_tensors(optimizer)
    return tensors


def state_layout(optimizer: torch.optim.Optimizer, average_updaters: bool) -> int:
    """A hash of the averaged state's layout: the optimizer state's (optimizers create it lazily)
    and which param groups stand still."""
    state = optimizer_signature(optimizer) if average_updaters else ()
    return signature_hash((state, tuple(_still(group) for group in optimizer.param_groups)))


def gradient_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a synchronous step averages: the trained parameters' gradients (allocated as zeros
    where there are none yet, so that the buffers can hold them) | buffers."""
    params = trained_parameters(model, optimizer)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params if p.grad is not None] + list(model.buffers())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, keys: Collection[str] | None = None) -> list[torch.Tensor]:
    """The optimizer's tensor state in a deterministic order: param order, then key order; with
    `keys`, those under one of them only."""
    out: list[torch.Tensor] = []
    for p in _params(optimizer):
        state = optimizer.state.get(p, {})
        out.extend(state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor) and (keys is None or k in keys))
    return out


# The keys of torch's optimizers' state whose values must stay non-negative or exact: second
# moments and other accumulated squares (Adam's and AdamW's exp_avg_sq and max_exp_avg_sq,
# Adamax's exp_inf, RMSprop's and Adadelta's square_avg, Adadelta's acc_delta, Adagrad's sum,
# Adafactor's row_var, col_var and variance), Rprop's step sizes, and step counts. A coded payload
# (int8, int4, sparse) sends a change with an error of up to half its block's step, so a small
# second moment could land below zero, and Adam's square root of it is NaN (2 workers, AdamW,
# int8 with the state: NaN at step 33); these go in full precision beside the codes.
EXACT_STATE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "acc_delta", "sum", "row_var", "col_var", "variance", "step_size", "step"})


def exact_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Of the optimizer's tensor state, what a coded payload sends in full precision (EXACT_STATE's
    keys), in optimizer_state_tensors' order."""
    return optimizer_state_tensors(optimizer, EXACT_STATE)


def later_tensors(optimizer: torch.optim.Optimizer, average_updaters: bool, replaces: bool) -> list[torch.Tensor]:
    """What of the averaged state may land after the parameters (averaging.FlatAverager's
    `later`): the optimizer's, which only its next step reads; none where a replacement keeps a
    copy of the whole state at each round's start."""
    return optimizer_state_tensors(optimizer) if average_updaters and not replaces else []


def holds_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> bool:
    """Whether the optimizer holds state for every one of `params` (it creates it lazily, at a
    parameter's first step; plain SGD never does)."""
    return all(optimizer.state.get(p) for p in params)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


StateSignature = tuple[tuple[int, str, tuple[int, ...], str, bool], ...]


def optimizer_signature(optimizer: torch.optim.Optimizer) -> StateSignature:
    """(param index, key, shape, dtype, on the param's device) of each tensor of state."""
    sig = []
    for i, p in enumerate(_params(optimizer)):
        state = optimizer.state.get(p, {})
        for k in sorted(state):
            v = state[k]
            if isinstance(v, torch.Tensor):
                sig.append((i, k, tuple(v.shape), str(v.dtype), v.device == p.device))
    return tuple(sig)


def signature_hash(signature: object) -> int:
    """A 32-bit hash of a layout (a StateSignature, or a tuple holding one), the same in every process."""
    return zlib.crc32(repr(signature).encode())


def fill_missing_state(optimizer: torch.optim.Optimizer, union: StateSignature) -> None:
    """Create zero tensors for the entries of `union` this optimizer lacks.

    Optimizers create their state lazily, at a parameter's first step; a worker that has not
    stepped yet must still send a buffer of the agreed layout (it sends zeros with w = 0).
    """
    params = _params(optimizer)
    for i, key, shape, dtype_name, on_param_device in union:
        p = params[i]
        state = optimizer.state[p]
        if key not in state:
            dtype = getattr(torch, dtype_name.removeprefix("torch."))
            state[key] = torch.zeros(shape, dtype=dtype, device=p.device if on_param_device else "cpu")


def agree_on_optimizer_layout(optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None) -> None:
    """Gather every worker's state layout and give each worker the union of them."""
    world = dist.get_world_size(group)
    signatures: list[StateSignature | None] = [None] * world
    dist.all_gather_object(signatures, optimizer_signature(optimizer), group=group)
    union = sorted({entry for sig in signatures if sig for entry in sig})
    fill_missing_state(optimizer, tuple(union))


__all__ = [
    "agree_on_optimizer_layout",
    "averaged_tensors",
    "exact_tensors",
    "gradient_tensors",
    "holds_state",
    "optimizer_signature",
    "optimizer_state_tensors",
    "signature_hash",
    "state_layout",
    "trained_parameters",
]
