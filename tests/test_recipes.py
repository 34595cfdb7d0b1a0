"""What real training recipes bring: parameter groups from a function, gradient clipping and
`before_step` between backward and step, and parameter hooks that would not reach the workers.
Spawned workers and the in-process worker, real gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parallelwrapper import ParallelWrapper, TrainingMode
from tiny import make_batches, mlp

pytestmark = pytest.mark.timeout(120)


# -- module level: these travel to spawned workers ------------------------------------------------


def decay_groups(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.003}], lr=0.01)


GLOBAL_MODEL = nn.Linear(2, 2)


def another_models_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(GLOBAL_MODEL.parameters(), lr=0.1)


def broken_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    raise KeyError("no such group")


SEEN: list[tuple[int, bool]] = []  # filled by before_step in this process (one worker on the CPU)


def record_gradients(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    SEEN.append((len(optimizer.param_groups), all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())))


def zero_gradients(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        assert p.grad is not None
        p.grad.zero_()


def groups(optimizer: torch.optim.Optimizer) -> list[tuple[float, float, int]]:
    return [(g["lr"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in optimizer.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items()})
    return out


# -- parameter groups -------------------------------------------------------------------------------


def test_parameter_groups_reach_every_worker_and_survive_fits_and_resume(tmp_path: Path) -> None:
    data = make_batches(12)

    def grouped(model: nn.Module, directory: Path) -> Any:
        return (
            ParallelWrapper.builder(model).optimizer(decay_groups).workers(2).threads_per_worker(1)
            .averaging_frequency(2).deterministic(True).checkpoint(directory, every=100)
        )  # fmt: skip

    model = mlp()
    with grouped(model, tmp_path / "straight").build() as w:
        assert groups(w.optimizer) == [(0.01, 0.1, 2), (0.003, 0.0, 2)]
        for _ in range(3):
            w.fit(data)
        assert groups(w.optimizer) == [(0.01, 0.1, 2), (0.003, 0.0, 2)]
        expected = full_state(model, w.optimizer)

    model = mlp()
    with grouped(model, tmp_path / "run").build() as w:
        w.fit(data, epochs=2)  # the checkpoint of epoch 2's end
    model = mlp()
    with grouped(model, tmp_path / "run").build() as w:
        w.fit(data, epochs=3, resume=tmp_path / "run")
        assert groups(w.optimizer) == [(0.01, 0.1, 2), (0.003, 0.0, 2)]
        resumed = full_state(model, w.optimizer)
    assert resumed.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(resumed[key], value), key


def test_a_bad_optimizer_function_fails_at_build_with_a_short_message() -> None:
    with pytest.raises(ValueError, match=r"broken_optimizer\(model\) failed: KeyError: 'no such group'"):
        ParallelWrapper.builder(mlp()).optimizer(broken_optimizer).build()
    with pytest.raises(ValueError, match=r"optimizes 2 tensors that are not the parameters of the model it was given"):
        ParallelWrapper.builder(mlp()).optimizer(another_models_optimizer).build()
    with pytest.raises(ValueError, match=r"optimizer cannot be sent to a spawned worker"):
        ParallelWrapper.builder(mlp()).optimizer(lambda m: torch.optim.SGD(m.parameters(), lr=0.1)).build()
    model = mlp()
    tensors = [{"params": list(model.parameters())}]
    with pytest.raises(ValueError) as error:
        ParallelWrapper.builder(model).optimizer(torch.optim.AdamW, params=tensors).build()
    assert "pass a function instead" in str(error.value) and len(str(error.value)) < 400  # no tensor printed


# -- between backward and step ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "mode"),
    [(1, TrainingMode.AVERAGING), (2, TrainingMode.AVERAGING), (2, TrainingMode.SHARED_GRADIENTS)],
    ids=["one-worker", "averaging", "shared-gradients"],
)
def test_clipping_bounds_every_step(workers: int, mode: TrainingMode) -> None:
    """SGD with lr 1: a step moves the parameters by the clipped gradient, at most max_norm; an
    average of such moves moves them no further."""
    model = mlp()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    builder = (
        ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=1.0).workers(workers).threads_per_worker(1)
        .training_mode(mode).gradient_clipping(max_norm=1e-3).deterministic(True)
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(make_batches(8))
    moved = float((torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm())
    steps = 8 // workers  # every worker's rounds are one step (k = 1)
    assert 0 < moved <= steps * 1e-3 * (1 + 1e-4), (moved, len(history.scores))


def test_before_step_sees_the_gradients_and_can_change_them() -> None:
    SEEN.clear()
    model = mlp()
    one = ParallelWrapper.builder(model).optimizer(decay_groups).workers(1).threads_per_worker(1)
    with one.before_step(record_gradients).build() as w:
        w.fit(make_batches(5))
    assert SEEN == [(2, True)] * 5  # every step, in the worker, with its optimizer's groups

    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=0.5).workers(2).threads_per_worker(1).before_step(zero_gradients).build() as w:
        w.fit(make_batches(6))
    for key, value in before.items():  # no gradient, no step: every average is of the same values
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=1e-7)


def test_parameter_hooks_that_cannot_reach_the_workers_are_named() -> None:
    model = mlp()
    model[0].weight.register_hook(lambda g: g * 2)
    with pytest.warns(UserWarning, match=r"parameters 0.weight carry hooks.*\.before_step\(fn\)"):
        ParallelWrapper.builder(model).workers(1).build().close()
    with pytest.raises(ValueError, match=r"gradient_clipping must be a positive number"):
        ParallelWrapper.builder(mlp()).gradient_clipping(0).build()


# -- precision ------------------------------------------------------------------------------------

DTYPES: list[torch.dtype] = []  # filled by the step below, in this process (one worker on the CPU)


def dtype_recording_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = model(batch[0])
    DTYPES.append(out.dtype)
    return nn.functional.cross_entropy(out, batch[1])


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_mixed_precision_runs_the_forward_in_16_bits_and_keeps_float32_weights(precision: str, dtype: torch.dtype) -> None:
    DTYPES.clear()
    model = mlp()
    with ParallelWrapper.builder(model).workers(1).precision(precision).training_step(dtype_recording_step).build() as w:
        history = w.fit(make_batches(4))
    assert DTYPES == [dtype] * 4
    assert all(p.dtype == torch.float32 for p in model.parameters()) and history.epochs[0].score == history.epochs[0].score
    with pytest.raises(ValueError, match=r"precision must be one of \['32', 'bf16-mixed', '16-mixed'\]"):
        ParallelWrapper.builder(mlp()).precision("fp8").build()


def overflowing_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A finite loss whose scaled gradients overflow on the batch marked with target -1."""
    inputs, targets = batch
    if bool((targets < 0).any()):
        return sum(p.sum() for p in model.parameters()) * 1e34  # type: ignore[return-value]
    return nn.functional.cross_entropy(model(inputs), targets)


