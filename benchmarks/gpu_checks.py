"""The checks that need a GPU, for the day one is lent: the CUDA paths that the CPU machines test
only with a faked GPU count, each run for real on `cuda:0`, each a short fit on MNIST.

    python -m benchmarks gpu_checks --data-dir DIR [--out benchmarks/results/gpu_checks.json]

Each check prints one line, PASS or FAIL and what it saw; the exit code is the number that
failed. With one GPU, one worker has it alone (an NCCL group of one) and two workers share it
(gloo, with the warning that says so). The checks of the levers (the autopilot, coded payloads,
overlap, DES-LOC) train on at most NEW_BATCHES batches; where two workers train, each saves the
replica it holds at the epoch's end (from a validation step, which every worker runs on the
landed average), and the two must be bitwise equal and the model that fit() returns.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import DEFAULT_DATA_DIR, LR, MOMENTUM, lenet, mnist_batches
from parallelwrapper import InferenceMode, ParallelInference, ParallelWrapper, TrainingMode

DEVICE = "cuda:0"  # --device: "cpu" tries the script itself on a machine without a GPU
NEW_BATCHES = 300  # at most, for each check of a lever
DATA_DIR = ""  # --data-dir, for the checks that run pw-fit
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: torchrun's script
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}  # DiLoCo's outer SGD, as the retired benchmarks/overlap_outer.py


class FormatProbe(nn.Module):
    """LeNet that counts the inputs its forward sees in channels_last, and all inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = lenet()
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += torch.tensor([float(x.is_contiguous(memory_format=torch.channels_last)), 1.0], device=x.device)
        return self.net(x)  # type: ignore[no-any-return]


class SaveReplica:
    """A validation step that saves the model this worker holds, on the CPU (not in the main
    process, which tries the step on a batch before training)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        if dist.is_initialized():
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, f"{self.directory}/{dist.get_rank()}.pt")
        return {"val_loss": float(nn.functional.cross_entropy(model(batch[0]), batch[1]))}


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


def _two_workers(configure: Callable[[Any], Any], train: list[Any], test: list[Any]) -> tuple[float, Any, str]:
    """Two workers sharing DEVICE fit train[:NEW_BATCHES] with `configure(builder)`: the test
    accuracy, the history, and the replicas' bitwise agreement (asserted), in words."""
    with tempfile.TemporaryDirectory() as directory:
        builder = configure(_builder(lenet(), workers=2)).validation(test[:2], every=None, step=SaveReplica(directory))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*share 1 GPUs")
            wrapper = builder.build()
        with wrapper as w:
            history = w.fit(train[:NEW_BATCHES])
            final = {k: v.detach().cpu() for k, v in w.model.state_dict().items()}
            placement, accuracy = str(w.placement), _accuracy(w, test)
        replicas = [torch.load(f"{directory}/{rank}.pt") for rank in (0, 1)]
    assert "gloo" in placement, placement
    for key, value in final.items():
        assert torch.equal(replicas[0][key], replicas[1][key]), f"{key}: the replicas differ by {float((replicas[0][key] - replicas[1][key]).abs().max()):.2e}"
        assert torch.equal(replicas[0][key], value), f"{key}: fit() returned a model apart from the replicas"
    return accuracy, history, "both replicas bitwise the returned model"


def _in_force(history: Any) -> str:
    last = history.scores[-1]
    return f"k {last.k}, {last.payload}, state every {last.updaters_every}, overlap {last.overlap}"


def _each(contenders: dict[str, Callable[[], str]]) -> str:
    """Every contender's line, each run even after one failed; an AssertionError with them all if one did."""
    lines, failed = [], False
    for name, contender in contenders.items():
        try:
            lines.append(f"{name}: {contender()}")
        except Exception as e:  # noqa: BLE001 - each contender reports, whatever failed
            failed, said = True, " ".join(str(e).split("\n\n")[0].split())
            lines.append(f"{name}: FAILED {type(e).__name__}: {said[:300]}")
    if failed:
        raise AssertionError("; ".join(lines))
    return "; ".join(lines)


def autopilot_one(train: list[Any], test: list[Any]) -> str:
    """averaging_frequency("auto"), one worker alone on DEVICE (an NCCL group of one on a GPU)."""
    with _builder(lenet()).averaging_frequency("auto").build() as w:
        history = w.fit(train[:NEW_BATCHES])
        placement, accuracy = str(w.placement), _accuracy(w, test)
    last = history.scores[-1]
    assert last.k > 0 and last.payload and accuracy > 0.9, (placement, last.k, last.payload, accuracy)
    changes = sum(1 for s in history.scores if s.why)
    return f"{placement.split(',')[0]}; {len(history.scores)} rounds, last {_in_force(history)}, {changes} changes; test accuracy {accuracy:.4f}"


