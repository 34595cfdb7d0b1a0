"""Batches through shared memory: a ring of reusable slots between the feeder and the workers.

Sending a tensor through a torch multiprocessing queue moves its storage into a new shared
memory segment and passes a file descriptor over a socket, for every tensor of every batch: on a
2-core machine that costs the workers about a tenth of their time. Instead, the feeder copies a
batch's tensors into one of `prefetch_buffer` slots, named POSIX shared memory segments that
every worker maps once, and sends only the slot number and the batch's layout (a few hundred
bytes). The worker copies the tensors out and hands the slot back at once, so a batch it keeps
(a training step may) is its own.

A tensor arrives as it was sent: its dtype, and its strides when it is dense (non-overlapping, no
gaps: channels_last, channels_last_3d, a transpose), whose bytes are copied as they lie in memory.
Only a tensor with gaps or repeats (a strided slice, an expanded view) arrives contiguous.

A slot grows when a batch does not fit (a new segment under a new name); the feeder owns the
segments and unlinks them when the pool closes.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Hashable
from multiprocessing import shared_memory
from multiprocessing.queues import Queue

import torch

from ..batches import map_leaves
from ..types import Batch

_ALIGN = 64  # every tensor starts on a cache line, so any dtype's view is aligned
_POLL_S = 0.1


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class TensorMeta:
    """Where a tensor leaf of a batch lies in its slot, and its layout: a dense tensor's elements
    lie there in memory order, to be viewed with its `stride`; with None, row-major (a tensor
    that was not dense, copied as `contiguous()` lays it out)."""

    __slots__ = ("offset", "dtype", "shape", "stride")

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...] | None = None) -> None:
        self.offset, self.dtype, self.shape, self.stride = offset, dtype, shape, stride

    def __reduce__(self) -> tuple[type[TensorMeta], tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...] | None]]:
        return (TensorMeta, (self.offset, self.dtype, self.shape, self.stride))


def memory_order(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s elements as they lie in memory, a 1-D view of them, when `t` is dense (its elements
    fill a span of its storage without gaps or repeats, in any order of dimensions: channels_last,
    a transpose); None when it is not (a strided slice, an expanded view)."""
    if t.is_contiguous():  # row-major: the common case, without the sort
        return t.view(-1)
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])  # outermost first; stable for ties
    permuted = t.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


def _hollow(batch: Batch) -> tuple[object, list[torch.Tensor], int]:
    """(skeleton, sources, size): the batch's structure (as batches.map_leaves walks it) with each
    tensor leaf replaced by a TensorMeta of its place and layout in a slot; each tensor's elements
    as the slot gets them (a 1-D CPU tensor: a view in memory order when it is dense, else a
    row-major copy), in that order; and the bytes the slot needs. Other leaves stay as they are."""
    sources: list[torch.Tensor] = []
    offset = 0

    def place(leaf: object) -> object:
        nonlocal offset
        if not isinstance(leaf, torch.Tensor):
            return leaf
        t = leaf.detach().cpu()  # a dense tensor keeps its strides (preserve_format)
        flat = memory_order(t)
        sources.append(t.contiguous().view(-1) if flat is None else flat)
        meta = TensorMeta(offset, t.dtype, tuple(t.shape), None if flat is None else tuple(t.stride()))
        offset += _aligned(t.numel() * t.element_size())
        return meta

    skeleton = map_leaves(batch, place)
    return skeleton, sources, offset


def _fill(skeleton: object, buffer: torch.Tensor) -> Batch:
    """The inverse of _hollow: each TensorMeta becomes a copy of its bytes in the slot, with the
    strides it was sent with."""

    def copy_out(leaf: object) -> object:
        if not isinstance(leaf, TensorMeta):
            return leaf
        numel = torch.Size(leaf.shape).numel()
        raw = buffer[leaf.offset : leaf.offset + numel * leaf.dtype.itemsize].view(leaf.dtype)
        if leaf.stride is None:
            return raw.view(leaf.shape).clone()
        out = torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype)
        out.as_strided((numel,), (1,)).copy_(raw)  # dense: its storage is its elements, in memory order
        return out

    return map_leaves(skeleton, copy_out)


