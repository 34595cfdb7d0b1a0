"""Sample-weighted averaging of tensors over a process group, on flat buffers.

A round of the protocol in DESIGN.md is one all-reduce per dtype of the state (params | buffers |
optimizer state, or gradients), which lives in one contiguous buffer per dtype. The round's
header (samples w, loss sum, batches, finished, skipped and stop flags, a layout check) rides in
the first buffer, after the state, so a round costs one collective for most models. Each worker
pre-scales its state by w_i / Σw' where Σw' is the last round's Σw, a guess every worker shares:
when it holds, the sum *is* the average; when it does not (an epoch's last round), one more pass
scales the sum by Σw' / Σw. The first round of a fit() sends the header alone, first, and builds
the buffers.

A worker with w = 0 sends zeros and receives the average; when Σw = 0 nobody trained and the
sums are dropped. Low-precision floats are averaged in float32 (w·x in fp16 can overflow),
integer tensors (BatchNorm's num_batches_tracked) in float64 and rounded back.

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


_LAYOUT_BITS = 20
_SAMPLES_SPLIT = 1 << 12  # samples go as (w // 4096, w % 4096): sums exact in float32 to 2**36
HEADER_LEN = 8 + _LAYOUT_BITS  # numbers in a header


def make_header(
    *,
    samples: int,
    loss_sum: float,
    batches: int,
    finished: bool,
    skipped: bool,
    layout: int | None,
    stop: bool = False,
) -> list[float]:
    """The round's header: HEADER_LEN numbers to sum over the workers. `layout` is a hash of the
    sender's state layout, or None (stale) when its state no longer matches the buffers it sends.
    Every count sums exactly even in float32, the dtype of the buffer the header usually rides
    in: the sample count goes in two parts, the hash as one 0/1 number per bit."""
    bits = [0.0] * _LAYOUT_BITS if layout is None else [float(layout >> i & 1) for i in range(_LAYOUT_BITS)]
    flags = [float(finished), float(skipped), float(stop), float(layout is None)]
    high, low = divmod(samples, _SAMPLES_SPLIT)
    return [float(high), float(low), float(loss_sum), float(batches), *flags, *bits]


def read_header(summed: Sequence[float], layout: int | None, world_size: int) -> RoundTotals:
    """The totals of a summed header. The layouts agree iff nobody was stale and every bit's sum
    is N times this worker's bit: all 0 or all 1."""
    high, low, loss, nb, fin, skip, stp, stale, *bits = summed
    agree = layout is not None and stale == 0 and all(b == world_size * (layout >> i & 1) for i, b in enumerate(bits))
    samples = float(round(high) * _SAMPLES_SPLIT + round(low))
    return RoundTotals(samples, loss, round(nb), round(fin), round(skip), round(stp), agree)


def reduce_header(header: Sequence[float], device: torch.device, group: ProcessGroup = None) -> list[float]:
    """All-reduce a header on its own (the first round of a fit()), in float64."""
    summed = torch.tensor(header, dtype=torch.float64, device=device)  # (HEADER_LEN,)
    dist.all_reduce(summed, group=group)
    return summed.tolist()


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype.is_floating_point:
        return torch.float32
    if dtype.is_complex:
        raise ValueError(f"cannot average complex tensors ({dtype})")
    return torch.float64  # integers and bools: exact up to 2**53, rounded back after averaging


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    """The tensors grouped by the dtype they are reduced in, in order. The first group carries the
    header: with no tensors at all, it is a float64 group of none."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(_reduce_dtype(t.dtype), []).append(t)
    return list(by_dtype.items()) or [(torch.float64, [])]


def _views(flat: torch.Tensor, members: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One view of `flat` per member, shaped like it, laid end to end."""
    views, offset = [], 0
    for t in members:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def _flat(members: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device, header: bool) -> torch.Tensor:
    """A buffer for the members, end to end, then room for a header when `header`."""
    return torch.empty(sum(t.numel() for t in members) + (HEADER_LEN if header else 0), dtype=dtype, device=device)


def _header_slots(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[-HEADER_LEN:]  # (HEADER_LEN,)


@dataclass
class _Group:
    """The tensors of one dtype in a FlatAverager."""

    flat: torch.Tensor  # (Σ numel [+ HEADER_LEN],): the tensors' data end to end [and the header]
    data: torch.Tensor  # the tensors' part of flat
    resident: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor, its view): its storage is the view
    copied: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor, its view): copied in and out


