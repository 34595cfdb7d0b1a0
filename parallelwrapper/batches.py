"""One walker over batch structures: tuples, named tuples, lists and mappings in any nesting, every other object a leaf.

`map_leaves` is the only code in the package that decides what a container is and how to rebuild
it. Everything that moves, measures, describes or copies a batch (or a state dict) goes through it,
so that a named tuple, an OrderedDict or a tuple inside a list is treated the same way everywhere.

This module imports nothing of the package: only torch and the standard library.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TypeVar, cast

import torch

__all__ = ["map_leaves", "leaves", "tensors", "move_to", "batch_size", "describe", "to_cpu", "split"]

DESCRIBE_MAX_CHARS = 300  # longer descriptions are cut there and end in "..."

T = TypeVar("T")  # a structure that comes back as it went in: moving or copying its tensors keeps its type


def map_leaves(obj: object, fn: Callable[[object], object]) -> object:
    """The same structure with fn applied to every leaf. Containers are rebuilt with their own type:
    named tuples as type(obj)(*items), other tuples/lists as type(obj)(items), dicts (and dict
    subclasses such as OrderedDict) as type(obj)((k, v) ...) with keys kept as they are, any other
    Mapping (a Hugging Face BatchEncoding, a UserDict) as type(obj)(dict), or as a plain dict where
    its type takes no dict. This is THE walker; everything below uses it.

    Leaves are visited depth first, in order (dicts in their iteration order); fn is called once per
    leaf and never on a container. A defaultdict keeps its default_factory.
    """
    cls: Callable[..., object] = type(obj)  # a container's own type rebuilds it
    # Exact builtins first: the common case of every training step, without the subclass checks.
    if cls is tuple:
        return tuple([map_leaves(x, fn) for x in cast("tuple[object, ...]", obj)])
    if cls is list:
        return [map_leaves(x, fn) for x in cast("list[object]", obj)]
    if cls is dict:
        return {k: map_leaves(v, fn) for k, v in cast("dict[object, object]", obj).items()}
    if isinstance(obj, tuple):
        items = [map_leaves(x, fn) for x in obj]
        # A named tuple takes its fields as arguments; other tuple subclasses (torch.Size,
        # torch.return_types.*) take one sequence.
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    if isinstance(obj, list):
        return cls([map_leaves(x, fn) for x in obj])
    if isinstance(obj, dict):
        pairs = ((k, map_leaves(v, fn)) for k, v in obj.items())
        if isinstance(obj, defaultdict):  # its first argument is the factory
            return cls(obj.default_factory, pairs)
        return cls(pairs)
    if isinstance(obj, Mapping):  # BatchEncoding(data), UserDict(dict): not dicts, but built from one
        mapped = {k: map_leaves(v, fn) for k, v in obj.items()}
        try:
            return cls(mapped)
        except TypeError:
            return mapped
    return fn(obj)


def leaves(obj: object) -> list[object]:
    """Every leaf of obj, in order."""
    found: list[object] = []
    map_leaves(obj, found.append)  # append returns None: the rebuilt structure is thrown away
    return found


def tensors(obj: object) -> list[torch.Tensor]:
    """The tensor leaves of obj, in order."""
    return [leaf for leaf in leaves(obj) if isinstance(leaf, torch.Tensor)]


def move_to(batch: T, device: torch.device) -> T:
    """The batch with every tensor moved to `device` (non-blocking; a tensor already there is kept
    as it is, as Tensor.to does). Every other leaf is kept as it is."""

    def move(leaf: object) -> object:
        return leaf.to(device, non_blocking=True) if isinstance(leaf, torch.Tensor) else leaf

    return cast(T, map_leaves(batch, move))


def batch_size(batch: object) -> int:
    """Samples in a batch: dim 0 of its first tensor leaf (the others are not looked at).

    Raises ValueError if the batch holds no tensor, or its first tensor has no dimensions.
    """
    found = tensors(batch)
    if found and found[0].dim() > 0:
        return int(found[0].shape[0])
    raise ValueError(f"cannot count the samples of batch {describe(batch)}: it holds no tensor with a batch dimension")


class _Label:
    """What describe shows of a leaf: a tensor's dtype and shape, or another object's type name."""

    __slots__ = ("text",)

    def __init__(self, leaf: object) -> None:
        if isinstance(leaf, torch.Tensor):
            self.text = f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}"
        else:
            self.text = type(leaf).__name__


def describe(obj: object) -> str:
    """A short, readable shape of a batch for error messages, never a tensor's values:
    (float32[128, 1, 28, 28], int64[128]); lists render as tuples, dicts as {x: float32[3]},
    named tuples as Pair(a=float32[2], b=str). Cut to DESCRIBE_MAX_CHARS characters plus "..."."""
    text = _render(map_leaves(obj, _Label))
    return text if len(text) <= DESCRIBE_MAX_CHARS else text[:DESCRIBE_MAX_CHARS] + "..."


def _render(shape: object) -> str:
    """Joins a structure whose leaves are all _Labels into one string.

    map_leaves rebuilds containers; it cannot fold them into a string, and Python's own repr of the
    labelled structure would quote dict keys and bracket lists. So this small fold remains; it makes
    no decision of its own about what is a container: map_leaves has left only _Labels and
    tuples, lists and dicts.
    """
    if isinstance(shape, _Label):
        return shape.text
    if isinstance(shape, Mapping):
        return "{" + ", ".join(f"{k}: {_render(v)}" for k, v in shape.items()) + "}"
    items = cast("tuple[object, ...] | list[object]", shape)  # what map_leaves leaves besides
    fields = getattr(type(shape), "_fields", None) if isinstance(shape, tuple) else None
    if fields is not None:
        inner = ", ".join(f"{f}={_render(v)}" for f, v in zip(fields, items))
        return f"{type(shape).__name__}({inner})"
    return "(" + ", ".join(_render(v) for v in items) + ")"


def split(batch: T, parts: int) -> list[T]:
    """The batch cut along its batch dimension into `parts` micro-batches of about equal size
    (fewer where it has fewer samples), each the same structure: every tensor leaf whose dim 0 is
    the batch's size is cut (torch.tensor_split: views, no copy), every other leaf is kept whole in
    each (a scalar, a string, a tensor of another length). The samples keep their order."""
    n = batch_size(batch)
    parts = max(1, min(parts, n))

    found = leaves(batch)
    cuts = [torch.tensor_split(leaf, parts) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == n else None for leaf in found]

    def micro(i: int) -> T:  # map_leaves visits the leaves in the same order every time
        chosen = iter([leaf if cut is None else cut[i] for cut, leaf in zip(cuts, found)])
        return cast(T, map_leaves(batch, lambda _: next(chosen)))

    return [micro(i) for i in range(parts)]


def to_cpu(state: T) -> T:
    """A deep copy of a structure (a model's or an optimizer's state dict, say) with every tensor
    detached and copied to the CPU: a tensor already on the CPU is cloned too, since the sender
    keeps training on its own. Tuples and named tuples are copied like lists and dicts; other
    leaves (numbers, strings, None) are kept as they are."""

    def copy(leaf: object) -> object:
        return leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else leaf

    return cast(T, map_leaves(state, copy))
