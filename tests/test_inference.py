"""ParallelInference: answers equal to the model's own, in every mode, from concurrent callers;
update_model with nothing lost; a wrong shape, a killed worker, back-pressure and close with
requests pending; no process, thread or shared-memory segment left; `pw-fit predict`.

LeNet on the real MNIST test images; real spawned workers (1 or 2, CPU). A gated model holds
its forward pass while a file exists, so that a request is in flight exactly when a test needs it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parallelwrapper import ParallelWrapper
from parallelwrapper.app import cli
from parallelwrapper.app.mnist import load_mnist
from parallelwrapper.app.models import LeNet
from parallelwrapper.inference import (
    InferenceBuilder,
    InferenceError,
    InferenceMode,
    ParallelInference,
)
from parallelwrapper.inference.pool import DEPTH

WAIT_S = 60.0  # the longest any test waits for an answer: a worker started again imports torch first


class Gated(nn.Module):
    """x times a parameter (2); while the file `gate` exists, each forward pass first leaves a
    `started-*` file beside it, then waits for the gate to go."""

    def __init__(self, gate: Path) -> None:
        super().__init__()
        self.gate = str(gate)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.path.exists(self.gate):
            Path(self.gate).with_name(f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
            while os.path.exists(self.gate):
                time.sleep(0.01)
        return x * self.scale


@pytest.fixture(scope="module")
def images(mnist_dir: Path) -> torch.Tensor:
    ((x, _),) = load_mnist(mnist_dir, "test", download=False).batches(64)[:1]
    return x  # (64, 1, 28, 28)


def lenet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return LeNet().eval()


def expected(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model(x)
    return out


def started(gate: Path, n: int) -> None:
    """Wait until `n` forward passes are held at the gate."""
    deadline = time.monotonic() + WAIT_S
    while len(list(gate.parent.glob("started-*"))) < n:
        assert time.monotonic() < deadline, f"{n} forward passes did not start"
        time.sleep(0.02)


def nothing_left(served: ParallelInference, segments: list[str]) -> None:
    assert segments and not [s for s in segments if Path("/dev/shm", s).exists()], "shared memory left"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("parallelwrapper-inference")]
    with pytest.raises(InferenceError, match="closed"):
        served.output(torch.zeros(1, 1, 28, 28))


def callers(served: ParallelInference, images: torch.Tensor, threads: int = 4) -> list[tuple[torch.Tensor, Future[torch.Tensor]]]:
    """Each of `threads` callers sends single images and small batches of `images` at once; the inputs and futures."""
    sent: list[tuple[torch.Tensor, Future[torch.Tensor]]] = []
    lock = threading.Lock()

    def call(t: int) -> None:
        for i in range(t, len(images) - 3, threads):
            x = images[i] if i % 2 else images[i : i + 1 + i % 4]  # one sample, or a batch of 1 to 4
            f = served.submit(x)
            with lock:
                sent.append((x, f))

    workers = [threading.Thread(target=call, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sent


@pytest.mark.parametrize(
    "mode", [InferenceMode.BATCHED, InferenceMode.SEQUENTIAL, pytest.param(InferenceMode.INPLACE, marks=pytest.mark.fast)]
)
def test_answers_equal_the_model_from_concurrent_callers_and_update_model_loses_nothing(mode: InferenceMode, images: torch.Tensor) -> None:
    old, new = lenet(0), lenet(1)
    served = ParallelInference.builder(old).workers(2).devices(["cpu", "cpu"]).inference_mode(mode).input_shape(1, 28, 28).build()
    with served:
        sent = callers(served, images)
        for x, f in sent:
            want = expected(old, x if x.dim() == 4 else x[None])
            got = f.result(timeout=WAIT_S)
            assert got.shape == (want if x.dim() == 4 else want[0]).shape
            torch.testing.assert_close(got, want if x.dim() == 4 else want[0], atol=1e-6, rtol=0)
        assert served.output(images[:5]).shape == (5, 10)

        # Requests sent while the weights change: each answered, by the old weights or the new.
        before = [served.submit(images[i]) for i in range(16)]
        served.update_model(new)
        after = [served.submit(images[i]) for i in range(16)]
        for i, f in enumerate(before):
            got = f.result(timeout=WAIT_S)
            assert any(torch.allclose(got, expected(m, images[i : i + 1])[0], atol=1e-6, rtol=0) for m in (old, new))
        for i, f in enumerate(after):
            torch.testing.assert_close(f.result(timeout=WAIT_S), expected(new, images[i : i + 1])[0], atol=1e-6, rtol=0)
        served.update_model(old.state_dict())
        torch.testing.assert_close(served.output(images[0]), expected(old, images[:1])[0], atol=1e-6, rtol=0)
        with pytest.raises(ValueError, match=r"missing conv1.weight.*same architecture"):
            served.update_model({"fc2.bias": torch.zeros(10)})


def test_a_wrong_shape_fails_only_its_own_request(images: torch.Tensor) -> None:
    model = lenet(0)
    wrapper = ParallelWrapper.builder(model).workers(1).build()  # from_wrapper serves its model on its device
    with wrapper, ParallelInference.from_wrapper(wrapper) as served:
        good = [served.submit(images[i : i + 2]) for i in range(8)]
        bad = served.submit(torch.zeros(3, 2, 28, 28))
        more = [served.submit(images[i : i + 2]) for i in range(8)]
        with pytest.raises(InferenceError, match=r"shape float32\[3, 2, 28, 28\] in inference worker 0: RuntimeError"):
            bad.result(timeout=WAIT_S)
        for i, f in enumerate(good + more):
            torch.testing.assert_close(f.result(timeout=WAIT_S), expected(model, images[i % 8 : i % 8 + 2]), atol=1e-6, rtol=0)
    inplace = ParallelInference.builder(model).inference_mode("inplace").input_shape(1, 28, 28).build()
    with inplace, pytest.raises(ValueError, match=r"input of shape \[28, 28\] is neither one sample \[1, 28, 28\] nor a batch"):
        inplace.output(images[0, 0])


def test_a_killed_worker_fails_only_its_requests_and_is_started_again(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    served = ParallelInference.builder(Gated(gate)).workers(2).devices(["cpu", "cpu"]).inference_mode(InferenceMode.SEQUENTIAL).build()
    with served:
        x = [torch.full((1, 3), float(i)) for i in range(6)]
        held = [served.submit(x[0]), served.submit(x[1])]  # one on each worker
        started(gate, 2)
        queued = served.submit(x[2])
        victim = served.worker_pids[0]
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while not any(f.done() for f in held):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        lost = [f for f in held if f.done()]
        assert len(lost) == 1
        with pytest.raises(InferenceError, match=r"inference worker 0 died: the process was killed by SIGKILL.*submit them again"):
            lost[0].result()
        gate.unlink()
        survivor = held[1 - held.index(lost[0])]
        i = held.index(survivor)
        torch.testing.assert_close(survivor.result(timeout=WAIT_S), 2 * x[i])
        torch.testing.assert_close(queued.result(timeout=WAIT_S), 2 * x[2])
        while served.worker_pids[0] in (victim, None):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        later = [served.submit(t) for t in x[3:]]
        for t, f in zip(x[3:], later):
            torch.testing.assert_close(f.result(timeout=WAIT_S), 2 * t)


def test_a_full_queue_blocks_callers_and_close_fails_what_is_pending(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    served = ParallelInference.builder(Gated(gate)).workers(1).inference_mode(InferenceMode.SEQUENTIAL).queue_limit(2).build()
    x = [torch.full((1, 3), float(i)) for i in range(DEPTH + 4)]
    futures: list[Future[torch.Tensor]] = []

    def send() -> None:
        for t in x:
            futures.append(served.submit(t))

    sender = threading.Thread(target=send)
    sender.start()
    started(gate, 1)
    time.sleep(0.5)
    assert len(futures) == DEPTH + 2 and sender.is_alive()  # DEPTH held by the worker, two waiting: the next one blocks its caller
    gate.unlink()
    sender.join(timeout=WAIT_S)
    for t, f in zip(x, futures):  # back-pressure drops nothing
        torch.testing.assert_close(f.result(timeout=WAIT_S), 2 * t)

    gate.touch()
    for f in gate.parent.glob("started-*"):
        f.unlink()
    running = served.submit(x[0])
    started(gate, 1)
    waiting = [served.submit(t) for t in x[1:4]]  # the first in the worker's pipe, the others in the queue
    segments = served._engine.pool.segment_names  # type: ignore[union-attr]
    served.close(timeout=0.5)
    with pytest.raises(InferenceError, match="closed with this request waiting for a worker: it got no answer"):
        waiting[-1].result(timeout=0)
    with pytest.raises(InferenceError, match="closed with this request held by inference worker 0"):
        running.result(timeout=0)
    nothing_left(served, segments)
    gate.unlink()


def test_pw_fit_predict_scores_a_saved_model(tmp_path: Path, mnist_dir: Path) -> None:
    model = lenet(0)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    ((x, y),) = load_mnist(mnist_dir, "test", download=False).batches(10_000)
    accuracy = (expected(model, x[:300]).argmax(1) == y[:300]).float().mean().item()
    args = ["predict", "--model-path", str(tmp_path / "model.pt"), "--data-dir", str(mnist_dir), "--test-samples", "300", "--workers", "2"]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    assert f"test accuracy {accuracy:.4f} on 300 MNIST test images" in result.output
    assert "samples/s (300 requests in" in result.output
    wrong = CliRunner().invoke(cli.main, [*args, "--model", "mlp"])
    assert wrong.exit_code == 1 and "does not fit --model mlp" in wrong.output and "Traceback" not in wrong.output


@pytest.mark.fast
@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda b: b.batch_limit(0), r"batch_limit must be an int >= 1, got 0"),
        (lambda b: b.queue_limit(-1), r"queue_limit must be an int >= 1"),
        (lambda b: b.max_wait_ms(-2), r"max_wait_ms must be a number >= 0, got -2"),
        (lambda b: b.workers(2).devices(["cpu"]), r"devices names 1 devices for 2 workers"),
        (lambda b: b.devices(["cuda:7"]), r"devices: cuda:7 does not exist"),
        (lambda b: b.inference_mode("fast"), r"mode must be one of \['batched', 'sequential', 'inplace'\]"),
    ],
)
def test_build_refuses_bad_options_naming_them(setup: Callable[[InferenceBuilder], InferenceBuilder], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        setup(ParallelInference.builder(LeNet())).build()


@pytest.fixture(autouse=True)
def _no_stray_threads() -> Iterator[None]:
    yield
    assert not [t.name for t in threading.enumerate() if t.name.startswith("parallelwrapper-inference")]
