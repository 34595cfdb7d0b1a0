"""The race to a target, shared by comm_bound.py (loopback) and slow_link.py (a shaped link): each
contender trains and is scored every few steps off the clock; its result is the training seconds
at the first score that reaches the target. Repeats run every contender once, in an order rotated
by one each repeat, so that the machine's drift over minutes falls on different contenders, and
ratios between contenders are taken within a repeat before their median is.

A contender's run returns its `points`, one a score: seconds, samples, steps (per rank) and
either accuracy (higher is better) or val_loss (lower is better).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from benchmarks.common import rotated

Runs = dict[str, list[dict[str, Any]]]  # contender: one record a repeat

FAILED = {"seconds": None, "samples": None, "steps_per_rank": None, "ms_per_step": None, "best_accuracy": None}


def scored(points: Sequence[dict[str, Any]]) -> tuple[str, int]:
    """What a run's points score and which way is better: ("val_loss", 1), lower is better, or
    ("accuracy", -1), higher is better (sign · score: lower is better either way)."""
    return ("val_loss", 1) if points and "val_loss" in points[0] else ("accuracy", -1)


def time_to_target(points: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
    """The first point at or above the target accuracy, or at or below the target validation loss;
    None where never reached; the pace over the whole run; `best_accuracy` the best score either
    way (the lowest validation loss)."""
    key, sign = scored(points)
    hit = next((p for p in points if sign * p[key] <= sign * target), None)
    best = min((p[key] for p in points), key=lambda v: sign * v)
    last = points[-1]
    return {
        "seconds": hit["seconds"] if hit else None,
        "samples": hit["samples"] if hit else None,
        "steps_per_rank": hit["steps"] if hit else None,
        "ms_per_step": 1000 * last["seconds"] / last["steps"],
        "best_accuracy": best,
    }


def crossed(points: Sequence[dict[str, Any]], target: float) -> float | None:
    """The training seconds at which a run first reached `target` (a validation loss at or below
    it, an accuracy at or above it), read off the line between the score before and the first
    score that reached it (the first score's own seconds where it is the run's first); None where
    never. Scores come a few per run (every 128 steps in the GPT arenas), so the first score at
    the target alone moves a contender's time by a whole chunk for a fraction of a percent."""
    key, sign = scored(points)
    for before, p in zip([None, *points], points):
        if sign * p[key] <= sign * target:
            if before is None or sign * before[key] <= sign * p[key]:
                return float(p["seconds"])
            share = (before[key] - target) / (before[key] - p[key])
            return float(before["seconds"] + share * (p["seconds"] - before["seconds"]))
    return None


def race(names: Sequence[str], repeats: int, run: Callable[[str, int], dict[str, Any]], target: float, keep_going: bool = False) -> Runs:
    """`run(name, repeat)` for every contender in every repeat, rotated; each record is the run's
    own fields with its time to `target` and wall seconds. `keep_going`: a run that raises
    RuntimeError (a NaN loss, ranks that failed) is recorded as FAILED with its cause, and the
    race goes on."""
    runs: Runs = {name: [] for name in names}
    for repeat in range(repeats):
        for name in rotated(names, repeat):
            wall = time.monotonic()
            try:
                result: dict[str, Any] | RuntimeError = run(name, repeat)
            except RuntimeError as e:
                if not keep_going:
                    raise
                result = e
            runs[name].append(_record(name, repeat, result, target, time.monotonic() - wall))
    return runs


def race_by_turns(names: Sequence[str], repeats: int, run_all: Callable[[list[str], int], dict[str, dict[str, Any] | RuntimeError]], target: float,
                  landed: Callable[[Runs], None] = lambda runs: None) -> Runs:  # fmt: skip
    """As `race` with `keep_going`, but a repeat's contenders run together, taking turns in an
    order rotated each repeat: `run_all(order, repeat)` returns each one's result, or the
    RuntimeError it failed with (slow_link.py --interleave). Its wall seconds are the repeat's.
    `landed` is handed the runs so far after each repeat."""
    runs: Runs = {name: [] for name in names}
    for repeat in range(repeats):
        wall = time.monotonic()
        results = run_all(rotated(names, repeat), repeat)
        for name in names:
            runs[name].append(_record(name, repeat, results[name], target, time.monotonic() - wall))
        landed(runs)
    return runs


