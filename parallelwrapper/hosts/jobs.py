"""The job a spawned worker unpickles: one pickle in shared memory, with the model's structure and not its weights.

One pickle serves every worker; hosts/process.py reads it."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from types import NotImplementedType
from typing import cast

import torch

from ..job import Job


def shared_pickle(job: Job) -> torch.Tensor:
    """The job's pickle, as bytes in shared memory (process.py unpickles it): the model's
    structure, not its weights. Every worker loads the fit's starting state (or a kept round's)
    into the model before it trains, so the tensors of its state dict go as blanks of their shape;
    a copy of the weights here would be one more model's size in the main process, twice over
    while pickle builds its bytes."""
    buffer = io.BytesIO()
    _StructurePickler(buffer, job.model).dump(job)
    data = buffer.getbuffer()
    out: torch.Tensor = torch.empty(len(data), dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    out.numpy().data[:] = data
    return out


class _StructurePickler(pickle.Pickler):
    """Pickles the tensors of `model`'s state dict (the objects themselves: a view kept
    elsewhere goes by value, as plain pickle sends it) as uninitialised tensors of the same shape, strides,
    dtype and device; a Parameter keeps its class, requires_grad and attributes."""

    def __init__(self, file: io.BytesIO, model: torch.nn.Module) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._blank = {id(t) for t in model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor) and _blankable(t)}

    def reducer_override(self, obj: object) -> tuple[Callable[..., object], tuple[object, ...]] | NotImplementedType:
        if id(obj) not in self._blank:
            return NotImplemented  # type: ignore[no-any-return]  # (typeshed types NotImplemented loosely)
        obj = cast(torch.Tensor, obj)  # one of the state dict's tensors, by its id
        spec: _Spec = (tuple(obj.size()), obj.stride(), obj.dtype, str(obj.device), obj.requires_grad)
        if type(obj) is torch.nn.Parameter:
            rebuild, args = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # type: ignore[no-untyped-call]
            return rebuild, (_Blank(spec), *args[1:])  # (data, requires_grad, hooks[, state])
        return _blank_tensor, spec


_Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, str, bool]  # _blank_tensor's arguments


def _blankable(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided and not t.is_quantized


def _blank_tensor(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: str, requires_grad: bool) -> torch.Tensor:
    """Uninitialised, not zeros: the worker loads a state into every one of these before it reads
    any, and the pages of a layer it never keeps (a pipeline stage's process drops the others'
    layers) are never touched, so they take no memory."""
    return torch.empty_strided(size, stride, dtype=dtype, device=device).requires_grad_(requires_grad)


class _Blank:
    """A Parameter's data, pickled as `_blank_tensor(*spec)`."""

    def __init__(self, spec: _Spec) -> None:
        self.spec = spec

    def __reduce__(self) -> tuple[Callable[..., torch.Tensor], _Spec]:
        return _blank_tensor, self.spec
