"""Can a run measure, as it trains, what a longer round costs in loss? Online signals against the cost itself (issue 52).

    python -m benchmarks loss_side --steps 640 --k 8,32,128 --jobs 2x128 --seeds 0,1,2,3 [--batch 8] --out benchmarks/results/loss_side_seeds.json
    python -m benchmarks loss_side --steps 1280 --k 8,32,128 --jobs mlp256 --optimizer sgd --lr 0.05 --batch 32 --seeds 0,1,2,3,4,5,6,7

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
REPLICAS replicas of the job's model (`task`: the GPT arena's, gpt_arena.py, on its byte corpus;
or an MLP on MNIST) train with `--optimizer` (AdamW, lr `--lr`, β 0.9/0.95, weight decay 0.1; or
SGD with Nesterov momentum 0.9) on their own batches of `--batch` windows or images, their
parameters averaged every k steps (PeriodicModelAverager's and int8-parameters' algorithm, in
float32), for each k of `--k`; the average's validation loss every `--eval-every` steps. For each pair of neighbouring k, the cost
per doubling measured between the two (race.doubling_cost, from a third of the run on) stands
beside the signals at the shorter k, over the same part of its run.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from benchmarks import gpt_arena
from benchmarks.common import DEFAULT_DATA_DIR, table, write_results
from benchmarks.race import doubling_cost
from parallelwrapper.app.mnist import load_mnist

REPLICAS = 2
CURVE = 32  # the rounds the loss curve's slope is fitted over, as the autopilot would
FRESH_SEED = 10_000  # the unseen batches' stream: seed + this
Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, class targets


@dataclass(frozen=True)
class Task:
    """What a job trains: its model (seeded by the caller), its training batches and the batches
    no replica trains on (each `(batch, count, seed)`: `count` batches of `batch`, the same for a
    seed at every k), and its validation batches."""

    model: Callable[[], nn.Module]
    batches: Callable[[int, int, int], Iterator[Batch]]
    unseen: Callable[[int, int, int], Iterator[Batch]]
    val: list[Batch]


def task(job: str, data_dir: str = DEFAULT_DATA_DIR) -> Task:
    """`job` LAYERSxWIDTH: the GPT arena's model on its byte corpus, a batch `--batch` windows,
    validated on 4 batches of the held-out text; mlpWIDTH: an MLP 784-WIDTH-WIDTH-10 on MNIST's
    training images, shuffled epoch after epoch by the seed, validated on the first 5,000 test
    images, its unseen batches from the other 5,000."""
    if job.startswith("mlp"):
        width = int(job[3:])
        train_split, test = load_mnist(data_dir, "train", download=False), load_mnist(data_dir, "test", download=False)
        val, held = test.batches(1000)[:5], test.batches(1000)[5:]

        def mnist(batch: int, count: int, seed: int) -> Iterator[Batch]:
            epochs = (train_split.batches(batch, shuffle=True, seed=seed + e, drop_last=True) for e in itertools.count())
            return itertools.islice(itertools.chain.from_iterable(epochs), count)

        def fresh(batch: int, count: int, seed: int) -> Iterator[Batch]:
            g = torch.Generator().manual_seed(seed)
            images, labels = torch.cat([x for x, _ in held]), torch.cat([y for _, y in held])
            for _ in range(count):
                pick = torch.randint(0, len(labels), (batch,), generator=g)
                yield images[pick], labels[pick]

        def mlp() -> nn.Module:
            return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

        return Task(mlp, mnist, fresh, val)
    layers, width = map(int, job.split("x"))
    text, val_text = gpt_arena.corpus()

    def windows(batch: int, count: int, seed: int) -> Iterator[Batch]:
        return gpt_arena.train_batches(text, batch, count, seed)

    return Task(lambda: gpt_arena.CharGPT(layers, width, max(1, width // 32)), windows, windows, gpt_arena.val_batches(val_text, limit=4))


def optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """adamw: AdamW (β 0.9/0.95, weight decay 0.1), the GPT arena's; sgd: SGD with Nesterov momentum 0.9, the MNIST jobs'."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def train(job: Task, k: int, steps: int, eval_every: int, seed: int, batch: int = 16, lr: float = 1e-3, inner: str = "adamw") -> dict[str, Any]:
    """One run of `job` at `k`: the average's validation loss every `eval_every` steps ("points"),
    and at every round's end the gains and the curve's slope so far ("probes"): "gain" on each
    replica's last batch, "fresh" on a batch no replica trains on (a stream of its own, so that
    the training batches are the same with or without it), and the replicas' "disagreement" (the
    module's docstring). `inner`: each replica's optimizer (`optimizer`)."""
    torch.manual_seed(seed)
    start = job.model()
    replicas = [copy.deepcopy(start) for _ in range(REPLICAS)]
    optimizers = [optimizer(inner, m, lr) for m in replicas]
    stream = job.batches(batch, steps * REPLICAS, seed)
    unseen = job.unseen(batch, -(-steps // k), seed + FRESH_SEED)
    val = job.val
    points = [{"steps": 0, "val_loss": gpt_arena.val_loss(replicas[0], val)}]
    curve: list[tuple[float, float]] = []
    probes: list[dict[str, float]] = []
    for first in range(0, steps, k):
        began = parameters_to_vector(replicas[0].parameters()).detach()  # every replica's, the last average
        losses: list[float] = []
        last: list[Batch] = [None] * REPLICAS  # each replica's last batch of the round
        for _ in range(k):
            for i, (model, step) in enumerate(zip(replicas, optimizers)):
                last[i] = next(stream)
                step.zero_grad()
                loss = F.cross_entropy(model(last[i][0]), last[i][1])
                loss.backward()  # type: ignore[no-untyped-call]
                step.step()
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
    parser.add_argument("--jobs", default="2x128,4x192", help="comma-separated: the GPT arena's LAYERSxWIDTH, or mlpWIDTH, an MLP on MNIST (`task`)")
    parser.add_argument("--batch", type=int, default=16, help="a replica's batch: windows (GPT), images (MLP)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="each replica's (`optimizer`)")
    parser.add_argument("--lr", type=float, default=1e-3, help="its learning rate")
    parser.add_argument("--seeds", default="0", help="comma-separated; every k runs each seed (its model and batches), and the cost is read on the seeds' mean curves")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    ks = [int(k) for k in args.k.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    if any(args.eval_every % k for k in ks):
        raise SystemExit(f"loss_side: --eval-every {args.eval_every} must be a multiple of every k in {ks}")
    rows: list[list[Any]] = []
    runs: dict[str, list[list[dict[str, Any]]]] = {}  # by job, by seed, by k
    for job in args.jobs.split(","):
        this = task(job)
        runs[job] = [[train(this, k, args.steps, args.eval_every, seed, args.batch, args.lr, args.optimizer) for k in ks] for seed in seeds]
        by_k = list(zip(*runs[job]))  # each k's runs, one a seed
        for i in range(len(ks) - 1):
            ratio = ks[i + 1] / ks[i]
            beta = _beta(_mean_points(by_k[i]), _mean_points(by_k[i + 1]), ratio)
            each = [_beta(a["points"], b["points"], ratio) for a, b in zip(by_k[i], by_k[i + 1])]
            row = [job, f"{ks[i]} to {ks[i + 1]}", f"{beta:.2%}", " / ".join(f"{b:.2%}" for b in each)]
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
