"""The fault matrix: every fault gives a clear error within seconds, names the worker, leaves no
process behind (the conftest hygiene fixture checks), and loses nothing; checkpoints resume
exactly. Real processes, real gloo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parallelwrapper import NanPolicy, ParallelWrapper, TrainingMode, WorkerError
from parallelwrapper.checkpoint import FILENAME, CheckpointError, save
from parallelwrapper.feed.data import FeedError

pytestmark = pytest.mark.timeout(120)
SCRIPTS = Path(__file__).parent / "scripts"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def make_batches(n: int, size: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 10, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def builder(model: nn.Module | None = None, workers: int = 2) -> Any:
    return ParallelWrapper.builder(model or mlp()).workers(workers).threads_per_worker(1).deterministic(True)


# -- training steps that fail on batches whose targets are marked (module level: they travel) ------

MARK = 7  # a label value the model never sees in good batches (3 classes)


def marked(batch: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return int(batch[1][0]) == MARK


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


def failing_backward_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = model(x)
    if marked(batch):
        out = _FailingBackward.apply(out)
    return nn.functional.cross_entropy(out, y.clamp(max=2))


def killed_step(model: nn.Module, batch: Any) -> torch.Tensor:
    if marked(batch):
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def stalling_step(model: nn.Module, batch: Any) -> torch.Tensor:
    if marked(batch):
        time.sleep(600)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def nan_step(model: nn.Module, batch: Any) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(batch[0]), batch[1].clamp(max=2))
    return loss * float("nan") if marked(batch) else loss


def mark(data: list[Any], *indices: int) -> list[Any]:
    data = list(data)
    for i in indices:
        data[i] = (data[i][0], torch.full_like(data[i][1], MARK))
    return data


def fails_fast(w: Any, data: Any, limit_s: float = 30.0) -> WorkerError:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        w.fit(data)
    assert time.monotonic() - start < limit_s
    w.close()
    return info.value


# -- 1-3: a worker raises, is killed, stalls --------------------------------------------------------


def test_raise_in_backward_names_rank_step_and_traceback() -> None:
    # Deterministic feed: batch 9 goes to worker 1, as its 5th batch (local step 4).
    error = fails_fast(builder().training_step(failing_backward_step).build(), mark(make_batches(20), 9))
    assert error.rank == 1
    text = str(error)
    assert "boom in backward" in text and "Traceback" in text
    assert "batch 9 of epoch 0" in text and "local step 4" in text


FLAKY_SCRIPT = """
import torch
from torch import nn
from parallelwrapper import ParallelWrapper


class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x[0, 0]) == 7.0:
            raise ValueError("this batch is bad: first feature is 7")
        return self.net(x)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(20)]
    data[9][0][0, 0] = 7.0
    with ParallelWrapper.builder(Flaky()).workers({workers}).threads_per_worker(1).deterministic(True).build() as wrapper:
        wrapper.fit(data)


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize(("workers", "step"), [(2, 4), (1, 9)], ids=["spawned", "in-process"])
def test_a_worker_error_on_screen_says_what_happened_first_and_shows_one_traceback(tmp_path: Path, workers: int, step: int) -> None:
    # What a user sees who runs `python script.py` and whose model raises on batch 9 (worker 1's
    # 5th batch when two deal them): the main process's frames, then the worker, the batch, the
    # exception's type and message on one line, a peer's echo on one line at most, and the worker's
    # traceback once, ending with the exception as any Python traceback does.
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY_SCRIPT.format(workers=workers))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.rstrip().splitlines()
    error = next(i for i, line in enumerate(lines) if not line.startswith(("Traceback (most recent call last):", "  ")))
    assert lines[error] == (
        f"parallelwrapper.errors.WorkerError: worker {workers - 1} failed while training on batch 9 of epoch 0 "
        f"(float32[16, 10], int64[16]) (local step {step}): ValueError: this batch is bad: first feature is 7"
    ), result.stderr
    echoes = [line for line in lines if line.startswith("(also ")]
    assert len(echoes) <= workers - 1 and lines[error + 1 : error + 1 + len(echoes)] == echoes
    assert lines[error + 1 + len(echoes) :][:2] == ["", f"Traceback in worker {workers - 1} (most recent call last):"]
    assert result.stderr.count('raise ValueError("this batch is bad: first feature is 7")') == 1, "the worker's traceback, once"
    assert result.stderr.count("(most recent call last)") == 2  # the main process's frames and the worker's
    assert "direct cause" not in result.stderr and "During handling" not in result.stderr
    assert lines[-1] == "ValueError: this batch is bad: first feature is 7"
    assert "tensor(" not in result.stderr