@pytest.mark.parametrize("mode", [TrainingMode.AVERAGING, TrainingMode.SHARED_GRADIENTS])
def test_16_mixed_a_step_the_scaler_skips_still_joins_its_round(tmp_path: Path, mode: TrainingMode) -> None:
    """Batch 3 (worker 1's second) overflows: that step is skipped and its scale halves, and the
    worker stays in step. In SHARED_GRADIENTS the overflow reaches the averaged gradients, so
    both workers skip it and keep one scale; in AVERAGING only worker 1's scale halves. Each
    worker's scale is saved with its RNG state, for a resume."""
    data = make_batches(8)
    data[3] = (data[3][0], torch.full_like(data[3][1], -1))
    model = mlp()
    builder = (
        ParallelWrapper.builder(model).workers(2).threads_per_worker(1).deterministic(True).training_mode(mode)
        .averaging_frequency(2 if mode is TrainingMode.AVERAGING else 1).precision("16-mixed")
        .training_step(overflowing_step).checkpoint(tmp_path)
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(data)
    assert history.epochs[0].iteration == 8 and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    scales = [own["grad_scaler"]["scale"] for own in saved["rng"]]
    assert scales == ([2.0**15, 2.0**15] if mode is TrainingMode.SHARED_GRADIENTS else [2.0**16, 2.0**15])


def test_bf16_mixed_trains_lenet_on_mnist_as_well_as_float32(mnist_dir: Path) -> None:
    """Two workers, 40 batches of 64 real MNIST images each, the same seed: test accuracy on
    2,000 test images within 2 points of float32's."""
    from parallelwrapper.app.mnist import load_mnist
    from parallelwrapper.app.models import LeNet

    train = load_mnist(mnist_dir, "train", download=False).batches(64, shuffle=True, seed=0)[:80]
    test = load_mnist(mnist_dir, "test", download=False).batches(1000)[:2]
    accuracy = {}
    for precision in ("32", "bf16-mixed"):  # 16-mixed: float16 kernels crawl on a CPU; pw-fit's figures are in the note
        torch.manual_seed(0)
        builder = (
            ParallelWrapper.builder(LeNet()).optimizer(torch.optim.SGD, lr=0.02, momentum=0.9, nesterov=True)
            .workers(2).threads_per_worker(1).averaging_frequency(3).deterministic(True).precision(precision)
        )  # fmt: skip
        with builder.build() as w:
            w.fit(train)
            accuracy[precision] = w.evaluate(test)["accuracy"]
    assert accuracy["32"] > 0.85 and abs(accuracy["bf16-mixed"] - accuracy["32"]) < 0.02, accuracy


# -- validation -----------------------------------------------------------------------------------


def mae_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"mae": (model(batch[0]) - 1.0).abs().mean()}


