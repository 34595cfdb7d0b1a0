"""A training state sent between the main process and spawned workers without a copy of it.

A fit() starts every worker from the wrapper's state: the user's model and optimizer state. Sent
as it is, torch's reducers would put each tensor in a shared-memory segment of its own, moving the
user's own tensors there; copied first (so that the user's tensors stay put), the main process held
the state twice for the fit's start, its optimizer state included from the second fit on: four
model sizes (benchmarks/memory.py). Instead:

    reside(tensors)   the sender's own CPU tensors (a model's parameters and buffers, an
                      optimizer's state) that are not in shared memory move there, one buffer per
                      dtype, one tensor at a time: each becomes a view of its buffer (`.data =
                      view`, identity kept, as FlatAverager does), and its old storage goes. The
                      buffer's pages are touched only as tensors move in, so the state is never
                      held twice. Moved once, they stay: later fits move nothing.
    ship(state)       a TrainingState that pickles as the distinct shared storages its tensors
                      sit in and where each sits (one file descriptor a storage, not a tensor).
                      A tensor in no shared storage (on a GPU, or one whose storage something
                      else holds too, which reside leaves where it is) is copied into one more
                      shared buffer per dtype. Unpickled, it is a plain TrainingState of views of
                      those storages; a worker loads it by copy, so nobody writes to the main
                      process's tensors but it.

Worker 0 hands its state back at a fit's end the same way (Parts.shipped), and the main process
keeps the optimizer's tensors it receives, in their shared buffer, to send at the next fit. Under
torchrun or in one process nothing travels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch

from .averaging import views
from .batches import map_leaves
from .types import StateDict, TrainingState


def reside(tensors: Iterable[torch.Tensor]) -> None:
    """Move the CPU tensors that own their storage alone, contiguous, into fresh shared memory:
    one buffer per dtype, each tensor a view of it. Tensors in shared memory already, on another
    device, or whose storage anything else holds too (another tensor, a view, a `detach()` kept
    somewhere) stay as they are: moving one would leave the others behind."""
    movable = [t for t in {id(t): t for t in tensors}.values() if _alone(t) and not t.untyped_storage().is_shared()]
    with torch.no_grad():
        for members in _by_dtype(movable):
            for t, view in zip(members, _views(members)):
                view.copy_(t)
                t.data = view


def ship(state: TrainingState) -> TrainingState:
    """The state, to be put on the workers' command queues: it pickles as its shared storages and
    where each tensor sits in them, and unpickles as a TrainingState of views."""
    storages: list[torch.UntypedStorage] = []
    index: dict[int, int] = {}
    copied: list[torch.Tensor] = []

    def slot(leaf: object) -> object:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        storage = leaf.untyped_storage()
        if leaf.device.type != "cpu" or not storage.is_shared():
            copied.append(leaf)
            return _Copied(len(copied) - 1)
        if storage.data_ptr() not in index:
            index[storage.data_ptr()] = len(storages)
            storages.append(storage)
        return _Slot(index[storage.data_ptr()], leaf.dtype, int(leaf.storage_offset()), tuple(leaf.shape), tuple(leaf.stride()))

    parts = tuple(getattr(state, f.name) for f in dataclasses.fields(state))
    skeleton = map_leaves(parts, slot)
    shipped = _Shipped(*parts)
    object.__setattr__(shipped, "_sent", (skeleton, storages, _copies(copied)))
    return shipped


class _Shipped(TrainingState):
    """A TrainingState that pickles as `_sent`: (skeleton, shared storages, copies)."""

    def __reduce__(self) -> tuple[Callable[..., TrainingState], tuple[object, list[torch.UntypedStorage], list[torch.Tensor]]]:
        return _unpack, self.__dict__["_sent"]


def _unpack(skeleton: object, storages: list[torch.UntypedStorage], copies: list[torch.Tensor]) -> TrainingState:
    def tensor(leaf: object) -> object:
        if isinstance(leaf, _Copied):
            return copies[leaf.index]
        if isinstance(leaf, _Slot):
            return torch.empty(0, dtype=leaf.dtype).set_(storages[leaf.storage], leaf.offset, leaf.shape, leaf.stride)
        return leaf

    parts = cast("tuple[StateDict, StateDict, StateDict | None, StateDict | None]", map_leaves(skeleton, tensor))  # as ship took them
    return TrainingState(*parts)


@dataclass(frozen=True)
class _Slot:
    """Where one tensor sits: its storage's index, dtype, offset in elements, shape, stride."""

    storage: int
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _Copied:
    """A tensor sent as a copy: its index in the copies."""

    index: int


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # references to a storage: each tensor on it, each Python handle


def _alone(t: torch.Tensor) -> bool:
    """Whether `t` is a contiguous CPU tensor that is all of its storage, and nothing else holds
    that storage (where torch cannot say, it is taken as held)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() != 0 or _USE_COUNT is None:
        return False
    storage = t.untyped_storage()  # the one handle: t and it
    return storage.nbytes() == t.numel() * t.element_size() and _USE_COUNT(storage._cdata) == 2


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _views(members: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous views, end to end, of one new shared buffer for the members (of one dtype),
    shaped like them; its pages untouched until written."""
    numel = sum(t.numel() for t in members)
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(max(1, numel) * members[0].element_size())  # type: ignore[no-untyped-call]
    return views(torch.empty(0, dtype=members[0].dtype).set_(storage, 0, (numel,), (1,)), members)


def shared_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a state dict, its tensors contiguous in new shared buffers on the CPU, one per
    dtype: each copied once, straight into shared memory."""
    return dict(zip(state, _copies([t.detach() for t in state.values()]), strict=True))


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the tensors (any device), contiguous, in new shared buffers on the CPU."""
    copies = {}
    with torch.no_grad():
        for members in _by_dtype(tensors):
            for t, view in zip(members, _views(members)):
                copies[id(t)] = view.copy_(t)
    return [copies[id(t)] for t in tensors]


__all__ = ["reside", "ship", "shared_copies"]
