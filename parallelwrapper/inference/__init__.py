"""ParallelInference: a trained model served by N workers, one device each, with dynamic batching (DL4J's).
docs/guides/serving.md is the guide.

    with ParallelInference.builder(model).workers(2).input_shape(1, 28, 28).build() as pi:
        logits = pi.output(image)  # thread-safe, blocking; pi.submit(image) gives a Future

The parts: the options (config.py, settings.py); the object users hold (server.py); a request
from input to answer (requests.py); the BATCHED and SEQUENTIAL queue and its threads
(dispatch.py) over spawned workers (pool.py in this process, process.py in theirs), which
exchange inputs and outputs through shared memory; INPLACE replicas in the caller's thread
(inplace.py).
"""

from .config import INFERENCE_OPTIONS, InferenceConfig, InferenceMode
from .requests import InferenceError
from .server import InferenceBuilder, ParallelInference

__all__ = ["INFERENCE_OPTIONS", "InferenceBuilder", "InferenceConfig", "InferenceError", "InferenceMode", "ParallelInference"]