def autopilot_two(train: list[Any], test: list[Any]) -> str:
    """averaging_frequency("auto"), two workers sharing DEVICE (gloo)."""
    accuracy, history, agree = _two_workers(lambda b: b.averaging_frequency("auto"), train, test)
    last = history.scores[-1]
    assert last.k > 0 and last.payload and accuracy > 0.9, (last.k, last.payload, accuracy)
    changes = sum(1 for s in history.scores if s.why)
    return f"{len(history.scores)} rounds, last {_in_force(history)}, {changes} changes; test accuracy {accuracy:.4f}, {agree}"


def _coded(configure: Callable[[Any], Any], payload: str, train: list[Any], test: list[Any]) -> str:
    accuracy, history, agree = _two_workers(configure, train, test)
    sent = history.scores[-1].payload
    assert sent == payload and accuracy > 0.9, (sent, accuracy)
    return f"{accuracy:.4f}, {agree}"


def payloads(train: list[Any], test: list[Any]) -> str:
    """payload_dtype int8 and int4 on CUDA tensors, the parameters alone and with the optimizer's state."""
    contenders: dict[str, Callable[[], str]] = {}
    for payload in ("int8", "int4"):
        for state in (False, True):
            configure = functools.partial(lambda b, p, s: b.payload_dtype(p).average_updaters(s), p=payload, s=state)
            contenders[f"{payload} {'with state' if state else 'params only'}"] = functools.partial(_coded, configure, payload, train, test)
    return _each(contenders)


def _overlapped(configure: Callable[[Any], Any], train: list[Any], test: list[Any]) -> str:
    accuracy, history, agree = _two_workers(configure, train, test)
    overlapped = sum(1 for s in history.scores if s.overlap)
    assert overlapped > 0 and accuracy > 0.9, (overlapped, accuracy)
    return f"{overlapped} of {len(history.scores)} rounds overlapped, {_in_force(history)}; {accuracy:.4f}, {agree}"


def overlap(train: list[Any], test: list[Any]) -> str:
    """overlap_averaging(True): int8 with the parameters alone (k = 3), and float32 with DiLoCo's outer step (k = 16)."""
    int8 = lambda b: b.overlap_averaging(True).payload_dtype("int8").average_updaters(False)  # noqa: E731
    outer = lambda b: b.overlap_averaging(True).averaging_frequency(16).outer_optimizer(torch.optim.SGD, **OUTER)  # noqa: E731
    return _each({
        "int8, params only": functools.partial(_overlapped, int8, train, test),
        "outer SGD, k 16": functools.partial(_overlapped, outer, train, test),
    })  # fmt: skip


def des_loc(train: list[Any], test: list[Any]) -> str:
    """average_updaters(every=4): the momentum travels every 4th round and at the epoch's end."""
    accuracy, history, agree = _two_workers(lambda b: b.average_updaters(every=4), train, test)
    every = history.scores[-1].updaters_every
    assert every == 4 and accuracy > 0.9, (every, accuracy)
    return f"{len(history.scores)} rounds, {_in_force(history)}; {accuracy:.4f}, {agree}"


def threshold(train: list[Any], test: list[Any]) -> str:
    """Threshold-encoded shared gradients (DL4J's): each worker's message goes by sends and receives."""
    configure = lambda b: b.training_mode(TrainingMode.SHARED_GRADIENTS).gradient_encoding(threshold=1e-3)  # noqa: E731
    accuracy, history, agree = _two_workers(configure, train, test)
    assert accuracy > 0.9, accuracy
    return f"{len(history.scores)} scores; {accuracy:.4f}, {agree}"


def pipeline(train: list[Any], test: list[Any]) -> str:
    """One worker of two pipeline stages, both on DEVICE: on a GPU refused at build (they would pass
    activations over gloo, whose sends fail on GPU tensors: 'writev: Bad address' on an H200
    before the refusal); on the CPU it trains."""
    builder = (
        ParallelWrapper.builder(lenet()).optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM, nesterov=True)
        .loss_fn(nn.functional.cross_entropy).workers(1).pipeline(stages=2).devices([DEVICE] * 2).averaging_frequency(3)
    )  # fmt: skip
    if DEVICE.startswith("cuda"):
        try:
            builder.build().close()
        except ValueError as e:
            assert str(e).startswith("pipeline(stages=2): stages on cuda:0, cuda:0 would pass activations over gloo"), e
            return f"refused at build: {str(e)[:140]}..."
        raise AssertionError("two stages sharing a GPU were not refused")
    with builder.build() as w:
        w.fit(train[:NEW_BATCHES])
        placement, accuracy = str(w.placement), _accuracy(w, test)
    assert accuracy > 0.9, (placement, accuracy)
    return f"{placement}; test accuracy {accuracy:.4f}"


