"""What a fit() costs besides its batches: the fixed seconds of one call (sending the state to the
workers, starting the round, building and letting go of the averaging buffers, handing the state
back and loading it), against the seconds each batch adds.

    python benchmarks/fit_cost.py                # LeNet on 2 workers, and benchmarks/pipeline.py's job
    python benchmarks/fit_cost.py --repeats 5
    python benchmarks/fit_cost.py --jobs lenet,mlp   # those jobs only (a name's first word)

Each job keeps one wrapper (its processes started by a first fit, not timed) and alternates fits of
`small` and `large` batches; fixed = (small · t_large − large · t_small) / (small − large) and a
batch's share = (t_large − t_small) / (large − small), from the medians of `repeats` fits of each
(a fit of one size costs fixed + size · per batch). The fixed share is of a fit of `large` batches:
what a caller who fits that many at a time loses to the calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import memory
from common import DEFAULT_DATA_DIR, lenet, mnist_batches, table, write_results
from parallelwrapper import ParallelWrapper
from pipeline import data, mlp


def lenet_job(data_dir: str) -> tuple[Any, list[Any]]:
    """LeNet, Nesterov SGD, 2 workers of one thread, k = 4, MNIST batches of 128."""
    b = ParallelWrapper.builder(lenet()).workers(2).threads_per_worker(1).averaging_frequency(4)
    return b.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9, nesterov=True), mnist_batches(data_dir)


def pipeline_job(data_dir: str) -> tuple[Any, list[Any]]:
    """benchmarks/pipeline.py's: 1 worker x 2 stages, 8 microbatches, an MLP of 8 x 1024, batches of 2048."""
    b = ParallelWrapper.builder(mlp(1024)).workers(1).threads_per_worker(1).deterministic(True).averaging_frequency(16)
    return b.optimizer(torch.optim.SGD, lr=0.01).pipeline(stages=2, microbatches=8), data(1024, 2048, 16)


def mlp_job(data_dir: str) -> tuple[Any, list[Any]]:
    """benchmarks/memory.py's MLP of 10M parameters (38 MiB), SGD with momentum, 2 workers of one
    thread, k = 4, batches of 16: a fit's state is 76 MiB each way."""
    b = ParallelWrapper.builder(memory.mlp(10_000_000)).workers(2).threads_per_worker(1).averaging_frequency(4)
    return b.optimizer(torch.optim.SGD, lr=memory.LR, momentum=memory.MOMENTUM), memory.batches(64)


JOBS: dict[str, tuple[Callable[[str], tuple[Any, list[Any]]], int, int]] = {
    # name: (job, small, large): batches a fit, all workers together
    "lenet, 2 workers": (lenet_job, 2, 64),
    "pipeline, 1 worker x 2 stages": (pipeline_job, 2, 16),
    "mlp 10M, 2 workers": (mlp_job, 2, 64),
}


def short(name: str) -> str:
    """A job's name for --jobs: its first word."""
    return name.split()[0].rstrip(",")


def measure(make: Callable[[str], tuple[Any, list[Any]]], small: int, large: int, repeats: int, data_dir: str) -> dict[str, float]:
    builder, batches = make(data_dir)
    times: dict[int, list[float]] = {small: [], large: []}
    with builder.build() as wrapper:
        wrapper.fit(batches[:small])  # starts the processes
        for _ in range(repeats):
            for n in (small, large):
                start = time.perf_counter()
                wrapper.fit(batches[:n])
                times[n].append(time.perf_counter() - start)
    t_small, t_large = statistics.median(times[small]), statistics.median(times[large])
    per_batch = (t_large - t_small) / (large - small)
    fixed = t_small - small * per_batch
    return {"fixed_s": fixed, "per_batch_s": per_batch, "large_fit_s": t_large, "fixed_share": fixed / t_large, "small_fits_s": times[small], "large_fits_s": times[large]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fits of each size; medians")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--jobs", default=",".join(map(short, JOBS)), help="the jobs to run, by their name's first word")
    parser.add_argument("--out", default="benchmarks/results/fit_cost.json")
    args = parser.parse_args()
    wanted = args.jobs.split(",")
    jobs = {name: job for name, job in JOBS.items() if short(name) in wanted}
    results = {name: measure(make, small, large, args.repeats, args.data_dir) for name, (make, small, large) in jobs.items()}
    rows = [(name, jobs[name][2], r["fixed_s"], r["per_batch_s"], r["large_fit_s"], r["fixed_share"]) for name, r in results.items()]
    print(table(["job", "batches a large fit", "fixed s a fit", "s a batch", "s a large fit", "fixed share"], rows))
    write_results(args.out, {"repeats": args.repeats, "jobs": results})


if __name__ == "__main__":
    main()
