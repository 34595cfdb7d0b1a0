"""Seconds per shared-gradients step, threshold-encoded (`gradient_encoding`: encode, exchange,
decode) against the dense gradient all-reduce, at 10M parameters, two processes on loopback, for
a few densities; and a bare gloo all_reduce of the same float32 gradients.

    python benchmarks/encoding_cost.py [--densities 1e-3,1e-2,0.1]

A step is what a worker does between its backward and its optimizer step (rounds/exchange.py,
SyncExchange.launch then land): dense, the header's and the gradients' all-reduce in one flat
buffer, then the scale to the average; encoded, lr × gradients added to the residual, the
entries past τ encoded, the meta all-reduce (header, lengths), the messages to the other rank,
both decoded and averaged, and the gradients written back. Off the clock before each step, the
gradients get fixed random values and the residual is zeroed, with τ (fixed: adaptive=False) the
quantile of |lr × gradient| that sends the asked density: every step sends the same share.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from common import run_processes, table, write_results
from parallelwrapper.config import Config, GradientEncoding, TrainingMode
from parallelwrapper.job import Job
from parallelwrapper.rounds import Rounds
from parallelwrapper.rounds.encoded import EncodedGradients
from parallelwrapper.rounds.header import HEADER_LEN, Work
from parallelwrapper.worker import Replica

LR = 0.01
SHARED = TrainingMode.SHARED_GRADIENTS


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(2500, 4000)  # 10,004,000 parameters


def _step(rank: int, world: int, density: float | None) -> tuple[Callable[[], None], Callable[[], None], Rounds]:
    """One worker's gradient exchange, dense (density None) or encoded at `density`."""
    net = model()
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)) for p in net.parameters()]
    encoding = None
    if density is not None:
        tau = float(torch.quantile(torch.cat([g.reshape(-1) for g in grads]).abs()[:1_000_000] * LR, 1 - density))
        encoding = GradientEncoding(threshold=tau, adaptive=False, residual_clip=None)
    job = Job(net, torch.optim.SGD, {"lr": LR}, nn.functional.mse_loss, None)
    config, cpu = Config(workers=world, training_mode=SHARED, gradient_encoding=encoding), torch.device("cpu")
    rounds = Rounds(Replica(net, job, config, cpu, rank, world), config, cpu, rank, world)
    sync = rounds._sync

    def prepare() -> None:
        sync.prepare(False)
        for p, g in zip(net.parameters(), grads, strict=True):
            assert p.grad is not None
            p.grad.copy_(g)
        if sync.residual is not None:
            sync.residual.values.zero_()

    def step() -> None:
        sync.land(sync.launch(Work(samples=128, loss_sum=1.0), False, False))

    prepare()
    step()  # the first round sends its header alone; from here on, the steady state
    return step, prepare, rounds


def _measure(rank: int, world: int, densities: list[float], seconds: float) -> dict[str, object]:
    contenders: dict[str, tuple[Callable[[], None], Callable[[], None], Rounds | None]] = {"dense": _step(rank, world, None)}
    for d in densities:
        contenders[f"{d:g}"] = _step(rank, world, d)
    flat = torch.randn(sum(p.numel() for p in model().parameters()))

    def bare() -> None:
        dist.all_reduce(flat)

    contenders["bare"] = (bare, lambda: None, None)
    start = time.perf_counter()
    for fn, prepare, _ in contenders.values():
        prepare()
        fn()
    each = (time.perf_counter() - start) / len(contenders)
    repeats = torch.tensor(min(200, max(10, round(seconds / (len(contenders) * each)))))
    dist.broadcast(repeats, src=0)
    times: dict[str, list[float]] = {key: [] for key in contenders}
    items = list(contenders.items())
    for i in range(int(repeats)):  # alternated, each first in turn
        for key, (fn, prepare, _) in items if i % 2 == 0 else items[::-1]:
            prepare()
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    out: dict[str, object] = {"repeats": int(repeats), **{f"{key}_s": statistics.median(v) for key, v in times.items()}}
    for key, (_, _, rounds) in contenders.items():
        payload = None if rounds is None else rounds._sync._payload
        if isinstance(payload, EncodedGradients) and payload.last is not None:
            out[f"{key}_density"], out[f"{key}_bytes"] = payload.last.density, payload.last.bytes_sent
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--densities", default="1e-3,1e-2,0.1", help="shares of the entries sent, comma-separated")
    parser.add_argument("--seconds", type=float, default=30.0, help="measuring time (medians of 10 to 200 steps of each contender)")
    parser.add_argument("--out", default="benchmarks/results/encoding_cost.json")
    args = parser.parse_args()
    densities = [float(d) for d in args.densities.split(",")]
    r = run_processes(_measure, 2, densities, args.seconds)[0]
    numel = sum(p.numel() for p in model().parameters())
    dense_bytes = (numel + HEADER_LEN) * 4 * 2 * (2 - 1) / 2  # a ring's 2(N - 1)/N of gradients | header, float32
    print(f"{numel:,} parameters, 2 processes, gloo on loopback, medians of {r['repeats']} steps; ratios to the dense step")
    headers = ["step", "density sent", "ms", "/ dense", "bytes sent per worker", "/ dense"]
    rows: list[list[object]] = [["dense all-reduce", 1.0, r["dense_s"] * 1e3, 1.0, dense_bytes, 1.0]]  # type: ignore[operator]
    for d in densities:
        key = f"{d:g}"
        rows.append([f"encoded at {key}", r[f"{key}_density"], r[f"{key}_s"] * 1e3, r[f"{key}_s"] / r["dense_s"], r[f"{key}_bytes"], r[f"{key}_bytes"] / dense_bytes])  # type: ignore[operator]
    rows.append(["bare all_reduce", 1.0, r["bare_s"] * 1e3, r["bare_s"] / r["dense_s"], numel * 4.0, numel * 4.0 / dense_bytes])  # type: ignore[operator]
    print(table(headers, rows))
    write_results(args.out, {"parameters": numel, "densities": densities, "lr": LR, "rank0": r})


if __name__ == "__main__":
    main()