def test_killed_worker_is_named_without_waiting_for_a_collective_timeout() -> None:
    w = builder().training_step(killed_step).stall_timeout(120).build()
    error = fails_fast(w, mark(make_batches(20), 9), limit_s=20)
    assert error.rank == 1 and "SIGKILL" in str(error)


@pytest.mark.fast
def test_a_process_killed_by_a_signal_is_said_with_what_that_signal_usually_means() -> None:
    """SIGKILL is what the OOM killer sends; SIGABRT is a library's C++ error (gloo's, on a GPU
    tensor it cannot send), which was reported as '(out of memory?)' too."""
    from parallelwrapper.processes import exit_message

    assert exit_message(-signal.SIGKILL, "training") == "the process was killed by SIGKILL while training (out of memory? the kernel's OOM killer sends SIGKILL)"
    assert "out of memory" not in exit_message(-signal.SIGABRT, "") and "C++ error" in exit_message(-signal.SIGABRT, "")
    assert exit_message(-signal.SIGTERM, "") == "the process was killed by SIGTERM"
    assert exit_message(3, "") == "the process exited with code 3"


def test_stalled_worker_is_named_with_where_it_is() -> None:
    w = builder().training_step(stalling_step).stall_timeout(3).build()
    error = fails_fast(w, mark(make_batches(20), 9), limit_s=25)
    assert error.rank == 1
    assert "stalled: no progress for" in str(error) and "training on batch 9 of epoch 0" in str(error)


# -- 4: Ctrl-C ------------------------------------------------------------------------------------


def children_of(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def interruptible() -> None:
    """In a child about to start: Ctrl-C as a terminal gives it (a shell's background job, as a
    suite may run, ignores SIGINT, and a process inherits that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("workers", [2, 1], ids=["spawned", "in-process"])
def test_ctrl_c_stops_every_worker_and_saves_the_last_round(tmp_path: Path, workers: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "interrupt_train.py"), str(tmp_path), str(workers)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=interruptible,  # a suite run as a background job ignores SIGINT, and so would the script
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("SCORE 3"):
                break
        children = children_of(proc.pid)
        assert len(children) >= 2 if workers > 1 else not children  # one worker: this process
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        assert time.monotonic() - start < 20
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in stderr
    deadline = time.monotonic() + 5  # multiprocessing's resource tracker exits just after its parent
    while (alive := [pid for pid in children if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in alive]
    saved = torch.load(tmp_path / FILENAME, weights_only=False)
    assert saved["counters"]["rounds"] >= 3 and saved["counters"]["epoch"] == 0
    assert saved["counters"]["position"] == saved["counters"]["iterations"]


def test_a_main_process_killed_as_its_workers_start_leaves_no_worker_behind(tmp_path: Path) -> None:
    """SIGKILL the main process (nothing of it runs after: no finally, no atexit) as its workers
    start, connecting to a store that goes with it: every worker, and the forkserver, end within
    seconds, where a worker waited out the store's timeout (5.5 minutes seen)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "interrupt_train.py"), str(tmp_path), "2"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline:  # the forkserver's children
            workers = {w for server in children_of(proc.pid) for w in children_of(server)}
            time.sleep(0.02)
        family = children_of(proc.pid) | {w for server in children_of(proc.pid) for w in children_of(server)}
        assert len(workers) == 2, family
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in family if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in alive]


def paced_step(model: nn.Module, batch: Any) -> torch.Tensor:
    time.sleep(0.01)  # a few rounds to each message of reports (rank 0 sends them every 0.25 s)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


