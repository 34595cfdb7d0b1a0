"""Can a run measure, as it trains, what a longer round costs in loss? Online signals against the cost itself (issue 52).

    python -m benchmarks loss_side --steps 640 --k 8,32,128 --jobs 2x128 --seeds 0,1,2,3 [--batch 8] --out benchmarks/results/loss_side_seeds.json

The autopilot chooses k from time alone. Issue 52 asks it to weigh what a shorter round buys in
loss. The cost, measured after the fact (race.doubling_cost): the steps a run at the longer k took
to each validation loss of the run at the shorter one, as β, more steps per doubling of k. With a
cost β per doubling, doubling k pays while exchanges take more than 2β / (1 + β) of the time, so a
policy that knew β as it ran could set its exchange share from it. One seed's β is noisy (on a
4-layer model k = 128 once ended below k = 32, a negative cost), so every k runs each of `--seeds`
(its model and its batches, the same at every k) and β is read on the seeds' mean curves.

The signals, each measured at every round's end at the shorter k:
- "gain", the average's worth on the replicas' own last batches: each replica scores its last
  batch on its own model, and again on the average (eval mode, no gradients). The replicas part
  between averages, and the loss they train at is above their average's by up to g at a round's
  end; so a round of k costs about g / 2 in loss, one of 2k about g (the error term of
  local-update SGD grows with k: Wang & Joshi, Cooperative SGD, arXiv 1808.07576). That extra
  g / 2 is as many more steps as the loss curve takes to fall that far: with the curve's fall per
  e-fold of steps b (a least-squares fit of the rounds' mean training losses on ln steps, over the
  last rounds), β̂ = g / (2b);
- "fresh", the same on a batch no replica trains on (the replicas' mean loss on it over the
  average's: a Jensen gap, without the bias of a batch a replica has just fitted), β̂ = g / (2b);
- "disagreement", what AutoLoCo (arXiv 2609.36662) steers by: the replicas' moves since the
  round's start, their mean squared distance from their mean over the mean's square (the
  gradient noise over the signal), reported as it is, to set beside β's trend.

Both sides on the same job, in one process, with no link (the loss does not depend on it):
REPLICAS replicas of the GPT arena's model (gpt_arena.py) train with AdamW (lr `--lr`, β 0.9/0.95,
weight decay 0.1) on their own batches of `--batch` windows, their parameters averaged every k
steps (PeriodicModelAverager's and int8-parameters' algorithm, in float32), for each k of `--k`;
the average's validation loss every `--eval-every` steps. For each pair of neighbouring k, the cost
per doubling measured between the two (race.doubling_cost, from a third of the run on) stands
beside the signals at the shorter k, over the same part of its run.
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
from torch.nn.utils import parameters_to_vector

from benchmarks import gpt_arena
from benchmarks.common import table, write_results
from benchmarks.race import doubling_cost

REPLICAS = 2
CURVE = 32  # the rounds the loss curve's slope is fitted over, as the autopilot would
FRESH_SEED = 10_000  # the unseen batches' stream: seed + this


def train(text: torch.Tensor, val: list[gpt_arena.Batch], k: int, steps: int, eval_every: int, seed: int, layers: int, width: int,
          batch: int = 16, lr: float = 1e-3) -> dict[str, Any]:
    """One run at `k`: the average's validation loss every `eval_every` steps ("points"), and at
    every round's end the gains and the curve's slope so far ("probes"): "gain" on each replica's
    last batch, "fresh" on a batch no replica trains on (a stream of its own, so that the training
    batches are the same with or without it), and the replicas' "disagreement" (the module's
    docstring)."""
    torch.manual_seed(seed)
    start = gpt_arena.CharGPT(layers, width, max(1, width // 32))
    replicas = [copy.deepcopy(start) for _ in range(REPLICAS)]
    inner = [torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1) for m in replicas]
    stream = gpt_arena.train_batches(text, batch, steps * REPLICAS, seed)
    unseen = gpt_arena.train_batches(text, batch, -(-steps // k), seed + FRESH_SEED)
    points = [{"steps": 0, "val_loss": gpt_arena.val_loss(replicas[0], val)}]
    curve: list[tuple[float, float]] = []
    probes: list[dict[str, float]] = []
    for first in range(0, steps, k):
        began = parameters_to_vector(replicas[0].parameters()).detach()  # every replica's, the last average
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
        fresh = next(unseen)
        before = [gpt_arena.val_loss(model, [b]) for model, b in zip(replicas, last)]  # eval mode, no gradients
        moves = [parameters_to_vector(model.parameters()).detach() - began for model in replicas]
        mean_move = torch.stack(moves).mean(0)
        apart_moves = statistics.fmean(float((m - mean_move).square().sum()) for m in moves)
        apart = statistics.fmean(gpt_arena.val_loss(model, [fresh]) for model in replicas)
        _average(replicas)
        after = [gpt_arena.val_loss(replicas[0], [b]) for b in last]
        done = first + k
        curve = [*curve[1 - CURVE:], (float(done), statistics.fmean(losses))]
        probes.append({"steps": done, "gain": statistics.fmean(b - a for b, a in zip(before, after)),
                       "fresh": apart - gpt_arena.val_loss(replicas[0], [fresh]), "slope": _slope(curve),
                       "disagreement": apart_moves / float(mean_move.square().sum())})
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


def estimate(run: dict[str, Any], signal: str = "gain") -> float:
    """The signal's β̂ at a run's k, over the part of its run doubling_cost measures (from a third on):
    the median of g / (2b) where g is the mean of its probes' `signal` ("gain" or "fresh") over the
    last four rounds and b the curve's fall."""
    probes = run["probes"]
    out = []
    for i, p in enumerate(probes):
        if p["steps"] < run["points"][-1]["steps"] / 3 or not p["slope"] < 0:
            continue
        gain = statistics.fmean(q[signal] for q in probes[max(0, i - 3): i + 1])  # the autopilot's mean of the last four
        out.append(gain / (2 * -p["slope"]))
    return statistics.median(out) if out else math.nan