def _record(name: str, repeat: int, result: dict[str, Any] | RuntimeError, target: float, wall: float) -> dict[str, Any]:
    """A run's record: its fields with its time to `target`, or FAILED with its cause."""
    if isinstance(result, RuntimeError):
        cause = next((line for line in reversed(str(result).splitlines()) if "Error" in line), str(result).splitlines()[0])
        print(f"repeat {repeat + 1}, {name}: failed: {cause}", flush=True)
        return {**FAILED, "error": cause, "log": str(result), "wall_seconds": wall}  # the whole of it: the one line may be torchrun's summary alone
    r = {**time_to_target(result["points"], target), **result, "wall_seconds": wall}
    reached = f"{r['seconds']:.1f} s, {r['steps_per_rank']:.0f} steps" if r["seconds"] is not None else f"not reached (best {r['best_accuracy']:.4f})"
    print(f"repeat {repeat + 1}, {name}: {reached}, {r['ms_per_step']:.0f} ms/step, run took {wall:.0f} s", flush=True)
    return r


def thirds(runs: Runs, repeat: int, fixed: Collection[str]) -> tuple[str, list[float]] | None:
    """The best fixed setting of `repeat` among `fixed` (contender names), after the fact, and its
    scores at a third, two thirds and the end of its run: issue 52's three targets. Where every
    fixed setting ran the same steps, the one whose last score is best, and its scores at the points
    nearest a third and two thirds of its steps. Where they did not (a race to a time budget: each
    stops at the first score past it, so a faster one gets a chunk more), at equal time instead: up
    to the end of the shortest run, the one best there, its scores read between points (`score_at`)
    at a third, two thirds and that end. Judged by its last score, the one with a chunk more was the
    best, and its last loss a target no contender stopped before could reach. None where no fixed
    setting ran."""
    ran = {n: runs[n][repeat]["points"] for n in fixed if n in runs and runs[n][repeat].get("points")}
    if not ran:
        return None
    key, sign = scored(next(iter(ran.values())))
    if len({points[-1]["steps"] for points in ran.values()}) == 1:
        name = min(ran, key=lambda n: sign * ran[n][-1][key])
        points = ran[name]
        last = points[-1]["steps"]
        at = [min(points, key=lambda p: abs(p["steps"] - share * last))[key] for share in (1 / 3, 2 / 3)]
        return name, [*at, points[-1][key]]
    equal = at_equal_time({n: runs[n] for n in ran}, repeat)
    assert equal is not None  # every one of `ran` has points
    end, scores = equal
    name = min(scores, key=lambda n: sign * scores[n])
    return name, [score_at(ran[name], share * end) for share in (1 / 3, 2 / 3, 1)]


def score_at(points: Sequence[dict[str, Any]], seconds: float) -> float:
    """A run's score at `seconds` of training, read on the line between the points either side (the
    first point's before it, the last's after it)."""
    key, _ = scored(points)
    for before, p in zip([None, *points], points):
        if p["seconds"] >= seconds:
            if before is None:
                return float(p[key])
            share = (seconds - before["seconds"]) / (p["seconds"] - before["seconds"])
            return float(before[key] + share * (p[key] - before[key]))
    return float(points[-1][key])


def at_equal_time(runs: Runs, repeat: int) -> tuple[float, dict[str, float]] | None:
    """Every contender's score in `repeat` at the end of its shortest run (`score_at`): a race to a
    time budget stops each at the first score past it, so a last score can be a chunk later than
    another's, and a target set by it one no contender that stopped a chunk earlier could reach
    (`thirds` reads its targets here). None where no contender has points."""
    ran = {n: rs[repeat]["points"] for n, rs in runs.items() if len(rs) > repeat and rs[repeat].get("points")}
    if not ran:
        return None
    end = min(points[-1]["seconds"] for points in ran.values())
    return end, {n: score_at(points, end) for n, points in ran.items()}


def regret(runs: Runs, fixed: Collection[str]) -> tuple[list[tuple[str, list[float]] | None], dict[str, list[list[float | None]]]]:
    """Per repeat, its best fixed setting and three targets (`thirds`); and per contender, per
    repeat, its seconds to each target (`crossed`, between scores) over the fastest fixed
    setting's to the same target (None: it never reached it)."""
    out: dict[str, list[list[float | None]]] = {n: [] for n in runs}
    targets = [thirds(runs, i, fixed) for i in range(min(len(rs) for rs in runs.values()))]
    for i, found in enumerate(targets):
        if found is None:
            continue
        for target in found[1]:
            reached = {n: crossed(rs[i]["points"], target) if rs[i].get("points") else None for n, rs in runs.items()}
            times = [t for n in fixed if (t := reached.get(n)) is not None]
            fastest = min(times) if times else None
            for n in runs:
                if len(out[n]) <= i:
                    out[n].append([])
                out[n][i].append(reached[n] / fastest if fastest and reached[n] is not None else None)
    return targets, out


