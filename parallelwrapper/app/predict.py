"""Scoring a saved model on the MNIST test set with a ParallelInference: the function behind `pw-fit predict`.

Usable from Python:

    result = predict_mnist(PredictOptions(Path("out/model.pt"), data_dir=Path("../shared/data/mnist")))

The model is `--model`'s architecture with the state dict that `pw-fit --out DIR` saved as
DIR/model.pt. The test images go to the workers as requests of `request_size` images each (1:
single images, as a server gets them, which BATCHED mode batches while the workers are busy),
streamed in order through `output_batches`; the accuracy is argmax(output) == label.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from parallelwrapper import ParallelInference

from .mnist import load_mnist
from .models import MODEL_NAMES, build_model
from .options import RunOptions, check_int


@dataclass(frozen=True)
class PredictOptions:
    """What `pw-fit predict` scores and how, validated on construction: its own fields here, the
    serving options (workers, inference_mode, batch_limit: parallelwrapper.INFERENCE_OPTIONS) by
    the library, which refuses a bad one with its message when the ParallelInference is built."""

    model_path: Path  # a state dict, as `pw-fit --out DIR` saves DIR/model.pt
    model: str = "lenet"  # the architecture it was trained as
    workers: int = 2  # pw-fit predict's default; the library's is one per GPU
    inference_mode: str = "batched"  # an InferenceMode's value
    request_size: int = 1  # test images per request
    batch_limit: int = 32  # BATCHED: samples in one forward pass, at most
    device: str = "auto"  # as pw-fit's --device
    data_dir: Path | None = None  # None: the loader's cache dir
    download: bool = True
    test_samples: int | None = None  # the first N test images only: for smoke tests

    def __post_init__(self) -> None:
        if self.model not in MODEL_NAMES:
            raise ValueError(f"model must be one of {list(MODEL_NAMES)}, got {self.model!r}")
        check_int("request_size", self.request_size)
        if self.test_samples is not None:
            check_int("test_samples", self.test_samples)


@dataclass(frozen=True)
class Prediction:
    """What `pw-fit predict` prints."""

    accuracy: float
    samples: int
    requests: int
    seconds: float  # from the first request to the last answer: the workers' start-up excluded

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds

    def describe(self) -> str:
        return (
            f"test accuracy {self.accuracy:.4f} on {self.samples:,} MNIST test images\n"
            f"{self.samples_per_second:,.0f} samples/s ({self.requests:,} requests in {self.seconds:.2f} s, start-up excluded)"
        )


def load_model(path: Path, name: str) -> torch.nn.Module:
    """Architecture `name` with the state dict saved at `path`; a ValueError that says what to pass
    when the file is not one, or is another architecture's."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise ValueError(f"--model-path {path} is not a saved state dict ({type(e).__name__}); pass the model.pt that pw-fit --out DIR writes") from None
    if not isinstance(state, dict) or not state:
        raise ValueError(f"--model-path {path} holds a {type(state).__name__}, not a state dict; pass the model.pt that pw-fit --out DIR writes")
    model = build_model(name)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[1:2] or [str(e)]
        raise ValueError(f"--model-path {path} does not fit --model {name} ({first[0].strip()}); pass the --model it was trained as") from None
    return model.eval()


def predict_mnist(options: PredictOptions, echo: Callable[[str], None] | None = print) -> Prediction:
    """Score the saved model on the MNIST test set with `options.workers` workers; `echo` is
    told where they run."""
    model = load_model(options.model_path, options.model)
    test = load_mnist(options.data_dir, "test", download=options.download)
    n = len(test) if options.test_samples is None else min(options.test_samples, len(test))
    ((images, labels),) = test.batches(len(test))  # the whole split, normalized as in training
    images, labels = images[:n], labels[:n]
    devices = RunOptions.of(workers=options.workers, device=options.device).worker_devices()
    builder = ParallelInference.builder(model).workers(options.workers).inference_mode(options.inference_mode).batch_limit(options.batch_limit)
    with (builder.devices(devices) if devices is not None else builder).build() as served:
        if echo is not None:
            p = served.placement
            threads = f"{p.threads} thread{'s' if p.threads != 1 else ''}"
            echo(f"{options.model} from {options.model_path}: {options.workers} workers on {', '.join(sorted(set(p.devices)))}, {threads} each, {options.inference_mode}")
        start = time.perf_counter()
        requests = torch.split(images, options.request_size)
        outputs = torch.cat(list(served.output_batches(requests)))
        seconds = time.perf_counter() - start
    accuracy = (outputs.argmax(dim=1) == labels).float().mean().item()
    return Prediction(accuracy, n, len(requests), seconds)


__all__ = ["PredictOptions", "Prediction", "load_model", "predict_mnist"]
