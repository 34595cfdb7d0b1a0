"""Seconds per averaging (parameters plus optimizer state) against a bare gloo all_reduce of the
same bytes, for models of about 0.4M, 10M and 50M parameters, two processes, in one run; and what
an outer optimizer's step (SGD, Nesterov momentum: DiLoCo's) and a bfloat16 payload add to it.

    python benchmarks/averaging_cost.py

An averaging is what a worker does at the end of a round (rounds/engine.py, Rounds.exchange): the header
all-reduce and the all-reduce of params | buffers | SGD momentum, which live in one flat buffer,
sent together, then one pass that scales the sum to the average. The bare all_reduce sends one
float32 buffer of the same number of elements, preallocated and filled with random values (gloo
sums a buffer of zeros measurably faster than one of real values).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from common import lenet, run_processes, table, write_results
from parallelwrapper.config import Config, Job, OuterSpec
from parallelwrapper.rounds.header import Work
from parallelwrapper.worker import Replica


def model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "lenet":
        return lenet()  # 431,080 parameters
    width, depth = {"mlp-10M": (2048, 2), "mlp-50M": (4096, 3)}[name]
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


VARIANTS = {
    "ours": ({}, None),
    "outer": ({}, OuterSpec(torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})),
    "bf16": ({"payload_dtype": "bfloat16"}, None),
}


def _averaging(name: str, rank: int, world: int, variant: str) -> tuple[Callable[[], None], int]:
    """An averaging of one replica, in the steady state, and the numbers it averages."""
    options, outer = VARIANTS[variant]
    net = model(name)
    job = Job(net, torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}, nn.functional.mse_loss, None, outer_optimizer=outer)
    replica = Replica(net, job, Config(workers=world, **options), torch.device("cpu"), rank, world)
    for p in net.parameters():  # one step, so that the momentum buffers exist
        p.grad = torch.randn_like(p)
    replica.optimizer.step()

    def averaging() -> None:  # (a bfloat16 payload's deltas are 0 here: gathering them does no arithmetic on them)
        replica.rounds.exchange(Work(samples=128, loss_sum=1.0))

    averaging()  # builds the flat buffers
    averaging()  # learns the common reference weight: from here on, the steady state
    assert replica.rounds._payload is not None
    return averaging, replica.rounds._payload.numel


def _measure(rank: int, world: int, name: str, seconds: float) -> dict[str, float]:
    averagings = {variant: _averaging(name, rank, world, variant) for variant in VARIANTS}
    averaging, numel = averagings["ours"]
    flat = torch.randn(numel)  # values like a model's: a buffer of zeros reduces faster

    def bare() -> None:
        dist.all_reduce(flat)

    start = time.perf_counter()
    for _ in range(3):
        bare()
    contenders = [(variant, fn) for variant, (fn, _) in averagings.items()] + [("bare", bare)]
    # Rank 0's count for all: as many rounds of the contenders as fit in `seconds`, within [20, 2000].
    each = (time.perf_counter() - start) / 3
    repeats = torch.tensor(min(2000, max(20, round(seconds / (len(contenders) * each)))))
    dist.broadcast(repeats, src=0)
    times: dict[str, list[float]] = {key: [] for key, _ in contenders}
    for i in range(int(repeats)):  # alternated, each first in turn: the one after a barrier runs slower
        for key, fn in contenders if i % 2 == 0 else contenders[::-1]:
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {
        "parameters": sum(p.numel() for p in model(name).parameters()),
        "numel": numel,
        "repeats": int(repeats),
        **{f"{key}_s": statistics.median(values) for key, values in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="lenet,mlp-10M,mlp-50M")
    parser.add_argument("--seconds", type=float, default=20.0, help="measuring time per model (medians of 20 to 2000 rounds of the contenders)")
    parser.add_argument("--out", default="benchmarks/results/averaging_cost.json")
    args = parser.parse_args()
    results = {}
    for name in args.models.split(","):
        r0 = run_processes(_measure, 2, name, args.seconds)[0]
        r0["ratio"] = r0["ours_s"] / r0["bare_s"]
        r0["outer_ratio"], r0["bf16_ratio"] = r0["outer_s"] / r0["ours_s"], r0["bf16_s"] / r0["ours_s"]
        results[name] = r0
    rows = [
        (name, r["parameters"], r["numel"] * 4 / 2**20, r["repeats"], r["ours_s"] * 1e3, r["bare_s"] * 1e3, r["ratio"],
         r["outer_s"] * 1e3, r["outer_ratio"], r["bf16_s"] * 1e3, r["bf16_ratio"])
        for name, r in results.items()
    ]  # fmt: skip
    print("2 processes, gloo on loopback, medians; the outer step and the bfloat16 payload as ratios to the plain averaging")
    headers = ["model", "parameters", "MiB averaged", "rounds", "averaging ms", "bare all_reduce ms", "ratio",
               "+ outer ms", "outer ratio", "bf16 payload ms", "bf16 ratio"]  # fmt: skip
    print(table(headers, rows))
    write_results(args.out, {"seconds": args.seconds, "models": results})


if __name__ == "__main__":
    main()
