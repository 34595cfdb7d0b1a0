"""The overhead of the wrapper with one worker: `.workers(1)` against a plain PyTorch loop on
the same batches, same threads, interleaved repeats, steady-state samples/s.

    python benchmarks/single_worker.py
    python benchmarks/single_worker.py --device cuda   # where there is a GPU: the NCCL path

On the CPU the one worker runs in this process; on a GPU it is spawned and averages over NCCL.
Both loops take the batches from the CPU and move them to the device at each step.
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


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()


def plain(batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, device: torch.device) -> float:
    model = lenet().to(device)
    optimizer = nesterov(model)
    start, samples = _now(device), 0
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            start, samples = _now(device), 0
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        samples += len(y)
    return samples / (_now(device) - start)


def wrapped(batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, k: int, threads: int, device: torch.device) -> float:
    scores: list[Score] = []
    builder = (
        ParallelWrapper.builder(lenet()).optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM, nesterov=True)
        .workers(1).devices([str(device)]).threads_per_worker(threads).averaging_frequency(k).listeners(scores.append)
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
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:0) where there is a GPU")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", help="default: benchmarks/results/single_worker.json, or single_worker_cuda.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: torch sees no CUDA device on this machine")
        device = torch.device("cuda", device.index or 0)
    out = args.out or f"benchmarks/results/single_worker{'_cuda' if device.type == 'cuda' else ''}.json"
    threads = len(os.sched_getaffinity(0))  # what the single worker gets by default
    torch.set_num_threads(threads)
    batches = mnist_batches(args.data_dir)[: args.steps]
    loop, ours = [], []
    for _ in range(args.repeats):
        loop.append(plain(batches, args.warmup, device))
        ours.append(wrapped(batches, args.warmup, args.averaging_frequency, threads, device))
    result = {
        "device": str(device),
        "threads": threads,
        "plain_samples_per_s": statistics.median(loop),
        "wrapper_samples_per_s": statistics.median(ours),
        "all_plain": loop,
        "all_wrapper": ours,
    }
    result["ratio"] = result["wrapper_samples_per_s"] / result["plain_samples_per_s"]
    print(f"LeNet, MNIST, batch 128, {device}, {threads} threads, {args.steps} batches ({args.warmup} warm-up), median of {args.repeats}")
    print(table(["plain loop samples/s", "workers(1) samples/s", "ratio"], [(result["plain_samples_per_s"], result["wrapper_samples_per_s"], result["ratio"])]))
    write_results(out, {"steps": args.steps, **result})


if __name__ == "__main__":
    main()
