"""One request to a ParallelInference, from the caller's input to its future's answer, and how each one fails.

The input is taken as one sample or a batch, the outputs are cut back into requests, the model's
failure is named by the request's shape, and `update_model` may swap in a state dict."""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future

import torch

from ..batches import describe

NOT_A_TENSOR = "the model returned a {}; ParallelInference serves models that return one tensor"


class InferenceError(RuntimeError):
    """A request that got no answer: the model failed on it, its worker died, or the
    ParallelInference closed first. The first line says which, where, and what to do."""


class Request:
    """A caller's input as a batch (rows, *sample shape), its future, and whether the caller gave
    one sample (the answer is then that row's output, without the batch dimension)."""

    __slots__ = ("at", "future", "key", "rows", "single", "x")

    def __init__(self, x: torch.Tensor, single: bool) -> None:
        self.x, self.single = x, single
        self.future: Future[torch.Tensor] = Future()
        self.at = time.monotonic()  # when it was submitted: BATCHED waits at most max_wait_ms from here
        shape = tuple(x.shape)
        self.rows = shape[0] if shape else 0
        self.key = (x.dtype, shape[1:])  # requests of the same key go together in one forward pass

    def shape(self) -> str:
        """The input as the caller gave it, for error messages."""
        x = self.x[0] if self.single else self.x
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"


def make_request(x: object, input_shape: tuple[int, ...] | None) -> Request:
    """The request for input `x`. A tensor of `input_shape` is one sample, one of (B, *input_shape)
    a batch; without `input_shape`, every input is a batch. Another shape, or not a tensor, is a
    request whose future has already failed, saying why."""
    if not isinstance(x, torch.Tensor):
        return failed(f"an input must be a torch.Tensor, got {type(x).__name__}: pass torch.as_tensor(x)")
    if input_shape is None:
        if x.dim() == 0:
            return failed("an input of shape [] (a scalar) has no batch dimension: pass a batch (B, ...), or set .input_shape(...) to send single samples")
        return Request(x.detach(), single=False)
    if tuple(x.shape) == input_shape:
        return Request(x.detach().unsqueeze(0), single=True)
    if tuple(x.shape[1:]) == input_shape:
        return Request(x.detach(), single=False)
    return failed(
        f"an input of shape {list(x.shape)} is neither one sample {list(input_shape)} nor a batch "
        f"[B, {', '.join(map(str, input_shape))}] (.input_shape); send it in one of those shapes, or build with the .input_shape(...) of its samples"
    )


def failed(message: str) -> Request:
    request = Request(torch.empty(0), single=False)
    request.future.set_exception(ValueError(message))
    return request


def model_failed(request: Request, where: str, error: str) -> InferenceError:
    """The model raised on the forward pass that held `request`: named by the request's shape."""
    return InferenceError(
        f"the model failed on an input of shape {request.shape()} in {where}: {error}; check that the input "
        f"is what the model takes (the other requests go on)"
    )


def answer(requests: list[Request], outputs: torch.Tensor, where: str) -> None:
    """Each request's rows of `outputs` (the batch's outputs, row for row, in memory of their own:
    each answer is a view of them)."""
    if outputs.dim() == 0 or outputs.shape[0] != sum(r.rows for r in requests):
        rows = sum(r.rows for r in requests)
        error = f"the model returned {describe(outputs)} for {rows} rows; ParallelInference needs one output row per input row"
        for r in requests:
            r.future.set_exception(model_failed(r, where, error))
        return
    start = 0
    for r in requests:
        out = outputs[start : start + r.rows]
        start += r.rows
        r.future.set_result(out[0] if r.single else out)


def check_state(served: Mapping[str, torch.Tensor], state: object) -> dict[str, torch.Tensor]:
    """`update_model`'s argument as a state dict that fits the served model (a module gives its
    own), or a ValueError naming the first differences."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"update_model takes a torch.nn.Module or its state_dict(), got {type(state).__name__}")
    problems = [f"missing {k}" for k in served if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in served]
    problems += [
        f"{k} is {str(v.dtype).removeprefix('torch.')}{list(v.shape)} here, {str(state[k].dtype).removeprefix('torch.')}{list(state[k].shape)} given"
        for k, v in served.items()
        if k in state and (v.shape != state[k].shape or v.dtype != state[k].dtype)
    ]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(f"update_model: the state does not fit the served model: {'; '.join(problems[:3])}{more}; pass the state of the same architecture")
    return dict(state)


__all__ = ["NOT_A_TENSOR", "InferenceError", "Request", "answer", "check_state", "failed", "make_request", "model_failed"]
