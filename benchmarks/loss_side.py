"""Can a run measure, as it trains, what a longer round costs in loss? An online signal against the cost itself (issue 52).

    python -m benchmarks loss_side --steps 640 --k 8,32,128 --out benchmarks/results/loss_side.json

The autopilot chooses k from time alone. Issue 52 asks it to weigh what a shorter round buys in
loss. The cost, measured after the fact on the GPT arena (race.doubling_cost): each doubling of k
took 2.4-2.9% more steps to the same validation loss on the 2-layer model and 5.1% on the 4-layer
one. With a cost β per doubling, doubling k pays while exchanges take more than 2β / (1 + β) of
the time, so a policy that knew β as it ran could set its exchange share from it.

The signal tried here is the one a round can measure for two forward passes: its average's worth.
At a round's end each replica scores its last batch on its own model, and again on the average
(eval mode, no gradients); the mean difference is the gain g. The replicas part between averages,
and the loss they train at is above their average's by what the average buys, from none at a
round's start to g at its end; so a round of k costs about g / 2 in loss, one of 2k about g (the
error term of local-update SGD grows with k: Wang & Joshi, Cooperative SGD, arXiv 1808.07576).
That extra g / 2 is as many more steps as the loss curve takes to fall that far: with the curve's
fall per e-fold of steps b (a least-squares fit of the rounds' mean training losses on ln steps,
over the last rounds), β̂ = g / (2b).

Both sides on the same job, in one process, with no link (the loss does not depend on it):
REPLICAS replicas of the GPT arena's model (gpt_arena.py) train with AdamW (lr 1e-3, β 0.9/0.95,
weight decay 0.1) on their own batches of 16 windows, their parameters averaged every k steps
(PeriodicModelAverager's and int8-parameters' algorithm, in float32), for each k of `--k`; the
average's validation loss every `--eval-every` steps. For each pair of neighbouring k, the cost
per doubling measured between the two runs (race.doubling_cost, from a third of the run on)
stands beside the signal's estimate at the shorter k, over the same part of its run.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import gpt_arena
from benchmarks.common import table, write_results
from benchmarks.race import doubling_cost

REPLICAS = 2
CURVE = 32  # the rounds the loss curve's slope is fitted over, as the autopilot would


def train(text: torch.Tensor, val: list[gpt_arena.Batch], k: int, steps: int, eval_every: int, seed: int, layers: int, width: int) -> dict[str, Any]:
    """One run at `k`: the average's validation loss every `eval_every` steps ("points"), and at
    every round's end the gain and the curve's slope so far ("probes")."""
    torch.manual_seed(seed)
    start = gpt_arena.CharGPT(layers, width, max(1, width // 32))
    replicas = [copy.deepcopy(start) for _ in range(REPLICAS)]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1) for m in replicas]
    stream = gpt_arena.train_batches(text, 16, steps * REPLICAS, seed)
    points = [{"steps": 0, "val_loss": gpt_arena.val_loss(replicas[0], val)}]
    curve: list[tuple[float, float]] = []
    probes: list[dict[str, float]] = []
    for first in range(0, steps, k):
        losses: list[float] = []
        last: list[gpt_arena.Batch] = [None] * REPLICAS  # each replica's last batch of the round
        for _ in range(k):
            for i, (model, optimizer) in enumerate(zip(replicas, inner)):
                last[i] = next(stream)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(last[i][0]), last[i][1])
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                losses.append(float(loss.detach()))
        before = [gpt_arena.val_loss(model, [batch]) for model, batch in zip(replicas, last)]  # eval mode, no gradients
        _average(replicas)
        after = [gpt_arena.val_loss(replicas[0], [batch]) for batch in last]
        done = first + k
        curve = [*curve[1 - CURVE:], (float(done), statistics.fmean(losses))]
        probes.append({"steps": done, "gain": statistics.fmean(b - a for b, a in zip(before, after)), "slope": _slope(curve)})
        if done % eval_every == 0:
            points.append({"steps": done, "val_loss": gpt_arena.val_loss(replicas[0], val)})
    return {"k": k, "points": points, "probes": probes}


@torch.no_grad()
def _average(replicas: list[torch.nn.Module]) -> None:
    """Every replica's parameters set to their mean (the optimizers' state stays each replica's own)."""
    for ps in zip(*(m.parameters() for m in replicas)):
        mean = torch.stack([p.detach() for p in ps]).mean(0)
        for p in ps:
            p.copy_(mean)


def _slope(curve: list[tuple[float, float]]) -> float:
    """The loss per e-fold of steps: a least-squares line of the losses on ln steps (NaN below 2 points)."""
    xs, ys = [math.log(s) for s, _ in curve], [loss for _, loss in curve]
    if len(set(xs)) < 2:
        return math.nan
    return statistics.linear_regression(xs, ys).slope


def estimate(run: dict[str, Any]) -> float:
    """The signal's β̂ at a run's k, over the part of its run doubling_cost measures (from a third on):
    the median of g / (2b) where g is the mean gain of its probes so far at that k and b the curve's fall."""
    probes = run["probes"]
    out = []
    for i, p in enumerate(probes):
        if p["steps"] < run["points"][-1]["steps"] / 3 or not p["slope"] < 0:
            continue
        gain = statistics.fmean(q["gain"] for q in probes[max(0, i - 3): i + 1])  # the autopilot's mean of the last four
        out.append(gain / (2 * -p["slope"]))
    return statistics.median(out) if out else math.nan


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks loss_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=640, help="steps a replica")
    parser.add_argument("--k", default="8,32,128", help="the rounds' k, each the one before times a power of 2")
    parser.add_argument("--eval-every", type=int, default=128, help="steps between validation losses (a multiple of every k)")
    parser.add_argument("--jobs", default="2x128,4x192", help="the GPT arena's LAYERSxWIDTH, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    ks = [int(k) for k in args.k.split(",")]
    if any(args.eval_every % k for k in ks):
        raise SystemExit(f"loss_side: --eval-every {args.eval_every} must be a multiple of every k in {ks}")
    text, val_text = gpt_arena.corpus()
    val = gpt_arena.val_batches(val_text, limit=4)
    rows: list[list[Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    for job in args.jobs.split(","):
        layers, width = map(int, job.split("x"))
        runs[job] = [train(text, val, k, args.steps, args.eval_every, args.seed, layers, width) for k in ks]
        for short, long in zip(runs[job], runs[job][1:]):
            measured = doubling_cost(short["points"], long["points"], long["k"] / short["k"])
            beta = statistics.median(measured) if measured else math.nan
            signal = estimate(short)
            rows.append([f"{layers} layers, width {width}", f"{short['k']} to {long['k']}", f"{beta:.2%}", f"{signal:.2%}", f"{signal / beta:.2f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    print(table(["job", "k", "cost per doubling, measured", "the signal's estimate at the shorter k", "estimate / measured"], rows))
    if args.out:
        write_results(args.out, {"settings": vars(args), "runs": runs, "table": rows})


if __name__ == "__main__":
    main()
