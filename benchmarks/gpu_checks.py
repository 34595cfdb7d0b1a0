"""The checks that need a GPU, for the day one is lent: the CUDA paths that the CPU machines test
only with a faked GPU count, each run for real on `cuda:0`, each a short fit on MNIST.

    python benchmarks/gpu_checks.py --data-dir DIR [--out benchmarks/results/gpu_checks.json]

Each check prints one line, PASS or FAIL and what it saw; the exit code is the number that
failed. With one GPU, one worker has it alone (an NCCL group of one) and two workers share it
(gloo, with the warning that says so).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from common import LR, MOMENTUM, lenet, mnist_batches
from parallelwrapper import InferenceMode, ParallelInference, ParallelWrapper

DEVICE = "cuda:0"  # --device: "cpu" tries the script itself on a machine without a GPU


class FormatProbe(nn.Module):
    """LeNet that counts the inputs its forward sees in channels_last, and all inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = lenet()
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += torch.tensor([float(x.is_contiguous(memory_format=torch.channels_last)), 1.0], device=x.device)
        return self.net(x)  # type: ignore[no-any-return]


def _builder(model: nn.Module, workers: int = 1) -> Any:
    return (
        ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM, nesterov=True)
        .loss_fn(nn.functional.cross_entropy).workers(workers).devices([DEVICE] * workers).averaging_frequency(3)
    )  # fmt: skip


def _accuracy(wrapper: Any, test: list[Any]) -> float:
    return float(wrapper.evaluate(test, device=DEVICE)["accuracy"])


def one_worker(train: list[Any], test: list[Any]) -> str:
    with _builder(lenet()).build() as w:
        start = time.monotonic()
        w.fit(train)
        seconds = time.monotonic() - start
        placement = str(w.placement)
        accuracy = _accuracy(w, test)
    assert DEVICE in placement and accuracy > 0.9, (placement, accuracy)
    return f"{placement}; test accuracy {accuracy:.4f} after {len(train)} batches in {seconds:.1f} s"


def two_share_one_gpu(train: list[Any], test: list[Any]) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapper = _builder(lenet(), workers=2).build()
    with wrapper as w:
        w.fit(train)
        placement, accuracy = str(w.placement), _accuracy(w, test)
    said = [str(c.message)[:120] for c in caught]
    assert "gloo" in placement and accuracy > 0.9, (placement, accuracy)
    return f"{placement}; warned {said}; test accuracy {accuracy:.4f}"


def channels_last(train: list[Any], test: list[Any]) -> str:
    batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in train[:30]]
    model = FormatProbe().to(memory_format=torch.channels_last)
    with _builder(model).build() as w:
        w.fit(batches)
    seen = model.seen.tolist()  # type: ignore[operator]
    assert seen[0] == seen[1] > 0, seen
    return f"{int(seen[0])} of {int(seen[1])} inputs channels_last in the worker's forward"


def precisions(train: list[Any], test: list[Any]) -> str:
    found = {}
    for precision in ("bf16-mixed", "16-mixed"):
        with _builder(lenet()).precision(precision).build() as w:
            w.fit(train[:200])
            found[precision] = _accuracy(w, test)
    assert min(found.values()) > 0.85, found
    return ", ".join(f"{p}: test accuracy {a:.4f}" for p, a in found.items())


def resume_on_cuda(train: list[Any], test: list[Any]) -> str:
    def run(directory: str, epochs: int, resume: str | None = None) -> list[torch.Tensor]:
        with _builder(lenet()).deterministic(True).checkpoint(directory, every=10).build() as w:
            w.fit(train[:60], epochs=epochs, resume=resume)
            return [p.detach().cpu() for p in w.model.parameters()]

    with tempfile.TemporaryDirectory() as directory:
        whole = run(directory + "/whole", 2)
        run(directory + "/cut", 1)
        resumed = run(directory + "/cut", 2, resume=directory + "/cut")
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))
    return f"a run resumed from a checkpoint written on {DEVICE} ends bitwise as the uninterrupted one"


def inference(train: list[Any], test: list[Any]) -> str:
    with _builder(lenet()).build() as w:
        w.fit(train[:200])
        model = w.model
    with ParallelInference.builder(model).workers(1).devices([DEVICE]).inference_mode(InferenceMode.BATCHED).build() as server:
        x, y = test[0]
        out = server.output(x)
    accuracy = float((out.argmax(1) == y).float().mean())
    assert accuracy > 0.85, accuracy
    return f"ParallelInference on cuda:0: accuracy {accuracy:.4f} on {len(y)} test images"


CHECKS: dict[str, Callable[[list[Any], list[Any]], str]] = {
    "one worker on cuda:0 (NCCL)": one_worker,
    "two workers sharing cuda:0 (gloo)": two_share_one_gpu,
    "channels_last reaches the worker": channels_last,
    "bf16-mixed and 16-mixed": precisions,
    "checkpoint resume on cuda": resume_on_cuda,
    "ParallelInference on cuda": inference,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", default="benchmarks/results/gpu_checks.json")
    parser.add_argument("--device", default=DEVICE, help="cuda:0; cpu only to try this script where there is no GPU")
    parser.add_argument("--batches", type=int, default=469, help="training batches of 128 (469: one epoch)")
    args = parser.parse_args()
    globals()["DEVICE"] = args.device
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("torch sees no CUDA device on this machine")
    train = mnist_batches(args.data_dir)[: args.batches]
    test = mnist_batches(args.data_dir, split="test", batch=1000)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    results: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "gpu": gpu, "batches": len(train)}
    failed = 0
    for name, check in CHECKS.items():
        try:
            line, ok = check(train, test), True
        except Exception as e:  # noqa: BLE001 - every check reports, whatever failed
            line, ok = f"{type(e).__name__}: {str(e)[:300]} | {traceback.format_exc(limit=-3)[-600:]}", False
        failed += not ok
        results[name] = {"ok": ok, "saw": line}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {line}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
