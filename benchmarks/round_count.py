"""How many rounds a first-come fit of N·k·m batches makes, over repeated runs: m every time since
rounds are cut by batch index (rounds/cut.py). Before, a worker that stopped after k batches and
looked one ahead could take, at an epoch's end, a batch another worker still needed, and a
one-batch round followed.

    python benchmarks/round_count.py --runs 3                         # this checkout
    PYTHONPATH=OLD_CHECKOUT python benchmarks/round_count.py --runs 3  # another one, to compare
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from parallelwrapper import ParallelWrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=256)
    parser.add_argument("--k", type=int, default=32)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 10, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(args.batches)]
    for run in range(args.runs):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        builder = ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=0.01).workers(2).threads_per_worker(1)
        with builder.averaging_frequency(args.k).feed("queue").build() as w:  # first-come
            history = w.fit(data)
        print(f"run {run}: {len(history.scores)} rounds, samples after each: {[s.samples for s in history.scores]}")


if __name__ == "__main__":
    main()
