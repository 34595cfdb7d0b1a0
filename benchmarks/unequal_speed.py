"""Workers of unequal speed: LeNet on MNIST, 2 workers, k = 8, one epoch, worker 1 made about
2x slower by sleeping after its forward for one step's time (it takes no core meanwhile, as a
slower machine would not). Throughput is reported as a share of the same host at equal
speeds: 0.5 is lockstep with the slow worker, 0.75 each worker at its own pace (the ideal).

    python benchmarks/unequal_speed.py [--batches 469] [--repeats 2] [--out benchmarks/results/unequal_speed.json]

Contenders, each slowed and at equal speeds: spawned workers with the default feed (a list:
claimed first-come, feed/claims.py), `.deterministic(True)` (dealt i mod N), `.feed("queue")`, and
`torchrun --nproc-per-node 2` (a list: claimed from torchrun's store). Samples/s are the steady
state between the first score past a warm-up and the last; a contender's share is the median of
its repeats' slowed/equal ratios, each pair run back to back (contenders in rotated order); the
test accuracy is the averaged model's after the epoch (the last repeat's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common import DEFAULT_DATA_DIR, LR, MOMENTUM, lenet, machine, median_ratio, mnist_batches, rotated, table, write_results
from parallelwrapper import ParallelWrapper, Score

K, WARMUP = 8, 40


class Paced(nn.Module):
    """LeNet whose worker `slow` sleeps `delay` seconds after each training forward."""

    def __init__(self, delay: float, slow: int = 1) -> None:
        super().__init__()
        self.net, self.delay, self.slow = lenet(), delay, slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        if self.training and self.delay and dist.is_initialized() and dist.get_rank() == self.slow:
            time.sleep(self.delay)
        return out


def step_time(batches: list[Any]) -> float:
    """One training step of LeNet on one thread here, in seconds (the median of 30)."""
    torch.set_num_threads(1)
    model, times = lenet(), []
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True)
    for x, y in batches[:40]:
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return sorted(times[10:])[len(times[10:]) // 2]


def train(batches: list[Any], test: list[Any], delay: float, feed: str) -> dict[str, float]:
    """One epoch with this feed ("auto", "dealt" or "queue"); samples/s and test accuracy."""
    scores: list[Score] = []
    builder = (
        ParallelWrapper.builder(Paced(delay)).optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM, nesterov=True)
        .loss_fn(nn.functional.cross_entropy).workers(2).threads_per_worker(1).averaging_frequency(K).listeners(scores.append)
    )  # fmt: skip
    if feed == "dealt":
        builder.deterministic(True)
    elif feed == "queue":
        builder.feed("queue")
    with builder.build() as w:
        w.fit(batches)
        result = w.evaluate(test) if w.is_main else {"accuracy": float("nan")}
    first = next(s for s in scores if s.iteration >= WARMUP) if scores else None
    rate = (scores[-1].samples - first.samples) / (scores[-1].seconds - first.seconds) if first and scores else float("nan")
    return {"samples_per_s": rate, "accuracy": result["accuracy"]}


def torchrun(args: argparse.Namespace, delay: float) -> dict[str, float]:
    """The same epoch under `torchrun --nproc-per-node 2`, rank 0's figures."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rank0.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2", __file__,
            "--child", str(out), "--delay", str(delay), "--batches", str(args.batches), "--data-dir", args.data_dir,
        ]  # fmt: skip
        subprocess.run(command, check=True, env=env, cwd=Path(__file__).parent, timeout=900, capture_output=True)
        result: dict[str, float] = json.loads(out.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=469, help="training batches of 128 (469: one epoch)")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs per contender; the share is the median of their ratios")
    parser.add_argument("--out", default="benchmarks/results/unequal_speed.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a torchrun rank: write rank 0's figures here
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = mnist_batches(args.data_dir)[: args.batches]
    test = mnist_batches(args.data_dir, split="test", batch=1000)
    if args.child:
        result = train(batches, test, args.delay, "auto")
        if int(os.environ["RANK"]) == 0:
            Path(args.child).write_text(json.dumps(result))
        return
    delay = step_time(batches)
    print(f"one step of LeNet on one thread: {delay * 1e3:.1f} ms; worker 1 sleeps that long after each forward", flush=True)
    contenders = {
        "spawned, default feed (claims)": lambda d: train(batches, test, d, "auto"),
        "spawned, deterministic (dealt)": lambda d: train(batches, test, d, "dealt"),
        "spawned, feed('queue')": lambda d: train(batches, test, d, "queue"),
        "torchrun --nproc-per-node 2 (claims)": lambda d: torchrun(args, d),
    }
    runs: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {name: [] for name in contenders}
    for r in range(args.repeats):  # each contender's equal and slowed runs back to back, in rotated order
        for name in rotated(list(contenders), r):
            runs[name].append((contenders[name](0.0), contenders[name](delay)))
            equal, slowed = runs[name][-1]
            print(f"{name}, repeat {r}: share {slowed['samples_per_s'] / equal['samples_per_s']:.3f} of equal speeds", flush=True)
    results: dict[str, Any] = {}
    for name, pairs in runs.items():
        share = median_ratio([s["samples_per_s"] for _, s in pairs], [e["samples_per_s"] for e, _ in pairs])
        equal, slowed = pairs[-1]
        results[name] = {"runs": pairs, "equal": equal, "slowed": slowed, "share": share, "of_ideal": share / 0.75}
    rows = [
        [name, f"{r['equal']['samples_per_s']:.0f}", f"{r['slowed']['samples_per_s']:.0f}", f"{r['share']:.3f}", f"{r['of_ideal']:.3f}",
         f"{r['equal']['accuracy']:.4f}", f"{r['slowed']['accuracy']:.4f}"]
        for name, r in results.items()
    ]  # fmt: skip
    print(table(["host and feed", "equal samples/s (last)", "slowed samples/s (last)", "share (median)", "of ideal 0.75", "accuracy equal", "slowed"], rows))
    write_results(args.out, {"machine": machine(), "k": K, "batches": len(batches), "delay_s": delay, "results": results})


if __name__ == "__main__":
    main()
