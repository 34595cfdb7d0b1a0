"""Your own model and data: a plain `torch.utils.data.Dataset` and `DataLoader`, no MNIST.

The task is synthetic, so that the script needs nothing but torch: points in 20 dimensions, each
labelled with one of 4 classes by a fixed random "teacher" (the argmax of a linear map, with a
little noise). A small MLP learns to tell the classes apart.

What the wrapper asks of your code, all of it here:
- batches `(inputs, targets)`, from any iterable: a DataLoader is one. `fit()` iterates it once
  per epoch in this process and hands the batches to the workers, so the Dataset itself never
  travels (a DataLoader's own `num_workers` processes read ahead as usual);
- a model class defined at module level: each spawned worker imports it to rebuild its copy;
- a loss `loss_fn(model(inputs), targets)` (cross-entropy by default), or `.training_step(fn)`
  for batches of another shape (see custom_training_step.py).

`wrapper.evaluate(data)` scores the model you passed to the builder (after `fit()`, the averaged
one) on `(inputs, targets)` batches, in this process: mean loss and accuracy.

    python examples/custom_data.py           # 16,384 points, 4 epochs
    python examples/custom_data.py --tiny    # a smoke run
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from parallelwrapper import ParallelWrapper, ProgressBar

FEATURES, CLASSES = 20, 4


class TeacherDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`n` points x ~ N(0, I) labelled argmax(x @ W + noise), W drawn from `teacher_seed`: the
    train and test sets share the teacher and differ in `seed`."""

    def __init__(self, n: int, seed: int, teacher_seed: int = 0) -> None:
        teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(teacher_seed))
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)  # (n, 20)
        logits = self.x @ teacher + 0.3 * torch.randn(n, CLASSES, generator=g)  # (n, 4)
        self.y = logits.argmax(dim=1)  # (n,) int64

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 20) -> logits (B, 4)
        out: torch.Tensor = self.layers(x)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="2,048 training points, 2 epochs: a smoke run")
    args = parser.parse_args()

    n, epochs = (2048, 2) if args.tiny else (16_384, args.epochs)
    # Shuffled with a seeded generator: the same order on every run.
    train = DataLoader(TeacherDataset(n, seed=1), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    test = DataLoader(TeacherDataset(2048, seed=2), batch_size=512)

    torch.manual_seed(0)
    model = MLP()
    wrapper = (
        ParallelWrapper.builder(model)
        .optimizer(torch.optim.Adam, lr=1e-2)
        .loss_fn(F.cross_entropy)  # the default, spelled out
        .workers(2)
        .averaging_frequency(4)
        .listeners(ProgressBar(len(train)))
        .build()
    )
    with wrapper:
        before = wrapper.evaluate(test)
        history = wrapper.fit(train, epochs=epochs)
    after = wrapper.evaluate(test)  # `model` now holds the averaged weights
    print(
        f"mean training loss of the last epoch {history.final_score:.4f}; "
        f"test accuracy {before['accuracy']:.4f} -> {after['accuracy']:.4f}"
    )


if __name__ == "__main__":  # workers are spawned processes: guard the entry point
    main()
