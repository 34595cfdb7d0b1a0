"""Models for MNIST: the LeNet of DL4J's multi-GPU MNIST example, and a small MLP.

LeNet follows deeplearning4j-examples' ``MultiGpuLenetMnistExample`` (LeCun et al., 1998,
"Gradient-based learning applied to document recognition", as adapted there): two 5x5
convolutions with identity activation, each followed by 2x2 max pooling, a 500-unit ReLU layer
and a 10-way output. The softmax of DL4J's output layer is left to ``F.cross_entropy``, so
``forward`` returns logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LeNet", "MLP", "build_model", "MODEL_NAMES"]


def _xavier_init(module: nn.Module) -> None:
    """DL4J's ``WeightInit.XAVIER``: N(0, 2 / (fan_in + fan_out)) weights, zero biases.

    DL4J's XAVIER is the Gaussian form of Glorot and Bengio (2010) (XAVIER_UNIFORM is the
    uniform one), and its conv fans equal torch's for stride 1, so xavier_normal_ matches it.
    """
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_normal_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


class LeNet(nn.Module):
    """Conv(20, 5x5), pool, Conv(50, 5x5), pool, Dense(500, ReLU), Dense(10): 431,080 params."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=5)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.fc1 = nn.Linear(50 * 4 * 4, 500)
        self.fc2 = nn.Linear(500, 10)
        _xavier_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 28, 28)
        """Class scores (logits), (B, 10), of a batch of 28x28 images."""
        # No activation after the convolutions: DL4J's example uses Activation.IDENTITY there.
        x = self.pool(self.conv1(x))  # (B, 20, 24, 24) -> (B, 20, 12, 12)
        x = self.pool(self.conv2(x))  # (B, 50, 8, 8) -> (B, 50, 4, 4)
        x = x.flatten(1)  # (B, 800)
        x = F.relu(self.fc1(x))  # (B, 500)
        logits: torch.Tensor = self.fc2(x)  # (B, 10)
        return logits

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """`forward` as (name, layer) pairs in order, for `.pipeline(...)` to cut into stages; the
        names keep the parameters' own (conv1.weight, ...)."""
        return [
            ("conv1", self.conv1), ("pool1", self.pool), ("conv2", self.conv2), ("pool2", self.pool),
            ("flatten", nn.Flatten()), ("fc1", self.fc1), ("relu", nn.ReLU()), ("fc2", self.fc2),
        ]  # fmt: skip


class MLP(nn.Module):
    """784 -> hidden (ReLU) -> 10; a cheap model for fast tests."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}; pass a positive width")
        self.fc1 = nn.Linear(28 * 28, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        _xavier_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 28, 28)
        x = F.relu(self.fc1(x.flatten(1)))  # (B, 784) -> (B, hidden)
        logits: torch.Tensor = self.fc2(x)  # (B, 10)
        return logits


MODEL_NAMES: tuple[str, ...] = ("lenet", "mlp")


def build_model(name: str) -> nn.Module:
    """A freshly initialised model by name: "lenet" or "mlp"."""
    if name == "lenet":
        return LeNet()
    if name == "mlp":
        return MLP()
    raise ValueError(f"unknown model {name!r}; choose one of {list(MODEL_NAMES)}")
