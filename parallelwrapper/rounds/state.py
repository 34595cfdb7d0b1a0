"""What an averaging round averages, and the layout every worker must agree on before it does;
and what a synchronous step averages (SHARED_GRADIENTS, a warm-up, a node's steps).

AVERAGING's state is the trained parameters, the buffers and (with average_updaters) the
optimizer's state. Frozen parameters (requires_grad=False), those that no param group of the
optimizer holds, and those of a param group whose learning rate is 0 now, are left out: they are the same on every worker and nothing moves them,
so averaging them would only cost bytes and, with uneven weights, an ulp of rounding. Their
optimizer state is averaged all the same; when a schedule moves a group's lr off 0, the layout
changes on every worker alike, and the state is averaged anew.
"""

from __future__ import annotations

from typing import Any

import torch

from ..averaging import optimizer_signature, optimizer_state_tensors, signature_hash


def _still(group: dict[str, Any]) -> bool:
    """A param group that no step moves: its learning rate is 0."""
    return float(group.get("lr", 1.0)) == 0.0


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


__all__ = ["averaged_tensors", "gradient_tensors", "state_layout", "trained_parameters"]
