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
from typing import Any

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
STALE = 1 << _LAYOUT_BITS  # the layout sent by a worker whose state outgrew the buffers in flight


def _layout_value(layout: int | None) -> float:
    """What a worker puts in the header for its layout: the hash's low bits, or STALE."""
    return float(STALE if layout is None else layout & (STALE - 1))


def make_header(
    *,
    samples: int,
    loss_sum: float,
    batches: int,
    finished: bool,
    skipped: bool,
    layout: int | None,
    stop: bool = False,
    device: torch.device,
) -> torch.Tensor:
    """The round's header, to all-reduce. `layout` is a hash of the sender's state layout, or None
    when its state no longer matches the buffers it sends (see `read_header`)."""
    h = _layout_value(layout)
    return torch.tensor(
        [samples, loss_sum, batches, float(finished), float(skipped), float(stop), h, h * h],
        dtype=torch.float64,
        device=device,
    )  # (8,)


def read_header(header: torch.Tensor, layout: int | None, world_size: int) -> RoundTotals:
    """The totals of an all-reduced header. The layouts agree iff Σh = N·h and Σh² = N·h² on every
    rank (equality case of Cauchy-Schwarz) and nobody sent STALE."""
    h = _layout_value(layout)
    w, loss, nb, fin, skip, stp, sh, sh2 = header.tolist()
    agree = layout is not None and sh == world_size * h and sh2 == world_size * h * h
    return RoundTotals(w, loss, round(nb), round(fin), round(skip), round(stp), agree)


def reduce_header(*, device: torch.device, world_size: int, group: ProcessGroup = None, **fields: Any) -> RoundTotals:
    """All-reduce the round's header (the fields of `make_header`) and read the totals."""
    header = make_header(device=device, **fields)
    dist.all_reduce(header, group=group)
    return read_header(header, fields["layout"], world_size)


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype.is_floating_point:
        return torch.float32
    if dtype.is_complex:
        raise ValueError(f"cannot average complex tensors ({dtype})")
    return torch.float64  # integers and bools: exact up to 2**53, rounded back after averaging


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """The tensors grouped by the dtype they are reduced in, in order."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(_reduce_dtype(t.dtype), []).append(t)
    return by_dtype


def _views(flat: torch.Tensor, members: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One view of `flat` per member, shaped like it, laid end to end."""
    views, offset = [], 0
    for t in members:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def _flat(members: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(sum(t.numel() for t in members), dtype=dtype, device=device)  # (Σ numel,)


class FlatAverager:
    """Averages a fixed list of tensors in place, one flat buffer and one all-reduce per dtype.

    The list's layout is fixed at construction; build a new averager when it changes.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        self._groups: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for dtype, members in _by_dtype(tensors).items():
            flat = _flat(members, dtype, device)
            self._groups.append((flat, list(zip(members, _views(flat, members)))))
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


class DeltaAverager:
    """Averaging in the background, for `Builder.overlap_averaging(True)`.

    `launch(w)` snapshots the tensors and starts an all-reduce of w · snapshot without waiting;
    the worker trains on; `land(Σw)` waits for it and moves every tensor by (average − snapshot),
    so the steps taken since the snapshot are kept on top of the average. A worker that took no
    step since (the end of an epoch, a stop) therefore lands exactly on the average.

    `layout` is the state layout the buffers were built for: every launch sends buffers of this
    layout, whatever the optimizer has created since, until the workers agree on a new one.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device, layout: int) -> None:
        self.layout = layout
        self._groups: list[tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = []
        for dtype, members in _by_dtype(tensors).items():
            snapshot, total = _flat(members, dtype, device), _flat(members, dtype, device)
            self._groups.append((snapshot, total, list(zip(members, _views(snapshot, members), _views(total, members)))))
        self._in_flight: list[dist.Work] = []

    @torch.no_grad()
    def launch(self, weight: float, group: ProcessGroup = None) -> None:
        """Snapshot the tensors and start summing weight · snapshot over the group."""
        assert not self._in_flight, "land() the previous averaging first"
        for snapshot, total, members in self._groups:
            for t, snap, _ in members:
                snap.copy_(t)
            if weight == 0.0:
                total.zero_()  # whatever the snapshot holds (even NaN) contributes nothing
            else:
                torch.mul(snapshot, weight, out=total)
            work = dist.all_reduce(total, group=group, async_op=True)
            assert work is not None
            self._in_flight.append(work)

    @torch.no_grad()
    def land(self, total_weight: float, adopt: bool = False) -> None:
        """Wait for the sums; move each tensor by (average − snapshot), or, with `adopt` (its own
        progress since is worthless or nil), replace it by the average. Σw = 0: no change."""
        for work in self._in_flight:
            work.wait()
        self._in_flight = []
        if total_weight == 0:
            return
        for snapshot, total, members in self._groups:
            total.div_(total_weight)  # the average
            if not adopt:
                total.sub_(snapshot)  # its difference from this worker's snapshot
            for t, _, change in members:
                change = change if t.is_floating_point() else change.round()
                if adopt:
                    t.copy_(change)
                else:
                    t.add_(change.to(t.dtype))


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
