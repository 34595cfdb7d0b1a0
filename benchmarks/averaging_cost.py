"""Seconds per averaging (parameters plus optimizer state) against a bare gloo all_reduce of the
same bytes, for models of about 0.4M, 10M and 50M parameters, two processes, in one run.

    python benchmarks/averaging_cost.py

An averaging is what a worker does at the end of a round: the header all-reduce, packing
params | buffers | SGD momentum into one flat buffer, the all-reduce, and unpacking. The bare
all_reduce sends one float32 buffer of the same number of elements, preallocated and filled
with random values (gloo sums a buffer of zeros measurably faster than one of real values).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from common import lenet, run_processes, table, write_results
from parallelwrapper.averaging import reduce_header
from parallelwrapper.config import Config, Job
from parallelwrapper.worker import Replica


def model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "lenet":
        return lenet()  # 431,080 parameters
    width, depth = {"mlp-10M": (2048, 2), "mlp-50M": (4096, 3)}[name]
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _measure(rank: int, world: int, name: str, repeats: int) -> dict[str, float]:
    net = model(name)
    job = Job(net, torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}, nn.functional.mse_loss, None)
    replica = Replica(net, job.make_optimizer(net), job, Config(workers=world), torch.device("cpu"), rank, world)
    for p in net.parameters():  # one step, so that the momentum buffers exist
        p.grad = torch.randn_like(p)
    replica.optimizer.step()

    def averaging() -> None:
        totals = reduce_header(
            samples=128, loss_sum=1.0, batches=1, finished=False, skipped=False,
            layout=replica._layout_hash(), device=replica.device, world_size=world,
        )  # fmt: skip
        replica._apply(totals, 128 / totals.samples)

    averaging()  # builds the flat buffers
    numel = replica._state_payload().numel
    flat = torch.randn(numel)  # values like a model's: a buffer of zeros reduces faster
    ours, bare = [], []
    for _ in range(repeats):  # alternated, so that drift touches both alike
        dist.barrier()
        start = time.perf_counter()
        averaging()
        ours.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        bare.append(time.perf_counter() - start)
    return {
        "parameters": sum(p.numel() for p in net.parameters()),
        "numel": numel,
        "ours_s": statistics.median(ours),
        "bare_s": statistics.median(bare),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="lenet,mlp-10M,mlp-50M")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="benchmarks/results/averaging_cost.json")
    args = parser.parse_args()
    results = {}
    for name in args.models.split(","):
        r0 = run_processes(_measure, 2, name, args.repeats)[0]
        r0["ratio"] = r0["ours_s"] / r0["bare_s"]
        results[name] = r0
    rows = [
        (name, r["parameters"], r["numel"] * 4 / 2**20, r["ours_s"] * 1e3, r["bare_s"] * 1e3, r["ratio"])
        for name, r in results.items()
    ]
    print(f"2 processes, gloo on loopback, median of {args.repeats}")
    print(table(["model", "parameters", "MiB averaged", "averaging ms", "bare all_reduce ms", "ratio"], rows))
    write_results(args.out, {"repeats": args.repeats, "models": results})


if __name__ == "__main__":
    main()
