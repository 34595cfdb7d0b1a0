"""Trains a small model under torchrun and saves each rank's final state: `torchrun ... OUT_DIR [loader|sparse]`.

Used by tests/test_torchrun.py. The data is the same on every rank (same seed); the wrapper
keeps each rank's shard (batch i on rank i mod world size). With `loader`, the same batches come
from a DataLoader over a TensorDataset (16 a batch, in order) instead of a list; with `sparse`, the
parameters alone travel as the sparse payload (`sparse_builder`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelwrapper import ParallelWrapper


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    sizes = [16] * 12 + [5]
    return [(torch.randn(s, 10, generator=g), torch.randint(0, 3, (s,), generator=g)) for s in sizes]


def loader() -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
    """data()'s batches, from a DataLoader: 197 samples, 16 a batch, the last of 5."""
    inputs, labels = (torch.cat(parts) for parts in zip(*data()))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=16)


def sparse_builder(builder: Any) -> Any:
    return builder.payload_dtype("sparse").average_updaters(False)


def main(out: Path, mode: str) -> None:
    net = model()
    builder = (
        ParallelWrapper.builder(net)
        .optimizer(torch.optim.Adam, lr=0.01)
        .averaging_frequency(2)
        .deterministic(True)
        .seed(3)
        .threads_per_worker(1)
    )
    if mode == "sparse":
        builder = sparse_builder(builder)
    with builder.build() as wrapper:
        history = wrapper.fit(loader() if mode == "loader" else data(), epochs=2)
        rank = int(os.environ["RANK"])
        torch.save({"model": net.state_dict(), "optimizer": wrapper.optimizer.state_dict()}, out / f"rank{rank}.pt")
        if wrapper.is_main:
            (out / "history.json").write_text(
                json.dumps({"scores": len(history.scores), "samples": [e.samples for e in history.epochs]})
            )


if __name__ == "__main__":
    main(Path(sys.argv[1]), (sys.argv[2:] or ["list"])[0])