class FlatAverager:
    """Averages a fixed list of tensors in place, one flat buffer and one all-reduce per dtype.

    The tensors move into the buffers: each one that is reduced in its own dtype, on the buffer's
    device, and is contiguous has its storage replaced by a view of the buffer (`.data = view`,
    as FSDP does with its flat parameters), so an averaging copies nothing. The others (fp16,
    integers, channels-last) are copied in and out around each all-reduce. A tensor whose storage
    was replaced since (an optimizer that reallocates its state) is moved back in at the next send.
    `release()` gives every tensor its own storage again.

    `send(scale, header)` multiplies the tensors by `scale`, puts the header after them and starts
    the sums without waiting; `wait()` returns the header's sums; `apply(scale)` multiplies the
    summed tensors by `scale`: with send scale w_i / ref and apply scale ref / Σw the tensors end
    as Σ_i w_i·x_i / Σw for any common ref. A scale of 1 costs no pass over memory.

    The list's layout (`layout`, a hash the caller keeps) is fixed at construction; build a new
    averager when it changes.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device, layout: int = 0) -> None:
        self.layout = layout
        self._groups: list[_Group] = []
        with torch.no_grad():
            for dtype, members in _by_dtype(tensors):
                flat = _flat(members, dtype, device, header=not self._groups)
                group = _Group(flat, flat[: sum(t.numel() for t in members)], [], [])
                for t, view in zip(members, _views(group.data, members)):
                    view.copy_(t)
                    if t.dtype == view.dtype and t.device == view.device and t.is_contiguous():
                        t.data = view
                        group.resident.append((t, view))
                    else:
                        group.copied.append((t, view))
                self._groups.append(group)
        self.numel = sum(g.data.numel() for g in self._groups)
        self.nbytes = sum(g.flat.numel() * g.flat.element_size() for g in self._groups)  # header included
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # (work, the buffer it sums)

    @property
    def collectives(self) -> int:
        return len(self._groups)

    @torch.no_grad()
    def send(self, scale: float, header: Sequence[float] | None = None, group: ProcessGroup = None) -> None:
        """Multiply every tensor by `scale`, put the header (zeros when None) after them and start
        summing over the group.

        scale = 0 sends zeros from a scratch buffer and leaves the tensors as they are (they may
        hold NaN, or be all this worker has when it turns out nobody trained).
        """
        assert not self._in_flight, "wait() for the previous sums first"
        for g in self._groups:
            for t, view in g.resident:
                if t.data_ptr() != view.data_ptr():  # reallocated since: move it back in
                    view.copy_(t)
                    t.data = view
            if scale == 0.0:
                buffer = torch.zeros_like(g.flat)
            else:
                buffer = g.flat
                for t, view in g.copied:
                    view.copy_(t)
                if scale != 1.0:
                    g.data.mul_(scale)
            if g is self._groups[0]:
                _header_slots(buffer).copy_(torch.tensor(header or [0.0] * HEADER_LEN, dtype=buffer.dtype))
            work = dist.all_reduce(buffer, group=group, async_op=True)
            assert work is not None
            self._in_flight.append((work, buffer))

    def wait(self) -> list[float]:
        """Wait for the sums; the header's sums."""
        for work, _ in self._in_flight:
            work.wait()
        return _header_slots(self._in_flight[0][1]).tolist()

    @torch.no_grad()
    def apply(self, scale: float) -> None:
        """After wait(): every tensor becomes its sum times `scale`. Not calling it (nobody
        trained) leaves the tensors as they were, when they were sent with scale 0."""
        for g, (_, buffer) in zip(self._groups, self._in_flight):
            if buffer is not g.flat:
                torch.mul(buffer[: g.data.numel()], scale, out=g.data)
            elif scale != 1.0:
                g.data.mul_(scale)
            for t, view in g.copied:
                t.copy_(view if t.is_floating_point() else view.round())
        self._in_flight = []

    def average(self, share: float, group: ProcessGroup = None) -> None:
        """Replace every tensor by Σ_i share_i · tensor_i, where share_i = w_i / Σw."""
        self.send(share, group=group)
        self.wait()
        self.apply(1.0)

    @torch.no_grad()
    def release(self) -> None:
        """Give every tensor in the buffers a storage of its own again."""
        for g in self._groups:
            for t, view in g.resident:
                if t.data_ptr() == view.data_ptr():
                    t.data = view.clone()


class DeltaAverager:
    """Averaging in the background, for `Builder.overlap_averaging(True)`.

    `launch(w, header)` snapshots the tensors and starts an all-reduce of w · snapshot, with the
    header after it, without waiting; the worker trains on; `wait()` returns the header's sums and
    `land(Σw)` moves every tensor by (average − snapshot), so the steps taken since the snapshot
    are kept on top of the average. A worker that took no step since (the end of an epoch, a
    stop) therefore lands exactly on the average.

    `layout` is the state layout the buffers were built for: every launch sends buffers of this
    layout, whatever the optimizer has created since, until the workers agree on a new one.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device, layout: int) -> None:
        self.layout = layout
        self._groups: list[tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = []
        for dtype, members in _by_dtype(tensors):
            first = not self._groups
            snapshot, total = _flat(members, dtype, device, header=False), _flat(members, dtype, device, header=first)
            self._groups.append((snapshot, total, list(zip(members, _views(snapshot, members), _views(total, members)))))
        self._in_flight: list[dist.Work] = []

    @torch.no_grad()
    def launch(self, weight: float, header: Sequence[float], group: ProcessGroup = None) -> None:
        """Snapshot the tensors and start summing weight · snapshot, and the header, over the group."""
        assert not self._in_flight, "land() the previous averaging first"
        for snapshot, total, members in self._groups:
            for t, snap, _ in members:
                snap.copy_(t)
            data = total[: snapshot.numel()]
            if weight == 0.0:
                data.zero_()  # whatever the snapshot holds (even NaN) contributes nothing
            else:
                torch.mul(snapshot, weight, out=data)
            if snapshot is self._groups[0][0]:
                _header_slots(total).copy_(torch.tensor(header, dtype=total.dtype))
            work = dist.all_reduce(total, group=group, async_op=True)
            assert work is not None
            self._in_flight.append(work)

    def wait(self) -> list[float]:
        """Wait for the sums; the header's sums."""
        for work in self._in_flight:
            work.wait()
        return _header_slots(self._groups[0][1]).tolist()

    @torch.no_grad()
    def land(self, total_weight: float, adopt: bool = False) -> None:
        """After wait(): move each tensor by (average − snapshot), or, with `adopt` (its own
        progress since is worthless or nil), replace it by the average. Σw = 0: no change."""
        self._in_flight = []
        if total_weight == 0:
            return
        for snapshot, total, members in self._groups:
            data = total[: snapshot.numel()]
            data.div_(total_weight)  # the average
            if not adopt:
                data.sub_(snapshot)  # its difference from this worker's snapshot
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
