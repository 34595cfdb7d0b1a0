"""An inference worker's process: its replica on its device, forward passes on the batches in shared memory.

inference/pool.py starts it; it serves until told to close or its parent is gone.

Messages on its pipe, from the main process:
    ("model", pickle, state)  first: the model's pickle (bytes in shared memory) and the state
                              update_model last swapped in (None: the pickle's own)
    ("run", batch)            a Batch: inputs in segment `batch.inputs`, outputs to `batch.outputs`
    ("load", state)           update_model: the new state dict, its tensors in shared memory
    None                      close
and back, in the order of the batches (a worker may have two: one runs while the next is written):
    ("ready", None, None)            the replica is built
    ("done", seq, (dtype, shape))    batch `seq`'s outputs are in its output segment
    ("grow", seq, nbytes)            they need a larger output segment: run the batch again with one
    ("error", seq, summary)          the model raised on this batch (the process goes on)
    ("failed", None, summary)        the replica could not be built (the process exits)
"""

from __future__ import annotations

import pickle
import signal
import traceback
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Literal, cast

import torch

from ..env import Placement, claim_device
from ..errors import summary
from ..feed.slots import Mappings
from ..processes import adopt_environment, end_with_main_process
from .requests import NOT_A_TENSOR


@dataclass(frozen=True)
class Batch:
    """Where a batch's inputs lie and where its outputs go: named segments the main process owns."""

    seq: int  # the batch, as the replies name it
    slot: int  # which of the worker's pairs of segments it uses
    inputs: str  # segment name
    dtype: torch.dtype
    shape: tuple[int, ...]  # (rows, *sample shape)
    outputs: str  # segment name
    capacity: int  # bytes of the output segment


# The messages of the docstring, as types.
Model = tuple[Literal["model"], torch.Tensor, dict[str, torch.Tensor] | None]  # the first
Order = tuple[Literal["run"], Batch] | tuple[Literal["load"], dict[str, torch.Tensor]] | None  # every one after
Reply = (
    tuple[Literal["ready"], None, None]
    | tuple[Literal["done"], int, tuple[torch.dtype, tuple[int, ...]]]
    | tuple[Literal["grow"], int, int]
    | tuple[Literal["error"], int, str]
    | tuple[Literal["failed"], None, str]
)


def view(segment: shared_memory.SharedMemory, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the first bytes of `segment`. It must be let go before the segment is closed."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.frombuffer(segment.buf, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def serve(rank: int, placement: Placement, conn: Connection[Reply, Model | Order], environ: dict[str, str]) -> None:
    """The worker of `rank`: build the replica, answer ("ready", None, None), then run what comes
    (in the environment the main process had when it started this worker)."""
    adopt_environment(environ)
    end_with_main_process()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process decides
    mapped = Mappings()
    try:
        try:
            device = claim_device(placement, rank)
            torch.set_num_threads(placement.threads)
            model = _replica(cast(Model, conn.recv()), device)
        except Exception as e:  # noqa: BLE001 - every failure to start goes back to the main process
            conn.send(("failed", None, f"{summary(e)}\n\n{traceback.format_exc()}"))
            return
        conn.send(("ready", None, None))
        with torch.inference_mode():
            while (message := cast(Order, conn.recv())) is not None:
                if message[0] == "load":
                    model.load_state_dict(message[1])
                else:
                    conn.send(_run(model, message[1], mapped, device))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the main process is gone, or closed the pipe: nobody is left to answer
    finally:
        mapped.close()


def _replica(message: tuple[str, torch.Tensor, dict[str, torch.Tensor] | None], device: torch.device) -> torch.nn.Module:
    _, payload, state = message
    model: torch.nn.Module = pickle.loads(payload.numpy().data)
    del payload  # its shared pages go back now
    model = model.to(device).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _run(model: torch.nn.Module, batch: Batch, mapped: Mappings, device: torch.device) -> Reply:
    """One forward pass: the inputs read where they lie, the outputs written into the output segment."""
    inputs = view(mapped.get(("inputs", batch.slot), batch.inputs), batch.dtype, batch.shape)
    try:
        outputs = model(inputs.to(device))
    except Exception as e:  # noqa: BLE001 - the model's failure is this batch's answer
        return "error", batch.seq, summary(e)
    finally:
        del inputs  # no view of a segment may outlive this call: the next batch may remap it
    if not isinstance(outputs, torch.Tensor):
        return "error", batch.seq, NOT_A_TENSOR.format(type(outputs).__name__)
    nbytes = outputs.numel() * outputs.element_size()
    if nbytes > batch.capacity:
        return "grow", batch.seq, nbytes
    place = view(mapped.get(("outputs", batch.slot), batch.outputs), outputs.dtype, tuple(outputs.shape))
    place.copy_(outputs)
    del place
    return "done", batch.seq, (outputs.dtype, tuple(outputs.shape))


__all__ = ["Batch", "Model", "Order", "Reply", "serve", "view"]
