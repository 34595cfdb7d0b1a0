"""A run whose optimizer and schedule are functions of the script being run resumes in a later
process (issue 35): functions are named alike in the main process (`__main__`), in spawned
workers (`__mp_main__`) and in the next run, while a real change of the optimizer still refuses,
naming the field, unless the user accepts it."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parallelwrapper import ParallelWrapper
from parallelwrapper.checkpoint import ACCEPTABLE, CheckpointError, load, own_states
from parallelwrapper.naming import describe, qualified

SCRIPT = Path(__file__).parent / "scripts" / "script_resume.py"


def _f(step: int, rate: float) -> float:
    return rate * step


@pytest.mark.fast
def test_a_script_function_is_named_alike_in_the_script_and_in_a_spawned_worker() -> None:
    def fn() -> None: ...

    fn.__module__ = "__mp_main__"  # as a spawned worker's import of the script names it
    assert qualified(fn) == f"__main__.{fn.__qualname__}"
    fn.__module__ = "__main__"
    assert qualified(fn) == f"__main__.{fn.__qualname__}"
    assert qualified(torch.optim.SGD) == "torch.optim.sgd.SGD"


@pytest.mark.fast
def test_values_are_described_without_addresses_or_numbers() -> None:
    text = describe({"lr_lambda": functools.partial(_f, rate=0.5), "w": torch.ones(3, 2), "obj": object()})
    assert "0x" not in text
    assert text == f"{{'lr_lambda': partial({_f.__module__}._f, rate=0.5), 'w': tensor(shape=[3, 2], dtype=float32), 'obj': <object object>}}"
    assert describe({"lr": 0.1, "betas": (0.9, 0.99)}) == repr({"lr": 0.1, "betas": (0.9, 0.99)})  # plain values as before


@pytest.mark.fast
def test_accept_changes_takes_only_the_fields_rebuilt_from_this_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\['tensors'\] cannot be accepted; only \['optimizer', 'lr_scheduler', 'outer_optimizer', 'workers'\]"):
        load(tmp_path, {}, accept=["workers", "tensors", "optimizer"])
    assert ACCEPTABLE == ("optimizer", "lr_scheduler", "outer_optimizer", "workers")


@pytest.mark.fast
def test_own_states_resized_keep_each_workers_own_and_give_a_new_one_worker_0s_with_nothing_to_send() -> None:
    """checkpoint.own_states, for a resume with fewer or more workers (2 stages a worker here):
    the first keep theirs; a new one takes worker 0's policy and τ, its own RNG, no error fed
    back, a zero residual; and the same each time."""
    def own(w: int, s: int) -> dict[str, Any]:
        return {
            "torch": torch.Generator().manual_seed(10 * w + s).get_state(), "autopilot": {"k": 8},
            "codec_errors": {"codec": "int8", "tensors": [torch.ones(3)]},
            "gradient_encoding": {"residual": torch.ones(2), "threshold": 0.5, "steps": 7},
        }  # fmt: skip

    saved = [own(w, s) for w in range(2) for s in range(2)]
    assert own_states(saved, 1, per_worker=2) == saved[:2]
    grown = own_states(saved, 3, per_worker=2)
    assert grown[:4] == saved and len(grown) == 6
    for s, new in enumerate(grown[4:]):
        assert new["autopilot"] == {"k": 8} and "codec_errors" not in new
        assert torch.equal(new["gradient_encoding"]["residual"], torch.zeros(2)) and new["gradient_encoding"]["threshold"] == 0.5
        assert not any(torch.equal(new["torch"], old["torch"]) for old in saved)
        assert torch.equal(new["torch"], own_states(saved, 3, per_worker=2)[4 + s]["torch"])
    assert not torch.equal(grown[4]["torch"], grown[5]["torch"])


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


@pytest.mark.fast
def test_a_partial_optimizer_is_named_with_its_arguments_and_another_rate_refuses_to_resume(tmp_path: Path) -> None:
    """`.optimizer(functools.partial(make_optimizer, lr=...))` was fingerprinted as `functools.partial`:
    a resume with another learning rate went through (issue 50). One worker on the CPU trains in
    this process: fit() spawns nothing."""
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

    def builder(lr: float) -> Any:
        optimizer = functools.partial(make_optimizer, lr=lr)
        return ParallelWrapper.builder(nn.Linear(4, 2)).workers(1).optimizer(optimizer).checkpoint(tmp_path, every=1)

    with builder(0.1).build() as first:
        first.fit(data)
    name = f"partial({qualified(make_optimizer)}, lr={{}})(model)"
    with builder(0.05).build() as second, pytest.raises(CheckpointError, match=r"\(optimizer differs\)") as refused:
        second.fit(data, epochs=2, resume=tmp_path)
    assert f"optimizer: checkpoint has '{name.format(0.1)}', this run has '{name.format(0.05)}'" in str(refused.value)


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return _runs([args])[0]


def _start(*args: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _runs(each: list[tuple[str | Path, ...]]) -> list[subprocess.CompletedProcess[str]]:
    """The script with each of `each`'s arguments, in processes of their own at the same time
    (they write different checkpoints, or read one and fail before they train)."""
    return [_finish(p) for p in [_start(*args) for args in each]]


def test_a_script_resumes_in_a_second_process_and_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    whole_run = _start(tmp_path / "b", 2, tmp_path / "b2.pt")  # beside the interrupted run and its resume: another checkpoint
    first = _run(tmp_path / "a", 1, tmp_path / "a1.pt")
    assert first.returncode == 0, first.stderr
    assert "NAMED __main__.make_optimizer" in first.stdout
    resumed = _run(tmp_path / "a", 2, tmp_path / "a2.pt", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    whole = _finish(whole_run)
    assert whole.returncode == 0, whole.stderr
    for a, b in zip(torch.load(tmp_path / "a2.pt"), torch.load(tmp_path / "b2.pt"), strict=True):
        assert torch.equal(a, b)
    saved = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)
    assert saved["fingerprint"]["optimizer"] == "__main__.make_optimizer(model)"  # written by spawned worker 0

    shutil.copytree(tmp_path / "a", tmp_path / "c")  # the accepted resume writes its checkpoints apart from the refused ones' reads
    changed, misfit, accepted = _runs([
        (tmp_path / "a", 3, tmp_path / "a3.pt", "--resume", "--one-group"),
        (tmp_path / "a", 3, tmp_path / "a3.pt", "--resume", "--one-group", "--accept"),
        (tmp_path / "c", 3, tmp_path / "c3.pt", "--resume", "--renamed", "--accept"),
    ])  # fmt: skip
    assert changed.returncode != 0
    message = next(line for line in changed.stderr.splitlines() if f"{CheckpointError.__name__}: " in line)
    assert "(optimizer differs)" in message and "accept_changes=['optimizer']" in message
    assert "optimizer: checkpoint has '__main__.make_optimizer(model)', this run has '__main__.one_group(model)'" in changed.stderr
    assert misfit.returncode != 0 and "its state does not load into this run's optimizer" in misfit.stderr
    assert accepted.returncode == 0, accepted.stderr