def disagreement(run: dict[str, Any]) -> float:
    """A run's median disagreement over the part of its run doubling_cost measures (from a third
    on): at a round's end, the replicas' moves since its start, their mean squared distance from
    their mean over the mean's square (noise over signal)."""
    return float(statistics.median(p["disagreement"] for p in run["probes"] if p["steps"] >= run["points"][-1]["steps"] / 3))


def _mean_points(runs: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """The validation losses of one k's runs (one a seed, scored at the same steps), averaged."""
    return [{"steps": ps[0]["steps"], "val_loss": statistics.fmean(p["val_loss"] for p in ps)} for ps in zip(*(r["points"] for r in runs))]


def _beta(short: list[dict[str, Any]], long: list[dict[str, Any]], ratio: float) -> float:
    measured = doubling_cost(short, long, ratio)
    return statistics.median(measured) if measured else math.nan


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks loss_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=640, help="steps a replica")
    parser.add_argument("--k", default="8,32,128", help="the rounds' k, each the one before times a power of 2")
    parser.add_argument("--eval-every", type=int, default=128, help="steps between validation losses (a multiple of every k)")
    parser.add_argument("--jobs", default="2x128,4x192", help="the GPT arena's LAYERSxWIDTH, comma-separated")
    parser.add_argument("--batch", type=int, default=16, help="windows a replica's batch")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--seeds", default="0", help="comma-separated; every k runs each seed (its model and batches), and the cost is read on the seeds' mean curves")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    ks = [int(k) for k in args.k.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    if any(args.eval_every % k for k in ks):
        raise SystemExit(f"loss_side: --eval-every {args.eval_every} must be a multiple of every k in {ks}")
    text, val_text = gpt_arena.corpus()
    val = gpt_arena.val_batches(val_text, limit=4)
    rows: list[list[Any]] = []
    runs: dict[str, list[list[dict[str, Any]]]] = {}  # by job, by seed, by k
    for job in args.jobs.split(","):
        layers, width = map(int, job.split("x"))
        runs[job] = [[train(text, val, k, args.steps, args.eval_every, seed, layers, width, args.batch, args.lr) for k in ks] for seed in seeds]
        by_k = list(zip(*runs[job]))  # each k's runs, one a seed
        for i in range(len(ks) - 1):
            ratio = ks[i + 1] / ks[i]
            beta = _beta(_mean_points(by_k[i]), _mean_points(by_k[i + 1]), ratio)
            each = [_beta(a["points"], b["points"], ratio) for a, b in zip(by_k[i], by_k[i + 1])]
            row = [f"{layers} layers, width {width}", f"{ks[i]} to {ks[i + 1]}", f"{beta:.2%}", " / ".join(f"{b:.2%}" for b in each)]
            for signal in ("gain", "fresh"):
                estimated = statistics.fmean(estimate(run, signal) for run in by_k[i])
                row += [f"{estimated:.2%}", f"{estimated / beta:.2f}"]
            row.append(f"{statistics.fmean(disagreement(run) for run in by_k[i]):.3g}")
            rows.append(row)
            print(" | ".join(map(str, row)), flush=True)
    print(table(["job", "k", "cost per doubling, the seeds' mean curves", "each seed's", "the last batch's gain: estimate", "over measured",
                 "an unseen batch's gain: estimate", "over measured", "the replicas' disagreement"], rows))
    if args.out:
        write_results(args.out, {"settings": vars(args), "runs": runs, "table": rows})


if __name__ == "__main__":
    main()