class Ear:
    """A listener that writes down the rounds it hears; at round `press` it raises
    KeyboardInterrupt, as a listener that stops the fit does."""

    def __init__(self, press: int | None = None) -> None:
        self.press, self.heard = press, list[int]()

    def on_score(self, score: Any) -> None:
        self.heard.append(score.round)
        if score.round == self.press:
            raise KeyboardInterrupt


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [2, 1], ids=["spawned", "in-process"])
def test_ctrl_c_in_a_listener_loses_no_report_and_stops_as_ctrl_c_does(tmp_path: Path, workers: int) -> None:
    """A listener's KeyboardInterrupt is a Ctrl-C: the reports that came with it still reach every
    listener (the spawned workers' come several rounds to a message), the round in flight lands
    and is saved, and fit() raises KeyboardInterrupt."""
    presser, ear = Ear(press=3), Ear()
    builder_ = builder(workers=workers).averaging_frequency(1).training_step(paced_step)
    w = builder_.checkpoint(tmp_path, every=10_000).listeners(presser, ear).build()
    with w, pytest.raises(KeyboardInterrupt):
        w.fit(make_batches(200))
    saved = torch.load(tmp_path / FILENAME, weights_only=False)["counters"]["rounds"]
    assert presser.heard == ear.heard == list(range(1, saved + 1))  # every round to the stop, by both
    assert saved < 200 // workers  # stopped, not at the epoch's end
    if workers == 1:  # reports come one by one: the stop lands in the round after the press's
        assert saved == 4


# -- 5: NaN ---------------------------------------------------------------------------------------


def test_nan_loss_raises_by_default() -> None:
    error = fails_fast(builder().training_step(nan_step).build(), mark(make_batches(20), 9))
    assert error.rank == 1 and "loss is nan at local step 4" in str(error) and "nan_policy" in str(error)


@pytest.mark.parametrize("overlap", [False, True])
def test_nan_loss_skip_drops_that_workers_round(overlap: bool) -> None:
    model = mlp()
    w = builder(model).training_step(nan_step).nan_policy(NanPolicy.SKIP).averaging_frequency(2).overlap_averaging(overlap).build()
    with w:
        history = w.fit(mark(make_batches(20), 9))
    skipped = [s for s in history.scores if s.skipped]
    assert len(skipped) == 1 and skipped[0].skipped == 1
    # Worker 1's round with batch 9 was batches 9 and 11: consumed, but their samples not counted.
    assert history.epochs[0].iteration == 20 and history.epochs[0].samples == 18 * 16
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- 6: malformed batches -------------------------------------------------------------------------


def test_malformed_batch_is_named() -> None:
    data = make_batches(12)
    data[5] = (torch.randn(16, 7), data[5][1])  # wrong feature size
    error = fails_fast(builder().build(), data)
    assert error.rank == 1
    lines = str(error).splitlines()
    assert lines[0] == (  # who, where and why, before the traceback
        "worker 1 failed while training on batch 5 of epoch 0 (float32[16, 7], int64[16]) (local step 2): "
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x7 and 10x16)"
    )
    # A peer that lost its averaging with worker 1 adds one line at most; no tensor is printed.
    echoes = [line for line in lines if line.startswith("(also worker")]
    assert all(line.startswith("(also worker 0: ") and line.endswith(")") for line in echoes) and len(echoes) <= 1
    assert "tensor(" not in str(error)

    data = make_batches(12)
    data[4] = ("not", "tensors")  # type: ignore[call-overload]
    error = fails_fast(builder().build(), data)
    assert error.rank == 0 and "batch 4 of epoch 0 (str, str)" in str(error) and "holds no tensor" in str(error)


# -- 7-8: bad data from the caller ------------------------------------------------------------------


@pytest.mark.parametrize("workers", [2, 1], ids=["spawned", "in-process"])
def test_data_that_raises_mid_epoch_reaches_the_caller_and_the_wrapper_recovers(workers: int) -> None:
    good = make_batches(6)

    def broken() -> Iterator[Any]:
        yield from good[:5]
        raise OSError("disk went away")

    model = mlp()
    w = builder(model, workers).build()
    with w:
        with pytest.raises(FeedError, match=r"raised in epoch 0 after 5 batches: OSError\('disk went away'\)"):
            w.fit(broken)
        assert w._pool is None  # stopped
        with pytest.raises(FeedError, match="yielded no batches in epoch 0"):
            w.fit(lambda: iter([]))
        history = w.fit(good)  # fresh workers
    assert history.epochs[0].samples == 6 * 16


# -- checkpoints ----------------------------------------------------------------------------------


