"""One process of benchmarks/fleet_soak.py's emulated machines: `torchrun ... fleet_soak_worker.py MODE STORE PROCESSES OUT EPOCHS [WIDTH]`.

MODE fleet: a member of a fleet (`.fleet(STORE, processes=PROCESSES).on_worker_failure("replace")`),
under a torchrun of its own machine. MODE restart: a rank of one torchrun job across the machines,
which its agents restart at every change of machines, resuming from the checkpoint in OUT/ckpt.
Both train the same MLP on MNIST (784-WIDTH-WIDTH-10, WIDTH 1024 unless given, batches of
benchmarks.common.BATCH, k = 16, SGD with Nesterov momentum), EPOCHS epochs.
The first process to train writes the time to OUT/first.txt; each process that finishes writes
OUT/result-{pid}.json: its History's epochs, its test loss and accuracy on the 10,000 test images,
and the time it finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import DEFAULT_DATA_DIR, mnist_batches
from parallelwrapper import ParallelWrapper

K, LR, PEER_TIMEOUT_S, CHECKPOINT_EVERY = 16, 0.05, 3.0, 4


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class Step:
    """Cross-entropy; the first step of the run writes its time."""

    def __init__(self, out: Path) -> None:
        self.first = out / "first.txt"
        self.seen = False

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if not self.seen:
            self.seen = True
            if not self.first.exists():
                self.first.write_text(repr(time.time()))
        return nn.functional.cross_entropy(model(batch[0]), batch[1])


def main(mode: str, store: str, processes: int, out: Path, epochs: int, width: int = 1024) -> None:
    net = mlp(width)
    builder = (
        ParallelWrapper.builder(net).optimizer(torch.optim.SGD, lr=LR, momentum=0.9, nesterov=True).averaging_frequency(K)
        .seed(0).threads_per_worker(1).peer_timeout(PEER_TIMEOUT_S).training_step(Step(out))
    )  # fmt: skip
    if mode == "fleet":
        builder = builder.fleet(store, processes=processes).on_worker_failure("replace")
    else:
        builder = builder.checkpoint(out / "ckpt", every=CHECKPOINT_EVERY)
    train, test = mnist_batches(DEFAULT_DATA_DIR), mnist_batches(DEFAULT_DATA_DIR, "test", 1000)
    with builder.build() as wrapper:
        history = wrapper.fit(train, epochs=epochs)
    with torch.no_grad():
        loss = sum(float(nn.functional.cross_entropy(net(x), y, reduction="sum")) for x, y in test) / 10_000
        right = sum(int((net(x).argmax(1) == y).sum()) for x, y in test)
    (out / f"result-{os.getpid()}.json").write_text(json.dumps({
        "finished": time.time(), "test_loss": loss, "test_accuracy": right / 10_000,
        "epochs": [[e.epoch, e.iteration, e.samples] for e in history.epochs], "replacements": len(history.replacements),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "rounds": wrapper.rounds,
    }))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]), *map(int, sys.argv[6:7]))
