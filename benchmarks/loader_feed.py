"""A DataLoader over a map-style dataset, fed to spawned workers two ways (issue 21, item 4):

    python benchmarks/loader_feed.py --steps 200 --repeats 3

  loader, queue    the main process iterates the loader, and every batch goes to a worker through
                   the queue and shared-memory slots (`.feed("queue")`, dealt: batch i to worker
                   i mod N, so that each worker takes `steps` steps and the window is the same)
  loader, shards   `.feed("auto")`, the default: the main process draws the sample indices of the
                   loader's batches, and each worker loads and collates its own from the dataset
  list, shards     the same batches as a list, which workers read in shards: the reference

LeNet on MNIST, batch 128, 2 workers of one thread, k = 3, the loader unshuffled over a
TensorDataset of the batches' images and labels (so every contender trains the same batches).
ms per step as throughput.py times it (`common.timed_fit`: the workers' stamps after each
backward, whole rounds after the warm-up); each repeat runs the contenders in a rotated order,
the medians are reported, and the ratios to `list, shards`.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from common import BATCH, DEFAULT_DATA_DIR, machine, rotated, table, timed_fit, write_results

CONTENDERS = {"loader, queue": "queue", "loader, shards": "auto", "list, shards": None}


def loader(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> DataLoader[Any]:
    images, labels = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    return DataLoader(TensorDataset(images, labels), batch_size=BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="batches per worker")
    parser.add_argument("--warmup", type=int, default=20, help="steps per worker not timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/loader_feed.json")
    args = parser.parse_args()
    names = list(CONTENDERS)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in rotated(names, r):
            feed = CONTENDERS[name]
            configure = (lambda b, feed=feed: b.feed(feed).deterministic(True)) if feed else (lambda b: b)
            result = timed_fit(args.workers, args.k, args.steps, args.warmup, args.data_dir, configure, given=loader if feed else None)
            runs[name].append(result)
            print(f"repeat {r + 1}, {name}: {result['ms_per_step']:.1f} ms/step", flush=True)
    medians = {name: statistics.median(x["ms_per_step"] for x in xs) for name, xs in runs.items()}
    reference = medians["list, shards"]
    rows = [(name, medians[name], " / ".join(f"{x['ms_per_step']:.1f}" for x in runs[name]), reference / medians[name]) for name in names]
    print(f"LeNet, batch {BATCH}, {args.workers} workers, k={args.k}, {args.steps} steps each, median of {args.repeats}")
    print(table(["feed", "ms/step (median)", "each repeat", "speed vs list, shards"], rows))
    write_results(args.out, {**vars(args), "machine": machine(), "ms_per_step": medians, "runs": runs})


if __name__ == "__main__":
    main()