def checkpointed(model: nn.Module, directory: Path, mode: TrainingMode | str, workers: int = 2) -> Any:
    """`mode` "overlap": AVERAGING with overlap_averaging. Dealt deterministically: with k = 2,
    which two batches a worker trains in a round changes its Adam state, and first-come dealing
    pairs them by timing."""
    overlap = mode == "overlap"
    return (
        builder(model, workers).optimizer(torch.optim.Adam, lr=0.01).averaging_frequency(2)
        .training_mode(TrainingMode.AVERAGING if overlap else mode).overlap_averaging(overlap).deterministic(True)
        .checkpoint(directory, every=2)
    )


def state(model: nn.Module, w: Any) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in w.optimizer.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items()})
    return out


@pytest.mark.parametrize("workers", [2, 1], ids=["spawned", "in-process"])
@pytest.mark.parametrize("mode", [*TrainingMode, "overlap"])
def test_interrupted_and_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(
    tmp_path: Path, mode: TrainingMode | str, workers: int
) -> None:
    data = make_batches(22)
    model = mlp()
    with checkpointed(model, tmp_path / "straight", mode, workers).build() as w:
        w.fit(data, epochs=2)
        expected = state(model, w)

    calls = {"n": 0}

    def crashing() -> Iterator[Any]:
        calls["n"] += 1
        for i, batch in enumerate(data):
            if calls["n"] == 2 and i == 15:
                raise OSError("power cut")
            yield batch

    # A short read-ahead, so that the workers are in epoch 1 when the data fails.
    with checkpointed(mlp(), tmp_path / "run", mode, workers).prefetch_buffer(2).build() as w:
        with pytest.raises(FeedError, match="power cut"):
            w.fit(crashing, epochs=2)
    saved = torch.load(tmp_path / "run" / FILENAME, weights_only=False)["counters"]
    assert saved["epoch"] == 1 and 0 < saved["position"] <= 15, saved

    model = mlp()
    with checkpointed(model, tmp_path / "run", mode, workers).build() as w:
        history = w.fit(data, epochs=2, resume=tmp_path / "run")
        resumed = state(model, w)
    assert [e.epoch for e in history.epochs] == [1]
    assert history.epochs[0].samples == 2 * 22 * 16 and w.counters.epoch == 2
    assert resumed.keys() == expected.keys()
    for k in expected:
        assert torch.equal(resumed[k], expected[k]), k


def test_checkpoint_from_another_model_or_config_is_refused(tmp_path: Path) -> None:
    data = make_batches(4)
    with checkpointed(mlp(), tmp_path, TrainingMode.AVERAGING).build() as w:
        w.fit(data)
    other_config = checkpointed(mlp(), tmp_path, TrainingMode.AVERAGING).averaging_frequency(3).build()
    with pytest.raises(CheckpointError, match=r"another model or configuration.*\n  averaging_frequency: checkpoint has 2, this run has 3"):
        other_config.fit(data, epochs=2, resume=tmp_path)
    other_model = checkpointed(nn.Sequential(nn.Linear(10, 3)), tmp_path, TrainingMode.AVERAGING).build()
    with pytest.raises(CheckpointError, match=r"tensors: checkpoint has \[\('0.weight', \[16, 10\]"):
        other_model.fit(data, epochs=2, resume=tmp_path)
    same = checkpointed(mlp(), tmp_path, TrainingMode.AVERAGING).build()
    with pytest.raises(ValueError, match=r"already trained 1 epochs"):
        same.fit(data, epochs=1, resume=tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        same.fit(data, epochs=2, resume=tmp_path / "nowhere")
    for w in (other_config, other_model, same):
        w.close()


def test_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save(tmp_path, {"format": 1, "good": True})

    def torn_write(obj: Any, f: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_write)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, {"format": 1, "good": False})
    monkeypatch.undo()
    assert torch.load(tmp_path / FILENAME, weights_only=False)["good"] is True
    assert [p.name for p in tmp_path.iterdir()] == [FILENAME]  # no temporary file left


def test_script_without_main_guard_fails_fast_with_the_fix(tmp_path: Path) -> None:
    # The model pickles to more than a pipe holds (64 KiB): the worker that fails to start
    # must still exit, not wait for ever to flush its own unread job.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import torch\n"
        "from parallelwrapper import ParallelWrapper\n"
        "w = ParallelWrapper.builder(torch.nn.Linear(256, 256)).workers(2).build()\n"
        "w.fit([(torch.randn(8, 256), torch.randint(0, 2, (8,)))] * 4)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert result.returncode != 0
    assert "WorkerError" in result.stderr and "if __name__ == '__main__':" in result.stderr
