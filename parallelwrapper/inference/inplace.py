"""INPLACE: each request runs in the caller's thread, on one of N replicas in this process, each behind a lock.

A caller takes the first free replica (one per device), or waits for one. Nothing is spawned and
nothing is copied but the model, once per replica."""

from __future__ import annotations

import copy
import itertools
import threading

import torch

from ..env import Placement
from ..errors import summary
from .requests import NOT_A_TENSOR, Request, answer, model_failed


class InPlace:
    """The replicas, their locks, and the state they serve."""

    def __init__(self, model: torch.nn.Module, placement: Placement) -> None:
        self._devices = [placement.device(i) for i in range(len(placement.devices))]
        self._replicas = [copy.deepcopy(model).to(d).eval() for d in self._devices]
        self._locks = [threading.Lock() for _ in self._replicas]
        self._turn = itertools.count()  # where a caller starts looking for a free replica

    def run(self, request: Request) -> None:
        """Answer `request` here, on the first free replica."""
        if not request.future.set_running_or_notify_cancel():
            return
        start = next(self._turn)
        order = [(start + i) % len(self._replicas) for i in range(len(self._replicas))]
        i = next((i for i in order if self._locks[i].acquire(blocking=False)), None)
        if i is None:
            i = order[0]
            self._locks[i].acquire()
        try:
            with torch.inference_mode():
                outputs = self._replicas[i](request.x.to(self._devices[i]))
        except Exception as e:  # noqa: BLE001 - the model's failure is this request's answer
            request.future.set_exception(model_failed(request, f"replica {i}", summary(e)))
            return
        finally:
            self._locks[i].release()
        if not isinstance(outputs, torch.Tensor):
            request.future.set_exception(model_failed(request, f"replica {i}", NOT_A_TENSOR.format(type(outputs).__name__)))
            return
        answer([request], outputs.cpu(), f"replica {i}")

    def update(self, state: dict[str, torch.Tensor]) -> None:
        """Each replica loads `state` between two requests."""
        for replica, lock in zip(self._replicas, self._locks):
            with lock:
                replica.load_state_dict(state)

    def close(self) -> None:
        """Nothing runs between requests."""