class Segments:
    """Named shared-memory segments that this process owns, by index: one is made when first
    asked for, and replaced by a larger one (under a new name) when asked for more than it holds.
    `close` unlinks them all; a process that maps one by name (Mappings) sees the name change."""

    def __init__(self, n: int) -> None:
        self._segments: list[shared_memory.SharedMemory | None] = [None] * n

    def get(self, i: int, size: int) -> shared_memory.SharedMemory:
        """Segment `i`, of `size` bytes at least."""
        segment = self._segments[i]
        if segment is None or segment.size < size:
            if segment is not None:
                segment.close()
                segment.unlink()
            # A little headroom, so that batches of slowly growing size do not remap every time.
            segment = shared_memory.SharedMemory(create=True, size=max(_ALIGN, size + size // 8))
            self._segments[i] = segment
        return segment

    @property
    def names(self) -> list[str]:
        """The segments' names now (a process maps one by its name)."""
        return [s.name for s in self._segments if s is not None]

    def close(self) -> None:
        for i, segment in enumerate(self._segments):
            if segment is not None:
                segment.close()
                segment.unlink()
                self._segments[i] = None


class Mappings:
    """Another process's segments (Segments), each mapped once by its key and mapped again when
    its owner replaced it by a larger one under a new name."""

    def __init__(self) -> None:
        self._mapped: dict[Hashable, shared_memory.SharedMemory] = {}

    def get(self, key: Hashable, name: str) -> shared_memory.SharedMemory:
        segment = self._mapped.get(key)
        if segment is None or segment.name != name:
            if segment is not None:
                segment.close()  # it grew: the owner made a new segment
            segment = self._mapped[key] = shared_memory.SharedMemory(name=name)
        return segment

    def close(self) -> None:
        for segment in self._mapped.values():
            segment.close()
        self._mapped.clear()


class SlotWriter:
    """The feeder's side: owns the segments; `pack` blocks until a slot is free, or until
    `keep_waiting` says to give up."""

    def __init__(self, free: Queue[int], slots: int) -> None:
        self._free = free  # slot numbers the workers have handed back (a multiprocessing queue)
        self._segments = Segments(slots)
        for slot in range(slots):
            free.put(slot)

    def pack(self, batch: Batch, keep_waiting: Callable[[], bool]) -> tuple[int, str, object] | None:
        """(slot, segment name, skeleton): the batch with each tensor replaced by its place in
        the slot, where it has been copied; None when `keep_waiting`, called whenever no slot came
        for a while, returned False. (It is where the waiting caller does its other work: the
        feeder puts a replacement's batches back meanwhile, whose slots are all the free ones.)"""
        skeleton, sources, size = _hollow(batch)
        slot = self._take(keep_waiting)
        if slot is None:
            return None
        segment = self._segments.get(slot, size)
        offset = 0
        for source in sources:
            nbytes = source.numel() * source.element_size()
            if nbytes:
                # numpy's copy runs on this thread: torch's would wake its thread pool, whose
                # spinning threads take CPU from the workers on a small machine.
                buf = segment.buf
                assert buf is not None  # open until close()
                buf[offset : offset + nbytes] = source.view(torch.uint8).numpy().data
            offset += _aligned(nbytes)
        return slot, segment.name, skeleton

    def _take(self, keep_waiting: Callable[[], bool]) -> int | None:
        while True:
            try:
                slot: int = self._free.get(timeout=_POLL_S)
                return slot
            except queue.Empty:
                if not keep_waiting():
                    return None

    def close(self) -> None:
        self._segments.close()


class SlotReader:
    """A worker's side: maps each segment once, copies a batch out, hands the slot back."""

    def __init__(self, free: Queue[int]) -> None:
        self._free = free
        self._mapped = Mappings()

    def unpack(self, slot: int, name: str, skeleton: object, keep: bool = False) -> Batch:
        """The batch in `slot`, copied out; the slot goes back at once unless `keep` (a worker that
        may be replaced keeps it until its round lands: replacement/ledger.py), then by `release`."""
        segment = self._mapped.get(slot, name)
        buffer = torch.frombuffer(segment.buf, dtype=torch.uint8)
        batch = _fill(skeleton, buffer)
        del buffer  # no view of the segment may outlive this call
        if not keep:
            self.release(slot)
        return batch

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def close(self) -> None:
        self._mapped.close()
