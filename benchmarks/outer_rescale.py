"""What a change of k mid-run does to an outer optimizer's training, and what to do with its momentum.

    python -m benchmarks outer_rescale --seeds 0,1 --out benchmarks/results/outer_rescale.json

The autopilot changes k while a run trains; with `.outer_optimizer(SGD, momentum=μ, nesterov=True)`
(DiLoCo's outer step) the momentum then holds a sum of rounds' changes of the old length. This
races the ways to carry it over, on the algorithm alone (no processes, no link: N replicas in one
process, so that only the loss differs): the GPT arena's model and corpus (gpt_arena.py), AdamW
inside (lr 1e-3, β 0.9/0.95, weight decay 0.1, its state averaged every round), outer Nesterov SGD
at DiLoCo's lr 0.7 and momentum 0.9 (`--outer LR,MOMENTUM`; `--outer 1,0 --rules kept` is plain
averaging), `--steps` steps a replica, and the validation loss at the end.

Schedules: a fixed k (16 and 64 by default), k rising from 16 to 64 a quarter of the way in, and
falling from 64 to 16 half way in. Rules, applied to the outer momentum at the change (ratio r =
new k / old k):
    kept      as it is (what a library that does not know k changed does)
    units     times r: the momentum in units of the new rounds' change
    shrink    times min(1, r): smaller where rounds shorten, kept where they lengthen (the library's)
    horizon   times r, and the momentum's memory kept in steps: μ' = μ^r, lr' = lr·(1 − μ')/(1 − μ)
              (AutoLoCo's advice, rescaling the outer learning rate and momentum with the period)
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import gpt_arena
from benchmarks.common import table, write_results

REPLICAS = 2
RULES: dict[str, Callable[[float], tuple[float, bool]]] = {  # the momentum's factor at a change, and whether the horizon is kept
    "kept": lambda r: (1.0, False),
    "units": lambda r: (r, False),
    "shrink": lambda r: (min(1.0, r), False),
    "horizon": lambda r: (r, True),
}


def schedules(steps: int, low: int, high: int) -> dict[str, Callable[[int], int]]:
    """k at each step: fixed, rising a quarter of the way in, falling half way in."""
    return {
        f"k = {low}": lambda s: low,
        f"k = {high}": lambda s: high,
        f"{low} to {high}": lambda s: low if s < steps // 4 else high,
        f"{high} to {low}": lambda s: high if s < steps // 2 else low,
    }


def train(text: torch.Tensor, val: list[gpt_arena.Batch], k_at: Callable[[int], int], rule: str, outer_at: tuple[float, float],
          steps: int, seed: int, layers: int, width: int, context: int, batch: int) -> float:  # fmt: skip
    """Local AdamW on REPLICAS replicas of the training `text`, averaged through an outer SGD of
    (lr, momentum) `outer_at` (Nesterov where it has momentum) every k steps, k from `k_at`; `rule`
    carries the outer momentum over a change of k. The loss on `val` at the end."""
    torch.manual_seed(seed)
    start = gpt_arena.CharGPT(layers, width, max(1, width // 32), context)
    replicas = [copy.deepcopy(start) for _ in range(REPLICAS)]
    inner = [torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1) for m in replicas]
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in start.parameters()]
    lr, momentum = outer_at
    outer = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)
    stream = gpt_arena.train_batches(text, batch, steps * REPLICAS, seed, context)
    step, k_before = 0, None
    while step < steps:
        k = min(k_at(step), steps - step)
        if k_before is not None and k != k_before:
            carry_over(outer, k / k_before, rule)
        k_before = k
        for _ in range(k):
            for model, optimizer in zip(replicas, inner):
                x, y = next(stream)
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                optimizer.step()
            step += 1
        average(replicas, inner, anchor, outer)
    return gpt_arena.val_loss(replicas[0], val)


@torch.no_grad()
def carry_over(outer: torch.optim.Optimizer, ratio: float, rule: str) -> None:
    factor, horizon = RULES[rule](ratio)
    for state in outer.state.values():
        if state.get("momentum_buffer") is not None:
            state["momentum_buffer"].mul_(factor)
    if horizon:
        group = outer.param_groups[0]
        momentum = group["momentum"] ** ratio
        group["lr"] *= (1 - momentum) / (1 - group["momentum"])
        group["momentum"] = momentum


@torch.no_grad()
def average(replicas: list[torch.nn.Module], inner: list[torch.optim.Optimizer], anchor: list[torch.nn.Parameter], outer: torch.optim.Optimizer) -> None:
    """The outer step on Δ = anchor − mean(θ), every replica set to its result; AdamW's state averaged."""
    for a, *ps in zip(anchor, *(m.parameters() for m in replicas)):
        a.grad = a.detach() - torch.stack([p.detach() for p in ps]).mean(0)
    outer.step()
    for a, *ps in zip(anchor, *(m.parameters() for m in replicas)):
        for p in ps:
            p.copy_(a)
    for groups in zip(*(o.param_groups for o in inner)):
        for ps in zip(*(g["params"] for g in groups)):
            states = [o.state[p] for o, p in zip(inner, ps)]
            for key, value in states[0].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    mean = torch.stack([s[key] for s in states]).mean(0)
                    for s in states:
                        s[key].copy_(mean)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=512, help="steps a replica")
    parser.add_argument("--k", default="16,64", help="the short and the long round's k")
    parser.add_argument("--rules", default="kept,units,shrink,horizon", help="for the schedules that change k")
    parser.add_argument("--seeds", default="0,1", help="model init and batches, comma-separated")
    parser.add_argument("--outer", default="0.7,0.9", help="the outer SGD's LR,MOMENTUM (1,0: plain averaging)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=gpt_arena.CONTEXT)
    parser.add_argument("--batch", type=int, default=16, help="windows a step a replica")
    parser.add_argument("--out", default=None, help="the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    low, high = map(int, args.k.split(","))
    lr, momentum = map(float, args.outer.split(","))
    seeds, rules = [int(s) for s in args.seeds.split(",")], args.rules.split(",")
    text, val_text = gpt_arena.corpus()  # once: every run trains on the same text
    val = gpt_arena.val_batches(val_text, context=args.context, limit=8)
    rows: list[dict[str, Any]] = []
    for name, k_at in schedules(args.steps, low, high).items():
        for rule in rules if " to " in name else ["-"]:
            losses = [train(text, val, k_at, rule if rule != "-" else "kept", (lr, momentum), args.steps, s, args.layers, args.width, args.context, args.batch) for s in seeds]
            rows.append({"schedule": name, "rule": rule, "losses": losses})
            print(f"{name}, {rule}: {' / '.join(f'{v:.4f}' for v in losses)}", flush=True)
    print(table(["schedule", "rule", *(f"loss, seed {s}" for s in seeds)], [[r["schedule"], r["rule"], *(f"{v:.4f}" for v in r["losses"])] for r in rows]))
    if args.out:
        write_results(args.out, {"command": "python -m benchmarks outer_rescale " + " ".join(argv or []), "settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
