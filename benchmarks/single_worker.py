"""The overhead of the wrapper with one worker: `.workers(1)` against a plain PyTorch loop on
the same batches, same threads, interleaved repeats, steady-state samples/s.

    python benchmarks/single_worker.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from common import DEFAULT_DATA_DIR, LR, MOMENTUM, lenet, mnist_batches, nesterov, table, write_results
from parallelwrapper import ParallelWrapper, Score


def plain(batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> float:
    model = lenet()
    optimizer = nesterov(model)
    start, samples = time.monotonic(), 0
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            start, samples = time.monotonic(), 0
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        samples += len(y)
    return samples / (time.monotonic() - start)


def wrapped(batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, k: int, threads: int) -> float:
    scores: list[Score] = []
    builder = (
        ParallelWrapper.builder(lenet()).optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM, nesterov=True)
        .workers(1).threads_per_worker(threads).averaging_frequency(k).listeners(scores.append)
    )  # fmt: skip
    with builder.build() as w:
        w.fit(batches)
    first = next(s for s in scores if s.iteration >= warmup)
    return (scores[-1].samples - first.samples) / (scores[-1].seconds - first.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--averaging-frequency", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/single_worker.json")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))  # what the single worker gets by default
    torch.set_num_threads(threads)
    batches = mnist_batches(args.data_dir)[: args.steps]
    loop, ours = [], []
    for _ in range(args.repeats):
        loop.append(plain(batches, args.warmup))
        ours.append(wrapped(batches, args.warmup, args.averaging_frequency, threads))
    result = {
        "threads": threads,
        "plain_samples_per_s": statistics.median(loop),
        "wrapper_samples_per_s": statistics.median(ours),
        "all_plain": loop,
        "all_wrapper": ours,
    }
    result["ratio"] = result["wrapper_samples_per_s"] / result["plain_samples_per_s"]
    print(f"LeNet, MNIST, batch 128, {threads} threads, {args.steps} batches ({args.warmup} warm-up), median of {args.repeats}")
    print(table(["plain loop samples/s", "workers(1) samples/s", "ratio"], [(result["plain_samples_per_s"], result["wrapper_samples_per_s"], result["ratio"])]))
    write_results(args.out, {"steps": args.steps, **result})


if __name__ == "__main__":
    main()
