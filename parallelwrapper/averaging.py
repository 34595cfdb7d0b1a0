"""Sample-weighted averaging of tensors over a process group, on flat buffers.

One round of the protocol in DESIGN.md costs:

1. a header all-reduce of eight float64 numbers (samples w, loss sum, batches, finished, skipped
   and stop flags, a layout check), so every worker learns Σw before it sends any state;
2. one all-reduce per dtype of the state (params | buffers | optimizer state, or gradients),
   packed into one contiguous buffer and pre-scaled by w_i / Σw, so the sum *is* the average.

A worker with w = 0 sends zeros and receives the average. When Σw = 0 nobody trained and the
state collectives are skipped. Low-precision floats are averaged in float32 (w·x in fp16 can
overflow), integer tensors (BatchNorm's num_batches_tracked) in float64 and rounded back.

This module knows nothing of queues or processes: it takes a process group.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup | None  # None: the default group


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

    @property
    def score(self) -> float:
        """The sample-weighted mean loss of the round (NaN when nobody trained)."""
        return self.loss_sum / self.samples if self.samples > 0 else float("nan")


_LAYOUT_BITS = 20  # h and h² of a 20-bit hash sum exactly in float64 for any sane world size


def reduce_header(
    *,
    samples: int,
    loss_sum: float,
    batches: int,
    finished: bool,
    skipped: bool,
    layout: int,
    stop: bool = False,
    device: torch.device,
    world_size: int,
    group: ProcessGroup = None,
) -> RoundTotals:
    """All-reduce the round's header. `layout` is a hash of the sender's state layout; the layouts
    agree iff Σh = N·h and Σh² = N·h² on every rank (equality case of Cauchy-Schwarz)."""
    h = float(layout & ((1 << _LAYOUT_BITS) - 1))
    header = torch.tensor(
        [samples, loss_sum, batches, float(finished), float(skipped), float(stop), h, h * h],
        dtype=torch.float64,
        device=device,
    )  # (8,)
    dist.all_reduce(header, group=group)
    w, loss, nb, fin, skip, stp, sh, sh2 = header.tolist()
    agree = sh == world_size * h and sh2 == world_size * h * h
    return RoundTotals(w, loss, round(nb), round(fin), round(skip), round(stp), agree)


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype.is_floating_point:
        return torch.float32
    if dtype.is_complex:
        raise ValueError(f"cannot average complex tensors ({dtype})")
    return torch.float64  # integers and bools: exact up to 2**53, rounded back after averaging


class FlatAverager:
    """Averages a fixed list of tensors in place, one flat buffer and one all-reduce per dtype.

    The list's layout is fixed at construction; build a new averager when it changes.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(_reduce_dtype(t.dtype), []).append(t)
        self._groups: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for dtype, members in by_dtype.items():
            flat = torch.empty(sum(t.numel() for t in members), dtype=dtype, device=device)  # (Σ numel,)
            pairs, offset = [], 0
            for t in members:
                pairs.append((t, flat[offset : offset + t.numel()].view(t.shape)))
                offset += t.numel()
            self._groups.append((flat, pairs))
        self.numel = sum(flat.numel() for flat, _ in self._groups)
        self.nbytes = sum(flat.numel() * flat.element_size() for flat, _ in self._groups)

    @property
    def collectives(self) -> int:
        return len(self._groups)

    @torch.no_grad()
    def average(self, share: float, group: ProcessGroup = None) -> None:
        """Replace every tensor by Σ_i share_i · tensor_i, where share_i = w_i / Σw.

        share = 0 sends zeros, so whatever the tensors hold (even NaN) contributes nothing.
        """
        for flat, pairs in self._groups:
            if share == 0.0:
                flat.zero_()
            else:
                for t, view in pairs:
                    if t.dtype == view.dtype and t.device == view.device:
                        torch.mul(t, share, out=view)  # copy and scale in one pass over memory
                    else:  # widened (fp16, integers) or moved: scale in the buffer's precision
                        view.copy_(t).mul_(share)
            dist.all_reduce(flat, group=group)
            for t, view in pairs:
                t.copy_(view if t.is_floating_point() else view.round())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's tensor state in a deterministic order: param order, then key order."""
    out: list[torch.Tensor] = []
    for p in _params(optimizer):
        state = optimizer.state.get(p, {})
        out.extend(state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor))
    return out


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


def signature_hash(signature: StateSignature) -> int:
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


def agree_on_optimizer_layout(optimizer: torch.optim.Optimizer, group: ProcessGroup = None) -> None:
    """Gather every worker's state layout and give each worker the union of them."""
    world = dist.get_world_size(group)
    signatures: list[StateSignature | None] = [None] * world
    dist.all_gather_object(signatures, optimizer_signature(optimizer), group=group)
    union = sorted({entry for sig in signatures if sig for entry in sig})
    fill_missing_state(optimizer, tuple(union))
