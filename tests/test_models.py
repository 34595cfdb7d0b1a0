"""Tests for the MNIST models: shapes, parameter counts, DL4J's Xavier init, the name lookup."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from parallelwrapper.app.models import MLP, LeNet, build_model

pytestmark = pytest.mark.fast


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["lenet", "mlp"])
def test_output_shape(name: str) -> None:
    model = build_model(name)
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_parameter_counts() -> None:
    # 20*25+20 + 50*20*25+50 + 800*500+500 + 500*10+10
    assert n_params(LeNet()) == 431_080
    assert n_params(MLP()) == 784 * 256 + 256 + 256 * 10 + 10
    assert n_params(MLP(hidden=32)) == 784 * 32 + 32 + 32 * 10 + 10


def test_xavier_init() -> None:
    torch.manual_seed(0)
    model = LeNet()
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        assert torch.count_nonzero(layer.bias) == 0
    # fc1 has 400,000 weights: their std is within 1% of sqrt(2 / (fan_in + fan_out)).
    expected = math.sqrt(2.0 / (800 + 500))
    assert abs(float(model.fc1.weight.detach().std()) / expected - 1.0) < 0.01


def test_learns_a_batch() -> None:
    torch.manual_seed(0)
    model = LeNet()
    x, y = torch.randn(8, 1, 28, 28), torch.arange(8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: list[float] = []
    for _ in range(10):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_build_model_rejects_unknown() -> None:
    with pytest.raises(ValueError, match=r"'resnet'.*\['lenet', 'mlp'\]"):
        build_model("resnet")


def test_mlp_rejects_bad_width() -> None:
    with pytest.raises(ValueError, match="hidden"):
        MLP(hidden=0)
