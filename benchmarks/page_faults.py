"""Minor page faults and ms per step of the wrapper's workers against a bare loop's (issue 21,
item 4: where the default round's time goes). LeNet, MNIST, batch 128, 2 workers of one thread,
k = 3; the bare loop averages the parameters every k steps as PeriodicModelAverager does. Each
process counts its own faults (getrusage) and time after each backward (common.mark; the
wrapper's workers through common.stamp), over whole rounds after `--warmup` (common.window).

    python benchmarks/page_faults.py

The wrapper runs twice: as it is, its workers keeping their heap (processes.keep_heap), and with
PW_KEEP_HEAP=0, glibc left to its own thresholds. A fault maps a page the process touches for the
first time since the allocator gave memory back to the kernel: many faults a step mean the
allocator returns memory each step and takes it back.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from common import BATCH, DEFAULT_DATA_DIR, lenet, mark, mnist_batches, nesterov, per_step, run_processes, table, timed_fit, window, write_results


def _bare(rank: int, world: int, steps: int, k: int, warmup: int, data_dir: str) -> tuple[float, float]:
    batches = mnist_batches(data_dir)[rank::world][:steps]
    model = lenet()
    optimizer = nesterov(model)
    marks = []
    for i, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        marks.append(mark())  # where the wrapper's workers `stamp`: after the backward
        optimizer.step()
        if (i + 1) % k == 0:
            with torch.no_grad():
                params = list(model.parameters())
                flat = torch.cat([p.reshape(-1) for p in params]) / world
                dist.all_reduce(flat)
                torch._foreach_copy_(params, [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params)])
    return per_step(marks, *window(warmup, steps, k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="batches per worker")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/page_faults.json")
    args = parser.parse_args()

    def wrapper() -> list[tuple[float, float]]:
        return timed_fit(2, args.k, args.steps, args.warmup, args.data_dir, lambda b: b)["per_worker"]

    rows = []
    for name, results in (
        ("bare loop, PMA's averaging", run_processes(_bare, 2, args.steps, args.k, args.warmup, args.data_dir)),
        ("parallelwrapper, glibc's own heap", _glibcs_own(wrapper)),
        ("parallelwrapper, defaults", wrapper()),
    ):
        rows += [[name, rank, faults, ms] for rank, (faults, ms) in enumerate(results)]
    headers = ["run", "rank", "minor faults a step", "ms a step"]
    print(f"LeNet, batch {BATCH}, 2 workers, k = {args.k}")
    print(table(headers, rows))
    write_results(args.out, {"args": vars(args), "headers": headers, "rows": rows})


def _glibcs_own(fit: Callable[[], list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """`fit()` with PW_KEEP_HEAP=0 in the environment the workers take: they leave glibc's heap as
    it is."""
    os.environ["PW_KEEP_HEAP"] = "0"
    try:
        return fit()
    finally:
        del os.environ["PW_KEEP_HEAP"]


if __name__ == "__main__":
    main()