def doubling_cost(short: Sequence[dict[str, Any]], long: Sequence[dict[str, Any]], ratio: float) -> list[float]:
    """The loss side of a longer round, from two runs of one setting at k and at `ratio`·k (the
    same steps, scored at the same steps): for each of `short`'s validation losses from a third of
    its run on, the steps `long` took to the same loss (interpolated between its scores) over
    `short`'s, as a cost per doubling of k: (steps_long / steps_short)^(1 / log2 ratio) − 1. With a
    cost β per doubling, doubling k pays while the exchange share is above 2β / (1 + β): a round of
    2k costs (1 + β) the steps of one of k, at (c + x/2k) / (c + x/k) the time a step."""
    out = []
    for p in short[len(short) // 3:]:
        for a, b in zip(long, long[1:]):
            if b["val_loss"] <= p["val_loss"] <= a["val_loss"] and a["val_loss"] > b["val_loss"]:
                steps = a["steps"] + (b["steps"] - a["steps"]) * (a["val_loss"] - p["val_loss"]) / (a["val_loss"] - b["val_loss"])
                out.append((steps / p["steps"]) ** (1 / math.log2(ratio)) - 1)
                break
    return out


def _by_kind(fixed: Collection[str]) -> dict[str, list[tuple[int, str]]]:
    """`fixed` settings by kind (a name's part before ':'): (k, name) each, k rising."""
    by_kind: dict[str, list[tuple[int, str]]] = {}
    for name in fixed:
        kind, _, period = name.partition(":")
        if period.isdigit():
            by_kind.setdefault(kind, []).append((int(period), name))
    return {kind: sorted(ks) for kind, ks in by_kind.items()}


def doubling_costs(runs: Runs, fixed: Collection[str]) -> dict[str, list[float]]:
    """`doubling_cost` for each pair of `fixed` settings of one kind (a name's part before ':') at
    neighbouring k (8 and 32, 32 and 128), over every repeat, by "kind:k→k'"; validation losses
    only (the GPT arena)."""
    out: dict[str, list[float]] = {}
    for kind, ks in _by_kind(fixed).items():
        for (k, a), (k2, b) in zip(ks, ks[1:]):
            pairs = [(x["points"], y["points"]) for x, y in zip(runs[a], runs[b]) if x.get("points") and y.get("points")]
            costs = [c for short, long in pairs if "val_loss" in short[0] for c in doubling_cost(short, long, k2 / k)]
            if costs:
                out[f"{kind}:{k}→{k2}"] = costs
    return out


def modelled_seconds(runs: Runs, fixed: Collection[str], costs: dict[str, list[float]]) -> dict[str, list[dict[str, float] | None]]:
    """A cost model that weighs the loss side against the time side, tried on the fixed settings'
    own measures: for each kind, in each repeat, each k's seconds to the same loss over its
    shortest k's, (1 + β)^log2(k) / (1 − s(k)). β is a doubling's extra steps (`doubling_costs`'
    median for the pair of ks it crosses), s(k) the share of that run's time in exchanges (its
    `comm_fraction`). The k it puts lowest, set beside the regret table's best, says whether a
    policy that knew β and each k's share would pick the setting that was best after the fact.
    None for a repeat without every share."""
    out: dict[str, list[dict[str, float] | None]] = {}
    for kind, ks in _by_kind(fixed).items():
        steps = [1.0]  # steps to the same loss over the shortest k's
        for (k, _), (k2, _) in zip(ks, ks[1:]):
            if not (each := costs.get(f"{kind}:{k}→{k2}")):
                break
            steps.append(steps[-1] * (1 + statistics.median(each)) ** math.log2(k2 / k))
        if len(steps) < 2:
            continue
        modelled: list[dict[str, float] | None] = []
        for i in range(len(runs[ks[0][1]])):
            shares = [runs[name][i].get("comm_fraction") for _, name in ks[: len(steps)]]
            seconds = [n / (1 - s) for n, s in zip(steps, shares)] if None not in shares else None
            modelled.append(None if seconds is None else {str(k): t / seconds[0] for (k, _), t in zip(ks, seconds)})
        out[kind] = modelled
    return out


def median(values: Sequence[float | None]) -> float | None:
    """The median, or None where a value is missing (a repeat that did not reach the target)."""
    return statistics.median(v for v in values if v is not None) if values and all(v is not None for v in values) else None


def best(runs: Runs, repeat: int, group: Collection[str]) -> str | None:
    """The contender of `group` (by kind: a name's part before ':') fastest to the target in
    `repeat`, or None where none of them reached it."""
    reached = {n: rs[repeat]["seconds"] for n, rs in runs.items() if n.partition(":")[0] in group and rs[repeat]["seconds"] is not None}
    return min(reached, key=reached.__getitem__) if reached else None
