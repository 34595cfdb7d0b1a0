"""How a user's functions, classes and arguments are named in fingerprints and messages, the same in every process.

A function defined in the script being run lives in module `__main__` in the process that ran
it, in `__mp_main__` in a spawned worker (which imports the script under that name), and in
`__main__` again under torchrun or in a later process resuming the run. They are one module, so
both are named `__main__`. A value whose `repr` holds a memory address (a `functools.partial`, a
function, any object without a `repr` of its own) is named without it, and a tensor by its shape
and dtype, never its numbers. Everything else is its `repr`.
"""

from __future__ import annotations

import functools
import re

import torch

LIMIT = 200  # characters: a name in an error message stays one readable line
_SCRIPT_MODULES = {"__mp_main__": "__main__"}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def qualified(obj: object) -> str:
    """`module.qualname` of a function or class; a callable object by its class."""
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None) or ""
    module = _SCRIPT_MODULES.get(module, module)
    name = str(target.__qualname__)
    return f"{module}.{name}" if module else name


def describe(value: object) -> str:
    """A value as the fingerprint holds it: stable across processes, never a tensor's numbers."""
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={list(value.shape)}, dtype={str(value.dtype).removeprefix('torch.')})"
    if isinstance(value, functools.partial):
        args = [describe(a) for a in value.args] + [f"{k}={describe(v)}" for k, v in value.keywords.items()]
        return f"partial({', '.join([qualified(value.func), *args])})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if callable(value) and hasattr(value, "__qualname__"):  # a function or a class
        return qualified(value)
    return _ADDRESS.sub("", repr(value))


def short(text: str) -> str:
    """`text` cut to LIMIT characters."""
    return text if len(text) <= LIMIT else text[:LIMIT] + "..."


__all__ = ["describe", "qualified", "short"]
