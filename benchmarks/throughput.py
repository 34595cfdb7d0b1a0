"""Throughput of LeNet on MNIST (batch 128) with N workers on this machine, against the peers.

    python -m benchmarks throughput --workers 2 --steps 200

Contenders, one after another in this run, each worker training `steps` batches of its own:
  ceiling      N independent single-thread processes, no communication at all
  ddp          DistributedDataParallel, N processes, gloo
  pma k        PyTorch's PeriodicModelAverager (local SGD, parameters only), period k
  wrapper k    this project, AVERAGING every k iterations (parameters and optimizer state)
  overlap k    the same with .overlap_averaging(True): each averaging runs during the next k steps
  params k     the wrapper with .average_updaters(False): parameters only, PMA's bytes
  threads      one process with N threads on the same batches
  auto         (--auto) the wrapper with .averaging_frequency("auto"): k chosen each round
Steady state counts the samples after each worker's first `warmup` steps; end to end is the wall
time from launch to the last process's exit, start-up included. The contenders take turns, round
after round, the order rotating by one each round; the ratios are the medians of each round's
ratio to the ceiling, DDP and PMA (same k) of that round, so that the machine's drift over a run
(up to 16% between repeats of one contender here) cancels, as it would not in a ratio of medians. For the wrapper's contenders, the
share of rank 0's time after the warm-up spent in exchanges (its Scores' exchange_s), not in steps;
for PMA, in its average_parameters calls.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import BATCH, DEFAULT_DATA_DIR, lenet, median_ratio, mnist_batches, nesterov, rotated, run_processes, table, timed_fit, write_results


def _peer(rank: int, world: int, kind: str, k: int, steps: int, warmup: int, data_dir: str) -> dict[str, float]:
    batches = mnist_batches(data_dir)[rank::world][:steps]
    model = lenet()
    optimizer = nesterov(model)
    net: nn.Module = DistributedDataParallel(model) if kind == "ddp" else model
    with warnings.catch_warnings():  # k = 1 is measured on purpose: it warns that DDP is better
        warnings.filterwarnings("ignore", message="When period is 1")
        averager = PeriodicModelAverager(period=k, warmup_steps=0) if kind == "pma" else None
    if dist.is_initialized():
        dist.barrier()
    start = time.monotonic()
    samples, averaging = 0, 0.0
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            start, samples, averaging = time.monotonic(), 0, 0.0
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        if averager is not None:
            before = time.monotonic()
            averager.average_parameters(model.parameters())
            averaging += time.monotonic() - before
        samples += len(y)
    end = time.monotonic()
    return {"start": start, "end": end, "samples": samples, "exchange_share": averaging / (end - start)}


def _threads(rank: int, world: int, threads: int, steps: int, warmup: int, data_dir: str) -> dict[str, float]:
    torch.set_num_threads(threads)
    return _peer(0, 1, "alone", 1, steps * threads, warmup * threads, data_dir)


def peers(kind: str, world: int, k: int, steps: int, warmup: int, data_dir: str) -> dict[str, float]:
    wall = time.monotonic()
    if kind == "threads":
        parts = run_processes(_threads, 1, world, steps, warmup, data_dir, group=False)
    else:
        parts = run_processes(_peer, world, kind, k, steps, warmup, data_dir, group=kind != "ceiling")
    wall = time.monotonic() - wall
    if kind in ("ceiling", "threads"):  # independent processes: each at its own pace
        rate = sum(p["samples"] / (p["end"] - p["start"]) for p in parts)
    else:
        rate = sum(p["samples"] for p in parts) / (max(p["end"] for p in parts) - min(p["start"] for p in parts))
    result = {"samples_per_s": rate, "wall_s": wall}
    if kind == "pma":  # rank 0's share of its time in average_parameters, as the wrapper's Scores count theirs
        result["exchange_share"] = parts[0]["exchange_share"]
    return result


def wrapper(world: int, k: int, steps: int, warmup: int, data_dir: str, overlap: bool = False, updaters: bool = True, auto: bool = False) -> dict[str, float]:
    """Timed by each worker's clock after every backward (common.timed_fit): with overlap a
    round's Score arrives a round late, and a window of Scores would count a round more. `auto`:
    `.averaging_frequency("auto")`, its window cut at steps (k = 1), its rounds' k varying."""
    if auto:
        timed = timed_fit(world, 1, steps, warmup, data_dir, lambda b: b.averaging_frequency("auto"))
    else:
        timed = timed_fit(world, k, steps, warmup, data_dir, lambda b: b.overlap_averaging(overlap).average_updaters(updaters))
    return {"samples_per_s": world * BATCH * 1000.0 / timed["ms_per_step"], "wall_s": timed["wall_s"], "exchange_share": timed["exchange_share"]}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help="batches per worker")
    parser.add_argument("--warmup", type=int, default=20, help="batches per worker not timed")
    parser.add_argument("--frequencies", default="1,3,10")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all contenders; the median is reported")
    parser.add_argument("--auto", action="store_true", help='also the wrapper with .averaging_frequency("auto")')
    parser.add_argument("--only", default=None, help="run only these contenders, comma-separated names (e.g. 'ceiling,wrapper k=3,auto')")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/throughput.json")
    args = parser.parse_args(argv)
    n, steps, warmup = args.workers, args.steps, args.warmup
    frequencies = [int(f) for f in args.frequencies.split(",")]

    contenders: dict[str, Callable[[], dict[str, float]]] = {
        "ceiling": lambda: peers("ceiling", n, 1, steps, warmup, args.data_dir),
        "ddp": lambda: peers("ddp", n, 1, steps, warmup, args.data_dir),
        "threads": lambda: peers("threads", n, 1, steps, warmup, args.data_dir),
    }
    for k in frequencies:
        contenders[f"pma k={k}"] = functools.partial(peers, "pma", n, k, steps, warmup, args.data_dir)
        contenders[f"wrapper k={k}"] = functools.partial(wrapper, n, k, steps, warmup, args.data_dir)
        contenders[f"overlap k={k}"] = functools.partial(wrapper, n, k, steps, warmup, args.data_dir, overlap=True)
        contenders[f"params k={k}"] = functools.partial(wrapper, n, k, steps, warmup, args.data_dir, updaters=False)
    if args.auto:
        contenders["auto"] = functools.partial(wrapper, n, 1, steps, warmup, args.data_dir, auto=True)
    if args.only is not None:
        wanted = set(args.only.split(","))
        contenders = {name: run for name, run in contenders.items() if name in wanted}
    # Interleaved rounds, the order rotating: the machine's drift over minutes touches every contender alike.
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.repeats):
        for name in rotated(names, r):
            samples[name].append(contenders[name]())
        print(f"round {r + 1}/{args.repeats} done", flush=True)
    rates = {name: [x["samples_per_s"] for x in xs] for name, xs in samples.items()}

    def ratio(name: str, base: str) -> float:
        return median_ratio(rates[name], rates[base])

    runs = {
        name: {
            "samples_per_s": statistics.median(rates[name]),
            "wall_s": statistics.median(x["wall_s"] for x in xs),
            "all_samples_per_s": rates[name],
            "exchange_share": statistics.median(x["exchange_share"] for x in xs) if "exchange_share" in xs[0] else None,
            "vs_ceiling": ratio(name, "ceiling") if "ceiling" in rates else None,
            "vs_ddp": ratio(name, "ddp") if "ddp" in rates else None,
        }
        for name, xs in samples.items()
    }
    for name, r in runs.items():
        k = name.partition("k=")[2]
        r["vs_pma"] = ratio(name, f"pma k={k}") if k and f"pma k={k}" in rates else None
        if "auto" in rates and name.startswith("wrapper k="):
            r["auto_vs_this"] = ratio("auto", name)
    def cell(r: dict[str, Any], column: str) -> Any:
        return "-" if r.get(column) is None else r[column]

    rows = [
        (name, r["samples_per_s"], *(cell(r, c) for c in ("vs_ceiling", "vs_ddp", "vs_pma")), r["wall_s"], *(cell(r, c) for c in ("exchange_share", "auto_vs_this")))
        for name, r in runs.items()
    ]
    print(f"LeNet, MNIST, batch 128, {n} workers, {steps} batches each ({warmup} warm-up), median of {args.repeats}; ratios: medians of the rounds' ratios")
    print(table(["run", "steady samples/s", "/ ceiling", "/ DDP", "/ PMA", "end to end s", "rank 0's time in exchanges", "auto / this"], rows))
    write_results(args.out, {"workers": n, "steps": steps, "warmup": warmup, "repeats": args.repeats, "runs": runs})


if __name__ == "__main__":
    main()
