"""How busy the workers' training threads are with `.overlap_averaging(True)`: rounds of N·k
batches in all, taken first-come (the default feed), against k batches each, dealt in turn
(`.deterministic(True)`), alternating, LeNet on MNIST, two workers of one thread each.

    python benchmarks/round_balance.py --repeats 5

For each worker, the CPU time of its training thread (its main thread, from /proc) over the
middle of the fit, as a share of the wall time: what is not 1 went to waiting (for the slower
worker at a landing, for a batch) or to other threads on its core.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from typing import Any

import torch

from common import DEFAULT_DATA_DIR, LR, MOMENTUM, lenet, mnist_batches, table, write_results
from parallelwrapper import ParallelWrapper, Score

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _main_thread_cpu_s() -> dict[int, float]:
    """CPU seconds of each worker's main thread (its task id is the process id)."""
    out = {}
    for p in multiprocessing.active_children():
        if p.name.startswith("parallelwrapper-worker") and p.pid is not None:
            with open(f"/proc/{p.pid}/task/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[p.pid] = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    return out


def run(batches: list[Any], k: int, deterministic: bool, skip: float) -> dict[str, Any]:
    """Samples/s and each training thread's busy share between `skip` and `1 - skip` of the fit."""
    marks: list[tuple[float, int, dict[int, float]]] = []
    total = len(batches)

    def mark(score: Score) -> None:
        if len(marks) < 2 and score.iteration >= total * (skip if not marks else 1 - skip):
            marks.append((time.monotonic(), score.samples, _main_thread_cpu_s()))

    builder = (
        ParallelWrapper.builder(lenet()).optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM, nesterov=True)
        .workers(2).threads_per_worker(1).averaging_frequency(k).overlap_averaging(True)
        .deterministic(deterministic).listeners(mark)
    )  # fmt: skip
    with builder.build() as w:
        w.fit(batches)
    (t0, s0, cpu0), (t1, s1, cpu1) = marks
    return {"samples_per_s": (s1 - s0) / (t1 - t0), "busy": sorted((cpu1[p] - cpu0[p]) / (t1 - t0) for p in cpu0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=1200, help="in all, both workers")
    parser.add_argument("--averaging-frequency", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/round_balance.json")
    args = parser.parse_args()
    data = mnist_batches(args.data_dir)
    batches = (data * (args.batches // len(data) + 1))[: args.batches]
    runs: dict[str, list[dict[str, Any]]] = {"first-come, N·k a round": [], "dealt, k each": []}
    for _ in range(args.repeats):
        runs["first-come, N·k a round"].append(run(batches, args.averaging_frequency, False, 0.2))
        runs["dealt, k each"].append(run(batches, args.averaging_frequency, True, 0.2))
    rows, result = [], {}
    for name, rs in runs.items():
        busy = [b for r in rs for b in r["busy"]]
        summary = {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
            "busy_mean": statistics.mean(busy),
            "busy_min": min(busy),
            "busy_of_both_mean": statistics.mean(sum(r["busy"]) for r in rs),
            "all": rs,
        }
        result[name] = summary
        rows.append((name, summary["samples_per_s"], summary["busy_mean"], summary["busy_min"]))
    print(f"LeNet, MNIST, batch 128, 2 workers x 1 thread, overlap, k={args.averaging_frequency}, {args.batches} batches, {args.repeats} repeats")
    print(table(["feed", "samples/s (median)", "training thread busy (mean)", "busy (lowest)"], rows))
    write_results(args.out, {"batches": args.batches, "k": args.averaging_frequency, "repeats": args.repeats, "runs": result})


if __name__ == "__main__":
    main()
