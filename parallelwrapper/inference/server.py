"""ParallelInference, the object users hold, and its builder's `build()` (the setters are in settings.py).
It turns inputs into requests (requests.py) and hands them to the mode's engine:
spawned workers behind a queue (dispatch.py, pool.py, process.py) or replicas in the caller's
thread (inplace.py)."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..sendable import check_pickles
from .config import InferenceConfig, InferenceMode, placement
from .dispatch import Dispatcher
from .inplace import InPlace
from .requests import InferenceError, check_state, make_request
from .settings import InferenceSettings

if sys.version_info >= (3, 11):
    from typing import Self
else:  # Python 3.10: typing_extensions comes with torch
    from typing_extensions import Self

if TYPE_CHECKING:
    from ..wrapper import ParallelWrapper

_CLOSE_TIMEOUT_S = 10.0


class ParallelInference:
    """A model served by N workers, one device each, with dynamic batching (DL4J's
    ParallelInference). Build one with `ParallelInference.builder(model)...build()`.

    `output(x)` and `submit(x)` may be called from any number of threads at once. The workers
    start at `build()` and stop at `close()` (or the end of a `with` block). Outputs are CPU
    tensors. The model is served as it was at `build()`: later changes to it reach the workers
    only through `update_model`.
    """

    def __init__(self, config: InferenceConfig, model: torch.nn.Module) -> None:
        self.config = config
        self.placement = placement(config)
        self._served = {k: v.detach().to("meta") for k, v in model.state_dict().items()}  # the layout update_model checks
        self._engine: Dispatcher | InPlace = (
            InPlace(model, self.placement) if config.inference_mode is InferenceMode.INPLACE else Dispatcher(model, config, self.placement)
        )
        self._closed = False

    @staticmethod
    def builder(model: torch.nn.Module) -> InferenceBuilder:
        """A builder for serving `model`: set options on it, then `.build()`."""
        return InferenceBuilder(model)

    @staticmethod
    def from_wrapper(wrapper: ParallelWrapper, inference_mode: InferenceMode | str = InferenceMode.BATCHED) -> ParallelInference:
        """Serve a ParallelWrapper's model (after fit(), the averaged one) on the wrapper's devices,
        one worker each, with the builder's other defaults."""
        return ParallelInference.builder(wrapper.model).devices(wrapper.placement.devices).inference_mode(inference_mode).build()

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, x: torch.Tensor) -> Future[torch.Tensor]:
        """The model's output for `x` (one sample or a batch: .input_shape), as a future. Blocks
        while `queue_limit` requests wait. A failure (the model raised, its worker died, close())
        is the future's exception, an InferenceError; a wrong shape with .input_shape, a ValueError."""
        if self._closed:
            raise InferenceError("this ParallelInference is closed; build a new one to serve again")
        request = make_request(x, self.config.input_shape)
        if not request.future.done():
            if isinstance(self._engine, InPlace):
                self._engine.run(request)
            else:
                self._engine.put(request)
        return request.future

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for `x` (one sample or a batch), once it is there."""
        return self.submit(x).result()

    def output_batches(self, inputs: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """The outputs for `inputs`, in their order, while later inputs are being served: for
        scoring a data set. Up to `queue_limit` + `workers` requests are in flight at once."""
        ahead: deque[Future[torch.Tensor]] = deque()
        window = self.config.queue_limit + len(self.placement.devices)
        for x in inputs:
            ahead.append(self.submit(x))
            if len(ahead) >= window:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()

    def update_model(self, model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor]) -> None:
        """Serve new weights (a model of the same architecture, or its state_dict): every request
        submitted after this returns is answered by them; the ones in flight finish on the old or
        the new, and none is dropped. A state that does not fit raises ValueError, and nothing changes."""
        if self._closed:
            raise InferenceError("this ParallelInference is closed; build a new one to serve again")
        state = check_state(self._served, model_or_state_dict)
        self._engine.update(state)

    # -- life cycle -------------------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int | None]:
        """The workers' process ids, by rank (a worker started again has a new one); empty for INPLACE."""
        return [] if isinstance(self._engine, InPlace) else self._engine.pids

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Stop serving: requests still waiting for a worker fail at once with an InferenceError,
        those running get `timeout` seconds to finish (then fail the same way); the workers stop
        and the shared memory is freed. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if isinstance(self._engine, Dispatcher):
            self._engine.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close(timeout=0.0)


class InferenceBuilder(InferenceSettings):
    """Fluent configuration of a ParallelInference, after DL4J's `ParallelInference.Builder`.

    Every setter (settings.py) returns the builder; `build()` validates everything, raising
    `ValueError` naming the option and the fix, and starts the workers."""

    def build(self) -> ParallelInference:
        """Validate the options (a ValueError names the one to fix), check that the model can be sent
        to a spawned process, and start the workers; return once every one is ready to serve."""
        config = InferenceConfig(**self._options)
        placement(config)  # a device that does not exist fails here, before anything starts
        if config.inference_mode is not InferenceMode.INPLACE:
            check_pickles([("model", self._model)])
        return ParallelInference(config, self._model)


__all__ = ["InferenceBuilder", "InferenceError", "ParallelInference"]
