"""Seconds per averaging (parameters plus optimizer state) against a bare gloo all_reduce of the
same bytes, for models of about 0.4M, 10M and 50M parameters, two processes, in one run; and what
an outer optimizer's step (SGD, Nesterov momentum: DiLoCo's) and each compressed payload
(`payload_dtype` bfloat16, float16, int8, int4: the change since the last average, encoded with
error feedback, codec.py) cost against the plain float32 averaging, with the bytes each sends.

    python benchmarks/averaging_cost.py

An averaging is what a worker does at the end of a round (rounds/engine.py, Rounds.exchange): the
all-reduce of params | buffers with the header, then the SGD momentum's (in a buffer of its own,
which a training worker lands at its next step: here at once, on the clock), and the passes that
scale the sums to the average. The bare all_reduce sends one
float32 buffer of the same number of elements, preallocated and filled with random values (gloo
sums a buffer of zeros measurably faster than one of real values). Before each compressed
averaging, off the clock, every parameter moves by a small random step, so that the payloads
encode a change of real values, as after a round of training, not zeros.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from common import lenet, run_processes, table, write_results
from parallelwrapper.config import Config
from parallelwrapper.job import Job, OuterSpec
from parallelwrapper.rounds import Rounds
from parallelwrapper.rounds.header import Work
from parallelwrapper.worker import Replica


def model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "lenet":
        return lenet()  # 431,080 parameters
    width, depth = {"mlp-10M": (2048, 2), "mlp-50M": (4096, 3)}[name]
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


CODED = {"bf16": "bfloat16", "fp16": "float16", "int8": "int8", "int4": "int4"}
VARIANTS = {
    "ours": ({}, None),
    "outer": ({}, OuterSpec(torch.optim.SGD, {"lr": 0.7, "momentum": 0.9, "nesterov": True})),
    **{key: ({"payload_dtype": dtype}, None) for key, dtype in CODED.items()},
}


@dataclass
class Contender:
    averaging: Callable[[], None]  # on the clock
    prepare: Callable[[], None]  # before it, off the clock
    numel: int  # the numbers it averages
    nbytes: int  # one worker's payload in a steady-state round (FlatAverager.nbytes, as pw-fit compare counts)


def _averaging(name: str, rank: int, world: int, variant: str) -> Contender:
    """An averaging of one replica, in the steady state."""
    options, outer = VARIANTS[variant]
    net = model(name)
    job = Job(net, torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}, nn.functional.mse_loss, None, outer_optimizer=outer)
    config, cpu = Config(workers=world, **options), torch.device("cpu")
    replica = Replica(net, job, config, cpu, rank, world)
    rounds = Rounds(replica, config, cpu, rank, world)
    for p in net.parameters():  # one step, so that the momentum buffers exist
        p.grad = torch.randn_like(p)
    replica.optimizer.step()

    def averaging() -> None:
        rounds.exchange(Work(samples=128, loss_sum=1.0))

    params = list(net.parameters())
    steps = [torch.randn_like(p) * 1e-3 for p in params]

    def prepare() -> None:  # a round's change, which only a compressed payload encodes
        if variant in CODED:
            with torch.no_grad():
                torch._foreach_add_(params, steps)

    averaging()  # builds the flat buffers
    prepare()
    averaging()  # learns the common reference weight: from here on, the steady state
    payload = rounds._sync._payload
    assert payload is not None
    return Contender(averaging, prepare, payload.numel, payload.nbytes)


def _measure(rank: int, world: int, name: str, seconds: float, variants: list[str]) -> dict[str, float]:
    averagings = {variant: _averaging(name, rank, world, variant) for variant in variants}
    numel = averagings["ours"].numel
    flat = torch.randn(numel)  # values like a model's: a buffer of zeros reduces faster

    def bare() -> None:
        dist.all_reduce(flat)

    start = time.perf_counter()
    for _ in range(3):
        bare()
    contenders = [(variant, c.averaging, c.prepare) for variant, c in averagings.items()] + [("bare", bare, lambda: None)]
    # Rank 0's count for all: as many rounds of the contenders as fit in `seconds`, within [20, 2000].
    each = (time.perf_counter() - start) / 3
    repeats = torch.tensor(min(2000, max(20, round(seconds / (len(contenders) * each)))))
    dist.broadcast(repeats, src=0)
    times: dict[str, list[float]] = {key: [] for key, _, _ in contenders}
    for i in range(int(repeats)):  # alternated, each first in turn: the one after a barrier runs slower
        for key, fn, prepare in contenders if i % 2 == 0 else contenders[::-1]:
            prepare()
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {
        "parameters": sum(p.numel() for p in model(name).parameters()),
        "numel": numel,
        "repeats": int(repeats),
        **{f"{key}_s": statistics.median(values) for key, values in times.items()},
        **{f"{key}_bytes": c.nbytes for key, c in averagings.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="lenet,mlp-10M,mlp-50M")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}; ours, the plain averaging, is always run")
    parser.add_argument("--seconds", type=float, default=20.0, help="measuring time per model (medians of 20 to 2000 rounds of the contenders)")
    parser.add_argument("--out", default="benchmarks/results/averaging_cost.json")
    args = parser.parse_args()
    variants = ["ours", *(v for v in args.variants.split(",") if v != "ours")]
    coded = [v for v in variants if v in CODED]
    results = {}
    for name in args.models.split(","):
        r0 = run_processes(_measure, 2, name, args.seconds, variants)[0]
        r0["ratio"] = r0["ours_s"] / r0["bare_s"]
        for v in variants[1:]:
            r0[f"{v}_ratio"] = r0[f"{v}_s"] / r0["ours_s"]  # against the plain float32 averaging
        for v in coded:
            r0[f"{v}_bytes_ratio"] = r0[f"{v}_bytes"] / r0["ours_bytes"]
        results[name] = r0
    print("2 processes, gloo on loopback, medians; the outer step and the compressed payloads as ratios to the plain averaging")
    headers = ["model", "parameters", "MiB averaged", "rounds", "averaging ms", "bare all_reduce ms", "ratio"]
    headers += [f"{v} {what}" for v in variants[1:] for what in ("ms", "ratio")]
    rows = [
        [name, r["parameters"], r["numel"] * 4 / 2**20, r["repeats"], r["ours_s"] * 1e3, r["bare_s"] * 1e3, r["ratio"]]
        + [x for v in variants[1:] for x in (r[f"{v}_s"] * 1e3, r[f"{v}_ratio"])]
        for name, r in results.items()
    ]
    print(table(headers, rows))
    if coded:
        print("\nOne worker's payload in a steady-state round (FlatAverager.nbytes, as pw-fit compare counts it), and its share of float32's")
        headers = ["model", "float32 bytes", *(f"{v} bytes" for v in coded), *(f"{v} share" for v in coded)]
        rows = [[name, r["ours_bytes"], *(r[f"{v}_bytes"] for v in coded), *(r[f"{v}_bytes_ratio"] for v in coded)] for name, r in results.items()]
        print(table(headers, rows))
    write_results(args.out, {"seconds": args.seconds, "variants": variants, "models": results})


if __name__ == "__main__":
    main()
