"""Sample-weighted averaging of tensors over a process group, on flat buffers.

The state (params | buffers | optimizer state, or gradients) lives in one contiguous buffer per
dtype, so an averaging is one all-reduce per dtype and no copy. The first buffer can carry a
trailer: a few numbers that the caller sums with the state in the same collective (the round
protocol rides there, see rounds/); this module does not read them.

A worker that sends scale 0 sends zeros and receives the sum; not applying the sums leaves its
tensors as they were. Low-precision floats are averaged in float32 (w·x in fp16 can overflow),
integer tensors (BatchNorm's num_batches_tracked) in float64 and rounded back.

This module knows nothing of queues, processes or the protocol: it takes a process group. Its
flat buffers serve the averaging in the background too (delta_averaging.py).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .codec import DeltaCoder, codec, uncoded_or
from .wire import Flight, decode_coded, drop_coded, send_coded, send_trailer, size_and_rank, trailer_sums, wait_sums

ProcessGroup = dist.ProcessGroup | None  # None: the default group


def all_reduce_values(values: Sequence[float], device: torch.device, group: ProcessGroup = None) -> list[float]:
    """Sum a few numbers over the group on their own, in float64 (a trailer before any buffer exists)."""
    summed = torch.tensor(values, dtype=torch.float64, device=device)  # (len(values),)
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


def by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    """The tensors grouped by the dtype they are reduced in, in order. The first group carries the
    trailer: with no tensors at all, it is a float64 group of none."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(_reduce_dtype(t.dtype), []).append(t)
    return list(by_dtype.items()) or [(torch.float64, [])]


