"""What a recipe gets wrong is caught early and said plainly (issue 20): parameters that no param
group holds, validation data or a validation step that cannot score, a lambda where a function
must travel; and what History says after an early stop. The checks run before any worker starts,
so most of these need no process."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from parallelwrapper import EarlyStopping, ParallelWrapper
from parallelwrapper.rounds.state import averaged_tensors, gradient_tensors
from tiny import make_batches, mlp


def first_layer_only(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)  # model[2] is in no group


@pytest.mark.fast
def test_parameters_in_no_group_are_named_at_build_and_treated_as_frozen() -> None:
    with pytest.warns(UserWarning, match=r"^optimizer: 2 trainable parameters are in no param group \(2\.weight, 2\.bias\)"):
        w = ParallelWrapper.builder(mlp()).optimizer(first_layer_only).outer_optimizer(torch.optim.SGD, lr=0.7).workers(1).build()
    with w:
        left_out = {id(p) for p in w.model[2].parameters()}
        assert not left_out & {id(t) for t in averaged_tensors(w.model, w.optimizer, average_updaters=True)}
        assert len(gradient_tensors(w.model, w.optimizer)) == 2  # the first layer's two gradients, no buffers
        assert w.outer_optimizer is not None and sum(len(g["params"]) for g in w.outer_optimizer.param_groups) == 2


def test_parameters_in_no_group_stay_bitwise_as_they_were() -> None:
    model = mlp()
    before = [p.detach().clone() for p in model[2].parameters()]
    with pytest.warns(UserWarning, match="in no param group"):
        w = ParallelWrapper.builder(model).optimizer(first_layer_only).workers(1).build()
    with w:
        w.fit(make_batches(4))
    assert all(torch.equal(a, b) for a, b in zip(before, model[2].parameters(), strict=True))
    assert not torch.equal(model[0].weight, mlp()[0].weight)  # the rest trained


class LogitsAndLoss(nn.Module):
    """A model that returns (logits, loss), as nanoGPT's does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        return logits, logits.square().mean()


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])[1]


@pytest.mark.fast
def test_a_validation_that_cannot_score_fails_at_fit_start_naming_validation_and_the_batch() -> None:
    windows = [(torch.randn(4, 10), torch.randint(0, 3, (4, 7)))]  # targets of the wrong shape
    w = ParallelWrapper.builder(mlp()).workers(2).validation(windows).build()
    with w, pytest.raises(ValueError) as raised:
        w.fit(make_batches(4))
    first = str(raised.value).splitlines()[0]
    assert first.startswith("validation: batch 0 (float32[4, 10], int64[4, 7]) fails before training starts: ValueError:")
    assert "pass .validation(data, step=fn)" in first and len(str(raised.value)) < 600
    assert w._pool is None  # no worker was started


@pytest.mark.fast
def test_the_default_validation_of_a_model_that_is_no_classifier_says_to_pass_a_step() -> None:
    w = ParallelWrapper.builder(LogitsAndLoss()).workers(1).training_step(loss_of).loss_fn(nn.functional.cross_entropy)
    with w.validation(make_batches(2)).build() as built, pytest.raises(ValueError) as raised:
        built.fit(make_batches(2))
    assert str(raised.value).startswith("validation: batch 0 (float32[16, 10], int64[16]) fails before training starts")
    assert "the model returned (float32[16, 3], float32[]) for targets int64[16]" in str(raised.value)
    assert "pass .validation(data, step=fn)" in str(raised.value)


def never_improves(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    return {"val_loss": 1.0}


def test_final_score_after_an_early_stop_in_the_first_epoch_is_its_partial_loss() -> None:
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1).workers(1)
        .validation(make_batches(1), every=1, step=never_improves).listeners(EarlyStopping(patience=2, restore_best=True))
    )  # fmt: skip
    with builder.build() as w:
        history = w.fit(make_batches(10))
    assert [s.round for s in history.scores] == [1, 2, 3] and history.best_round == 1
    (end,) = history.epochs
    assert not end.complete and end.epoch == 0 and end.iteration == 3
    assert math.isfinite(history.final_score)
    assert history.final_score == pytest.approx(sum(s.score for s in history.scores) / 3)  # equal batches


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))


@pytest.mark.fast
def test_a_lambda_is_refused_with_the_fix_functools_partial_of_a_module_level_function() -> None:
    base = ParallelWrapper.builder(mlp()).workers(2)
    with pytest.raises(ValueError) as raised:
        base.lr_scheduler(torch.optim.lr_scheduler.LambdaLR, interval="step", lr_lambda=lambda s: 1.0).build()
    first = str(raised.value).splitlines()[0]
    assert first.startswith("lr_scheduler cannot be sent to a spawned worker process")
    assert "use a module-level function, or functools.partial of one" in first
    schedule = functools.partial(warmup_cosine, warmup=12, total=256)  # what the message proposes builds
    base.lr_scheduler(torch.optim.lr_scheduler.LambdaLR, interval="step", lr_lambda=schedule).build().close()
