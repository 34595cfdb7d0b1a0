"""A custom model with a custom training step: a denoising autoencoder on MNIST.

Not every model is a classifier fed `(inputs, targets)`. Here a batch is a dict holding only
images, and the loss is computed by our own `training_step(model, batch)`: corrupt the images
with noise, reconstruct them, and take the mean squared error against the clean images. The
wrapper needs nothing else: each worker calls the step on its batches, and the parameters and
Adam's moments are averaged every 4 steps as usual.

Both the model class and the step are defined at module level: spawned workers import them by
name (a lambda or a function defined inside main() could not reach them).

    python examples/custom_training_step.py --data-dir ../shared/data/mnist
    python examples/custom_training_step.py --data-dir ../shared/data/mnist --tiny
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from parallelwrapper import ParallelWrapper, ProgressBar
from parallelwrapper.app.mnist import MnistSplit, load_mnist

NOISE = 0.5  # std of the Gaussian noise added to images in [0, 1]


class DenoisingAutoencoder(nn.Module):
    """784 -> 256 -> 32 -> 256 -> 784; pixels come out in [0, 1]."""

    def __init__(self, code: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, code))
        self.decoder = nn.Sequential(nn.ReLU(), nn.Linear(code, 256), nn.ReLU(), nn.Linear(256, 784), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 28, 28)
        out: torch.Tensor = self.decoder(self.encoder(x))  # (B, 784)
        return out


def denoising_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of one batch. The noise comes from the worker's own RNG (seeded seed + rank)."""
    clean = batch["image"]  # (B, 1, 28, 28) in [0, 1]
    noisy = (clean + NOISE * torch.randn_like(clean)).clamp(0.0, 1.0)
    return F.mse_loss(model(noisy), clean.flatten(1))


@torch.no_grad()
def test_mse(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Reconstruction error of noisy test images, with fixed noise so that numbers compare."""
    g = torch.Generator().manual_seed(0)
    total, count = 0.0, 0
    for batch in batches:
        clean = batch["image"]
        noisy = (clean + NOISE * torch.randn(clean.shape, generator=g)).clamp(0.0, 1.0)
        total += F.mse_loss(model(noisy), clean.flatten(1), reduction="sum").item() / 784
        count += clean.shape[0]
    return total / count


def image_batches(split: MnistSplit, batch_size: int, shuffle: bool) -> list[dict[str, torch.Tensor]]:
    """MNIST as dicts of unnormalised images in [0, 1]: no labels, we do not need them."""
    return [{"image": x} for x, _ in split.batches(batch_size, shuffle=shuffle, seed=1, normalize=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="MNIST IDX files (default: the cache dir, downloading)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a few batches only: a smoke run")
    args = parser.parse_args()

    train = image_batches(load_mnist(args.data_dir, "train"), 128, shuffle=True)
    test = image_batches(load_mnist(args.data_dir, "test"), 1000, shuffle=False)
    if args.tiny:
        train, test = train[:8], test[:1]

    torch.manual_seed(0)
    model = DenoisingAutoencoder()
    before = test_mse(model, test)
    wrapper = (
        ParallelWrapper.builder(model)
        .training_step(denoising_step)  # instead of .loss_fn: the batch is not (inputs, targets)
        .optimizer(torch.optim.Adam, lr=1e-3)
        .workers(2)
        .averaging_frequency(4)
        .listeners(ProgressBar(len(train)))
        .build()
    )
    with wrapper:
        history = wrapper.fit(train, epochs=args.epochs)
    after = test_mse(model, test)  # `model` now holds the averaged weights
    print(f"training loss {history.final_score:.4f}; test reconstruction MSE {before:.4f} -> {after:.4f}")


if __name__ == "__main__":
    main()