def views(flat: torch.Tensor, members: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One view of `flat` per member, shaped like it, laid end to end."""
    views, offset = [], 0
    for t in members:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def flat_buffer(members: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device, trailer: int = 0, parts: int = 1) -> torch.Tensor:
    """A buffer for the members end to end, then room for `trailer` numbers, padded with zeros to a
    multiple of `parts`. The members' part is left unwritten: its pages are touched only as each
    member moves in (its builder copies them) and lets its own storage go, never held twice at once."""
    data = sum(t.numel() for t in members)
    buffer = torch.empty(-(-(data + trailer) // parts) * parts, dtype=dtype, device=device)
    buffer[data:].zero_()
    return buffer


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if _LIBC is not None else 0
_MADV_DONTNEED = 4


def _let_go(view: torch.Tensor) -> None:
    """Hand the pages under `view` (a CPU buffer's part nobody reads again; zeros after) back to
    Linux now: a buffer's pages otherwise stay resident until all of it is freed."""
    if _LIBC is None or view.device.type != "cpu" or not view.numel():
        return
    start = -(-view.data_ptr() // _PAGE) * _PAGE
    end = (view.data_ptr() + view.numel() * view.element_size()) // _PAGE * _PAGE
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def put_trailer(buffer: torch.Tensor, data_numel: int, values: Sequence[float] | None) -> None:
    """The trailer's values after the data (zeros when None), and zeros in any padding after it."""
    slots = buffer[data_numel:]
    if slots.numel():
        slots.zero_()
        if values:
            slots[: len(values)].copy_(torch.tensor(list(values), dtype=buffer.dtype))


@dataclass(frozen=True)
class Shards:
    """Under a hierarchy: the ranks of a node hold the same buffers, so each all-reduces one of
    `size` equal parts across the nodes (its own process group), and the node's group gathers
    the parts: every byte crosses between nodes once, and no rank idles."""

    group: dist.ProcessGroup  # the node's ranks
    size: int
    index: int  # this rank's part


@dataclass(frozen=True)
class Errors:
    """A coded averager's error feedback, per group of one dtype (None: not coded): what one
    worker has yet to send, kept across fits and in checkpoints (codec.DeltaCoder.error)."""

    codec: str
    tensors: list[torch.Tensor | None]

    def state_dict(self) -> dict[str, object]:
        return {"codec": self.codec, "tensors": self.tensors}

    @staticmethod
    def of(state: dict[str, object]) -> Errors:
        return Errors(str(state["codec"]), list(state["tensors"]))  # type: ignore[call-overload]


@dataclass(frozen=True)
class Starts:
    """A coded averager's starts, per group of one dtype (None: not coded): what each change was
    taken from, the last average, the same on every rank (codec.DeltaCoder.start)."""

    codec: str
    tensors: list[torch.Tensor | None]


@dataclass
class _Group:
    """The tensors of one dtype in a FlatAverager."""

    flat: torch.Tensor  # (Σ numel [+ trailer],): the tensors' data end to end [and the trailer]
    data: torch.Tensor  # the tensors' part of flat
    resident: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor, its view): its storage is the view
    copied: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor, its view): copied in and out
    coder: DeltaCoder | None = None  # with a wire codec: the last average and the error fed back
    later: bool = False  # its sums start once the others' are in, and land at settle()
    exact: bool = False  # never coded: it travels in full precision whatever the wire
    spare: torch.Tensor | None = None  # `intact`: the buffer its sums go in, beside flat


def _coded(g: _Group) -> bool:
    """Whether a group travels coded under a wire codec: floating-point, and not exact."""
    return g.data.is_floating_point() and not g.exact


class FlatAverager:
    """Averages a fixed list of tensors in place, one flat buffer and one all-reduce per dtype.

    The tensors move into the buffers: each one that is reduced in its own dtype, on the buffer's
    device, and is contiguous has its storage replaced by a view of the buffer (`.data = view`,
    as FSDP does with its flat parameters), so an averaging copies nothing. The others (fp16,
    integers, channels-last) are copied in and out around each all-reduce. A tensor whose storage
    was replaced since (an optimizer that reallocates its state) is moved back in at the next send.
    `release()` gives every tensor its own storage again.

    `send(scale, trailer)` multiplies the tensors by `scale`, puts the trailer after them and
    starts the sums without waiting; `wait()` returns the trailer's sums; `apply(scale)` multiplies
    the summed tensors by `scale`: with send scale w_i / ref and apply scale ref / Σw the tensors
    end as Σ_i w_i·x_i / Σw for any common ref. A scale of 1 costs no pass over memory.

    The list of tensors is fixed at construction; build a new averager when it changes.

    Tensors given as `later` too (an optimizer's state, which only its next step reads) go in
    buffers of their own, whose all-reduce starts when wait() has the others' sums, so that it runs
    while the caller trains on; they land at `settle()`, with apply()'s scale, bitwise as if at
    once. Whoever reads them first calls settle() (an optimizer step pre-hook; send() and
    release() do themselves). Not with a codec or shards: everything goes at once there.

    With a `wire` codec (codec.CODECS) the floating-point tensors travel as their change since the
    last average, encoded with error feedback (codec.DeltaCoder), so nothing is lost in total,
    except those given as `exact` too (an optimizer's second moments, state.exact_tensors), which
    go in full precision in buffers of their own, beside the codes. Each
    payload goes to every other rank in pieces, by sends and receives (on gloo, twice as fast as an
    all_gather), and every rank's is decoded and summed in rank order in float32, the same on every
    worker, as they arrive; the trailer goes in float64 beside them. `average()` goes in full
    precision and sets the start; `start_coding()` sets it where the tensors are equal already.

    `intact`: a round whose sums fail leaves each worker's own state, from which a fleet's
    survivors resume the round (replacement/fleet.py): the sums in full precision go in a spare
    buffer of each group's size, so the tensors stay as they were until apply() (one copy more in
    memory, the passes over it the same where the scales are not 1); a coded group's tensors stay
    until it decodes, and its coder keeps the error as the send found it (codec.DeltaCoder's
    `keep`, one copy more), which `errors(failed=True)` gives back with the start of its change.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        device: torch.device,
        trailer: int = 0,
        wire: str | torch.dtype | None = None,
        shards: Shards | None = None,
        later: Sequence[torch.Tensor] = (),
        exact: Sequence[torch.Tensor] = (),
        intact: bool = False,
    ) -> None:
        self._wire, self._trailer_len, self._shards = uncoded_or(wire), trailer, shards
        self._intact = intact
        self._sent = False  # a send() not applied or discarded yet
        deferred = {id(t) for t in later} if self._wire is None and shards is None else set()
        exactly = {id(t) for t in exact} if self._wire is not None else set()
        if all(id(t) in deferred for t in tensors):
            deferred = set()  # the trailer's group lands at once
        parts = (  # (tensors, later, exact); later and exact never both: one needs a wire, the other none
            ([t for t in tensors if id(t) not in deferred and id(t) not in exactly], False, False),
            ([t for t in tensors if id(t) in deferred], True, False),
            ([t for t in tensors if id(t) in exactly], False, True),
        )
        layout = [(d, m, late, full) for ts, late, full in parts if ts for d, m in by_dtype(ts)] or [(*by_dtype([])[0], False, False)]
        self._groups: list[_Group] = []
        with torch.no_grad():
            for dtype, members, is_later, is_exact in layout:
                flat = flat_buffer(members, dtype, device, 0 if self._groups else trailer, 1 if shards is None else shards.size)
                group = _Group(flat, flat[: sum(t.numel() for t in members)], [], [], later=is_later, exact=is_exact)
                for t, view in zip(members, views(group.data, members)):
                    view.copy_(t)
                    if t.dtype == view.dtype and t.device == view.device and t.is_contiguous():
                        t.data = view
                        group.resident.append((t, view))
                    else:
                        group.copied.append((t, view))
                self._groups.append(group)
        self.numel = sum(g.data.numel() for g in self._groups)
        self.nbytes = sum(g.flat.numel() * g.flat.element_size() for g in self._groups)  # trailer included
        if self._wire is not None:  # what travels after the first round: the codes and scales, the trailer in float64
            self.nbytes = trailer * 8 + sum(codec(self._wire).nbytes(g.data.numel()) if _coded(g) else g.data.nbytes for g in self._groups)
        self._in_flight: list[Flight] = []  # per group, the later ones aside
        self._later: list[Flight] = []  # per later group: prepared by send(), started by wait()
        self._later_group: ProcessGroup = None
        self._later_scale: float | None = None  # apply()'s, for settle()
        self._wired_trailer: tuple[dist.Work, torch.Tensor] | None = None  # a wired round's float64 trailer

    @property
    def collectives(self) -> int:
        return len(self._groups)

    def codec_seconds(self) -> float:
        """With a wire codec: the seconds its coders spent encoding and decoding since the last
        call (0 without one)."""
        spent = 0.0
        for g in self._groups:
            if g.coder is not None:
                spent, g.coder.seconds = spent + g.coder.seconds, 0.0
        return spent

    @torch.no_grad()
    def send(self, scale: float, trailer: Sequence[float] | None = None, group: ProcessGroup = None, exact: bool = False) -> None:
        """Multiply every tensor by `scale`, put the trailer (zeros when None) after them and start
        summing over the group; with a wire codec and not `exact`, the deltas go encoded.

        scale = 0 sends zeros from a scratch buffer and leaves the tensors as they are (they may
        hold NaN, or be all this worker has when it turns out nobody trained).
        """
        self.settle()  # the last round's later sums, where no step has read them since
        assert not self._in_flight and not self._later, "wait() for the previous sums first"
        self._sent = True
        wired = self._wire is not None and not exact
        if wired:  # the trailer goes first, exact, beside the encoded deltas: its sums are in by wait()
            self._wired_trailer = send_trailer(trailer, self._trailer_len, self._groups[0].flat.device, group)
        for g in self._groups:
            for t, view in g.resident:
                if t.data_ptr() != view.data_ptr():  # reallocated since: move it back in
                    view.copy_(t)
                    t.data = view
            if wired and g.coder is not None:
                for t, view in g.copied:
                    view.copy_(t)
                self._in_flight.append(Flight(send_coded(g.coder, scale, group), None))
                continue
            if scale == 0.0:
                buffer = torch.zeros_like(g.flat)
            else:
                for t, view in g.copied:
                    view.copy_(t)
                if self._intact:  # the tensors stay as they are until apply()
                    if g.spare is None:
                        g.spare = torch.empty_like(g.flat)
                    buffer = g.spare
                    torch.mul(g.data, scale, out=buffer[: g.data.numel()])
                else:
                    buffer = g.flat
                    if scale != 1.0:
                        g.data.mul_(scale)
            put_trailer(buffer, g.data.numel(), trailer if not wired else None)
            if g.later and not exact:
                self._later.append(Flight([], buffer))
                continue
            part = buffer if self._shards is None else buffer.view(self._shards.size, -1)[self._shards.index]
            work = dist.all_reduce(part, group=group, async_op=True)
            assert work is not None
            self._in_flight.append(Flight([[work]], buffer))
        self._later_group = group

    def wait(self) -> list[float]:
        """Wait for the sums; the trailer's sums. (apply() waits for a coded round's pieces.)"""
        wait_sums(self._in_flight)
        for flight in self._in_flight:
            if self._shards is not None and flight.buffer is not None:  # reduced in parts: each rank's part, summed across nodes; gather them
                parts = flight.buffer.view(self._shards.size, -1)
                dist.all_gather(list(parts.unbind(0)), parts[self._shards.index].clone(), group=self._shards.group)
        for flight in self._later:  # the others are in: the later sums take the link while the caller trains on
            assert flight.buffer is not None
            work = dist.all_reduce(flight.buffer, group=self._later_group, async_op=True)
            assert work is not None
            flight.works.append([work])
        coded, self._wired_trailer = self._wired_trailer, None
        return trailer_sums(self._in_flight, coded, self._groups[0].data.numel(), self._trailer_len)

    @torch.no_grad()
    def apply(self, scale: float) -> None:
        """After wait(): every tensor becomes its sum times `scale` (the later ones at settle()).
        Not calling it (nobody trained) leaves the tensors as they were, when they were sent with
        scale 0."""
        for g, flight in zip(self._groups, self._in_flight):  # the later groups come last: not in flight yet
            self._land(g, flight, scale)
        self._in_flight, self._sent = [], False
        self._later_scale = scale if self._later else None

    @torch.no_grad()
    def settle(self) -> None:
        """Land the later groups' sums, with the last apply()'s scale: from here the optimizer's
        state holds its average. Nothing to do when none waits."""
        if self._later_scale is None:
            return
        for g, flight in zip((g for g in self._groups if g.later), self._later):
            flight.works[0][0].wait()
            self._land(g, flight, self._later_scale)
        self._later, self._later_scale = [], None

    def _land(self, g: _Group, flight: Flight, scale: float) -> None:
        if flight.buffer is None:  # every rank's payload: start + scale · Σ decoded, piece by piece
            assert g.coder is not None
            decode_coded(g.coder, flight.works, scale)
        elif flight.buffer is not g.flat:
            torch.mul(flight.buffer[: g.data.numel()], scale, out=g.data)
        elif scale != 1.0:
            g.data.mul_(scale)
        if g.coder is not None and flight.buffer is not None:
            g.coder.restart()  # a full-precision round: the next change is taken from here
        for t, view in g.copied:
            t.copy_(view if t.is_floating_point() else view.round())

    def discard(self) -> None:
        """After wait(), when nobody sent anything (every scale was 0): drop the sums; the tensors
        stay as they were."""
        for flight in self._in_flight:
            if flight.buffer is None:
                drop_coded(flight.works)
        for flight in self._later:
            flight.works[0][0].wait()
        self._in_flight, self._later, self._sent = [], [], False

    def average(self, share: float, group: ProcessGroup = None, errors: Errors | None = None) -> None:
        """Replace every tensor by Σ_i share_i · tensor_i, where share_i = w_i / Σw, in full
        precision; with a wire codec, the result is the start of the next round's deltas."""
        self.send(share, group=group, exact=True)
        self.wait()
        self.apply(1.0)
        if self._wire is not None:  # a coded group's spare served this round alone: its next go coded
            for g in self._groups:
                if _coded(g):
                    g.spare = None
        self.start_coding(group, errors)

    def start_coding(self, group: ProcessGroup = None, errors: Errors | None = None, starts: Starts | None = None) -> bool:
        """With a wire codec: the next deltas are taken from the tensors as they are now, which must
        be bitwise equal on every rank of the group (an average just landed, or a fit()'s start),
        or from `starts` (`starts()` of an averager of the same codec and sizes, whose round never
        landed: a fleet's survivors resume that round from their own state since). A worker alone
        codes nothing: its average is its own state, exactly. `errors` (`errors()` of an averager of
        the same codec and sizes: an earlier fit's, a checkpoint's) is what this worker has yet to
        send, fed back into its next change; else it starts at zero. False where `starts` do not
        fit (nothing is coded then)."""
        if self._wire is None:
            return True
        size, rank = size_and_rank(group)
        if size == 1:
            return True
        coded = [i for i, g in enumerate(self._groups) if _coded(g) and g.coder is None]
        if starts is not None and (starts.codec != self._wire or len(starts.tensors) != len(self._groups)):
            return False
        fits = errors is not None and errors.codec == self._wire and len(errors.tensors) == len(self._groups)
        for i in coded:
            g = self._groups[i]
            g.coder = DeltaCoder(self._wire, g.data, size, rank, keep=self._intact)
            kept = errors.tensors[i] if fits and errors is not None else None
            if kept is not None and kept.shape == g.coder.error.shape:
                g.coder.error.copy_(kept)
            start = None if starts is None else starts.tensors[i]
            if starts is not None and (start is None or start.shape != g.coder.start.shape):
                for j in coded:
                    self._groups[j].coder = None
                return False
            if start is not None:
                g.coder.start.copy_(start)
        return True

    def errors(self, failed: bool = False) -> Errors | None:
        """With a wire codec: each group's error fed back (what this worker has yet to send), a
        copy on the CPU; None without a codec or before coding starts. `failed`: the last send()
        never landed, and with `intact` its round goes again (redone or resumed): the error as it
        found it."""
        if self._wire is None or all(g.coder is None for g in self._groups):
            return None

        def error(coder: DeltaCoder) -> torch.Tensor:
            return coder.unsent if failed and self._sent and coder.unsent is not None else coder.error

        return Errors(self._wire, [None if g.coder is None else error(g.coder).detach().to("cpu", copy=True) for g in self._groups])

    def untouched(self) -> bool:
        """After a round that failed: whether every tensor holds this worker's own state, none of
        the round's sums applied: it failed before its send, or with `intact` before it landed
        (a coded group decodes nothing until every rank's first piece is in)."""
        return not self._sent or self._intact and all(g.coder is None or g.coder.decoded == 0 for g in self._groups)

    def starts(self) -> Starts | None:
        """With a wire codec: each group's start, what its change is taken from (the last average:
        the same on every rank), for `start_coding`; None without a codec or before coding starts.
        The coders' own tensors, not copies: a round that lands changes them."""
        if self._wire is None or all(g.coder is None for g in self._groups):
            return None
        return Starts(self._wire, [None if g.coder is None else g.coder.start for g in self._groups])

    @torch.no_grad()
    def release(self, settle: bool = True) -> None:
        """Give every tensor in the buffers a storage of its own again, letting each one's part of
        the buffer go as it leaves (the buffer and the copies are never held whole at once). The
        later sums land first, or with `settle=False` (the caller is failing) are dropped."""
        if settle:
            self.settle()
        self._later, self._later_scale = [], None
        for g in self._groups:
            g.spare = None
            for t, view in g.resident:
                if t.data_ptr() == view.data_ptr():
                    t.data = view.clone()
                    _let_go(view)


__all__ = ["Errors", "FlatAverager", "ProcessGroup", "Shards", "Starts", "all_reduce_values", "by_dtype", "flat_buffer", "put_trailer", "views"]