def regression_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((model(batch[0]) - 1.0) ** 2).mean()


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlap"])
def test_validation_runs_on_every_workers_share_and_scores_the_averaged_model(overlap: bool) -> None:
    """Every 2 averagings and at the epoch's end; the last one scores the model fit() returns."""
    val = make_batches(5, size=10)
    model = mlp()
    builder = (
        ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=0.1).workers(2).threads_per_worker(1)
        .deterministic(True).overlap_averaging(overlap).validation(val, every=2)
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(make_batches(12))  # 6 rounds of one batch each
        expected = w.evaluate(val)
    assert [v.round for v in history.validations] == [2, 4, 6]
    last = history.validations[-1].metrics
    assert set(last) == {"val_loss", "val_accuracy"}
    assert last["val_loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert last["val_accuracy"] == pytest.approx(expected["accuracy"])


def test_validation_with_its_own_step() -> None:
    model = mlp()
    builder = ParallelWrapper.builder(model).workers(1).training_step(regression_step)
    with pytest.raises(ValueError, match=r"validation: with \.training_step\(fn\).*step=fn"):
        builder.validation(make_batches(2), every=1).build()
    with builder.validation(make_batches(2), every=1, step=mae_step).build() as w:
        history = w.fit(make_batches(3))
    with torch.no_grad():
        expected = sum(float((model(x) - 1.0).abs().mean()) for x, _ in make_batches(2)) / 2
    assert len(history.validations) == 3 and history.validations[-1].metrics["mae"] == pytest.approx(expected, rel=1e-6)


# -- early stopping -------------------------------------------------------------------------------


def flat_metric_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    return {"val_loss": 1.0}  # never improves after the first validation


@pytest.mark.parametrize("workers", [2, 1], ids=["spawned", "in-process"])
def test_early_stopping_stops_every_worker_after_the_same_round_and_the_next_fit_carries_on(workers: int) -> None:
    from parallelwrapper import EarlyStopping

    stopper = EarlyStopping(monitor="val_loss", patience=2)
    data = make_batches(5 * workers)  # 5 rounds of one batch per worker
    model = mlp()
    builder = (
        ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=0.1).workers(workers).threads_per_worker(1)
        .deterministic(True).validation(make_batches(2), every=1, step=flat_metric_step).listeners(stopper)
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(data)
        # The first validation sets the best; two more without improvement stop the fit there.
        assert [v.round for v in history.validations] == [1, 2, 3]
        assert [(e.epoch, e.iteration, e.complete) for e in history.epochs] == [(0, 3 * workers, False)]  # a partial epoch
        assert stopper.stopped_round == 3 and stopper.best == 1.0
        assert (w.counters.rounds, w.counters.iterations, w.counters.epoch) == (3, 3 * workers, 0)
        history = w.fit(data)  # the rest of the epoch: rounds 4 and 5, too few to stop again
    assert [v.round for v in history.validations] == [4, 5] and stopper.stopped_round is None
    # Every batch once: nothing left over from the stopped fit in the feed, nothing lost.
    assert (history.epochs[-1].iteration, history.epochs[-1].samples) == (5 * workers, 5 * workers * 16)


def test_early_stopping_restores_the_best_state_and_needs_validation() -> None:
    from parallelwrapper import EarlyStopping

    with pytest.raises(ValueError, match=r"EarlyStopping stops on validation metrics: add \.validation"):
        ParallelWrapper.builder(mlp()).listeners(EarlyStopping()).build()
    data = make_batches(8)
    best = mlp()
    with ParallelWrapper.builder(best).optimizer(torch.optim.SGD, lr=0.1).workers(1).build() as w:
        w.fit(data[:1])  # the state after the first round, the best validation below
    model = mlp()
    builder = (
        ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=0.1).workers(1)
        .validation(data[:1], every=1, step=flat_metric_step).listeners(EarlyStopping(patience=2, restore_best=True))
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(data)
    assert [v.round for v in history.validations] == [1, 2, 3]
    for key, value in best.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_epoch_end_validations_belong_to_the_epoch_that_ended_and_the_bar_says_which_loss() -> None:
    import io

    from parallelwrapper.listeners import ProgressBar

    out = io.StringIO()
    data = make_batches(10)
    builder = ParallelWrapper.builder(mlp()).workers(1).validation(data[:2], every=None).listeners(ProgressBar(10, file=out))
    with builder.build() as w:
        history = w.fit(data, epochs=2)
    assert [(v.epoch, v.round) for v in history.validations] == [(0, 10), (1, 20)]  # every=None: epoch ends only
    assert [s.position for s in history.scores[:3]] == [1, 2, 3]
    last = out.getvalue().rsplit("\r", 1)[-1]
    assert "10/10" in last and "val loss=" in last and "epoch loss=" in last and "round loss" not in last


def test_validation_batches_that_are_views_travel_without_their_base() -> None:
    from parallelwrapper.feed.data import compact

    base = torch.randn(1000, 10)
    views = [(base[i : i + 10], torch.zeros(10, dtype=torch.long)) for i in range(0, 100, 10)]
    compacted = compact(views)
    assert isinstance(compacted, list) and all(torch.equal(a[0], b[0]) for a, b in zip(views, compacted, strict=True))
    assert all(x.untyped_storage().nbytes() == 10 * 10 * 4 for x, _ in compacted)