def _run(args: list[str], timeout: float = 240) -> str:
    """Run a command with this Python and the repository on its path; its output, asserting rc 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, f"rc {done.returncode}: {(done.stdout + done.stderr)[-800:]}"
    return done.stdout


def cli(train: list[Any], test: list[Any]) -> str:
    """pw-fit, the main job: 2 workers sharing DEVICE with the autopilot, one epoch."""
    device = "cuda" if DEVICE.startswith("cuda") else "cpu"
    with tempfile.TemporaryDirectory() as out:
        shown = _run(["-c", "from parallelwrapper.app.cli import main; main()", "--device", device, "--workers", "2", "--epochs", "1",
                      "--averaging-frequency", "auto", "--data-dir", DATA_DIR, "--out", out])  # fmt: skip
        with open(f"{out}/summary.json") as f:
            summary = json.load(f)
    accuracy = summary["test_accuracy"]
    assert accuracy > 0.97, summary
    return f"{shown.splitlines()[0][:90]}; test accuracy {accuracy:.4f}, {summary['train_samples_per_second']:,.0f} samples/s, {len(summary['autopilot_changes'])} autopilot changes"


def torchrun(train: list[Any], test: list[Any]) -> str:
    """tests/scripts/torchrun_train.py under torchrun, 1 process (NCCL on a GPU) and 2 sharing DEVICE."""
    lines = []
    for n in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "tests/scripts/torchrun_train.py", out])
            with open(f"{out}/history.json") as f:
                history = json.load(f)
            states = [torch.load(f"{out}/rank{r}.pt") for r in range(n)]
        assert all(torch.equal(v, states[0]["model"][k]) for st in states for k, v in st["model"].items()), "ranks ended apart"
        lines.append(f"{n} process{'es' if n > 1 else ''}: {history['scores']} scores, samples {history['samples']}")
    return "; ".join(lines) + ", ranks equal"


CHECKS: dict[str, Callable[[list[Any], list[Any]], str]] = {
    "one worker on cuda:0 (NCCL)": one_worker,
    "two workers sharing cuda:0 (gloo)": two_share_one_gpu,
    "channels_last reaches the worker": channels_last,
    "bf16-mixed and 16-mixed": precisions,
    "checkpoint resume on cuda": resume_on_cuda,
    "ParallelInference on cuda": inference,
    "autopilot, 1 worker": autopilot_one,
    "autopilot, 2 workers": autopilot_two,
    "int8 and int4 payloads": payloads,
    "overlap: int8, outer": overlap,
    "DES-LOC every=4": des_loc,
    "threshold-encoded gradients": threshold,
    "pipeline, 2 stages on one device": pipeline,
    "pw-fit, 2 workers, auto": cli,
    "torchrun, 1 and 2 processes": torchrun,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/gpu_checks.json")
    parser.add_argument("--device", default=DEVICE, help="cuda:0; cpu only to try this script where there is no GPU")
    parser.add_argument("--batches", type=int, default=469, help="training batches of 128 (469: one epoch)")
    parser.add_argument("--only", help="run only the checks whose names contain this")
    args = parser.parse_args(argv)
    globals()["DEVICE"], globals()["DATA_DIR"] = args.device, args.data_dir
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("torch sees no CUDA device on this machine")
    train = mnist_batches(args.data_dir)[: args.batches]
    test = mnist_batches(args.data_dir, split="test", batch=1000)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    results: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "gpu": gpu, "batches": len(train)}
    failed = 0
    for name, check in CHECKS.items():
        if args.only and args.only not in name:
            continue
        try:
            line, ok = check(train, test), True
        except Exception as e:  # noqa: BLE001 - every check reports, whatever failed
            line, ok = f"{type(e).__name__}: {str(e)[:1600]} | {traceback.format_exc(limit=-3)[-600:]}", False
        failed += not ok
        results[name] = {"ok": ok, "saw": line}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {line}", flush=True)
        with open(args.out, "w") as f:  # after each check: a run cut short keeps what it saw
            json.dump(results, f, indent=2)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
