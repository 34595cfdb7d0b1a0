"""A communication-bound job on loopback: training seconds to a test accuracy (issue 37).

    python -m benchmarks comm_bound --repeats 1              # the fixed grid, PMA and auto
    python -m benchmarks comm_bound --quick                  # auto, wrapper:32 and pma:8, a few minutes
    python -m benchmarks comm_bound --contenders auto,wrapper:32,pma:8
    python -m benchmarks comm_bound --analyse benchmarks/results/comm_bound.json

An MLP of 10M parameters on MNIST (784 -> 2789 -> 2789 -> 10, ReLU), batch 32, 2 workers of one
thread each, Nesterov SGD (lr 0.02, momentum 0.9) from the same initial weights on the same
batches (MNIST's training set shuffled anew each epoch), to 97% test accuracy (768 to 896 steps
per worker in every contender tried). A step is short against the 40 MB of parameters (80 MB
with the momentum) an averaging moves: on this 2-core machine a float32 averaging of both takes
about a step's time (55-62 ms against 69-74 ms of compute at k = 8). A smaller batch shortens a
step less than it shrinks it (each step reads and writes every weight whatever the batch: 39 ms
of compute at batch 8 against 68 at batch 32, results/comm_bound_batch8.json and _batch32.json),
so it would slow training more than it would raise the exchanges' share (25% of a k = 8 round's
time against 17%). See benchmarks/README.md, "A communication-bound job". Contenders
(`--contenders`, comma-separated):
  wrapper:K    this project at k = K, the defaults (float32, parameters and momentum averaged)
  int8:K       the same with .payload_dtype("int8")
  params:K     the same with .average_updaters(False): parameters only, PMA's bytes
  pma:K        PyTorch's PeriodicModelAverager, two torch processes of its own on gloo, period K
  pma-heap:K   the same, its processes keeping their heap as the wrapper's workers do
               (processes.keep_heap: glibc's mmap and trim thresholds); PMA's own glibc defaults
               fault in tens of MB of pages a step here (minor_faults_per_step in the JSON)
  auto         the wrapper with .averaging_frequency("auto") and nothing else set; skipped, with
               the builder's refusal printed and recorded, while the builder refuses it

Each contender trains in chunks of `--eval-every` steps per worker (a multiple of every fixed K,
so that each chunk ends on an averaging) and the averaged model is scored on the 10,000 test
images after each chunk, off the clock. The wrapper's chunks are one fit() each, timed from the
call to its return, as `pw-fit compare` times them: the workers are started first by a fit of
one batch per worker whose effect on the model and optimizer is then undone (the wrapper's own
learned state, such as auto's, is kept). PMA's ranks time their loop and end each chunk at a
barrier; rank 0 scores while rank 1 waits. A contender's result is the training seconds at the
first score >= `--target`, and the samples trained by then (all workers); ms/step is the
seconds per step of each worker over the whole run; the share in exchanges is rank 0's (the
wrapper's Scores' exchange_s over training_s + exchange_s; PMA's time in average_parameters
over its loop's). Repeats run every contender once in a rotated order; the ratios to the best
fixed wrapper setting and to PMA's best period (plain pma) are taken within each repeat, then
the median.

Run it from the root of the tree whose package it should measure: the wrapper's workers start
through a forkserver that imports `parallelwrapper` from the current directory first. To measure
a commit while others edit the work tree: `git archive COMMIT | tar -x -C DIR`, then in DIR
`PYTHONPATH=$PWD python -m benchmarks comm_bound --data-dir ...`; the results name the package's
folder, commit and modified files.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import os
import resource
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from benchmarks.common import DEFAULT_DATA_DIR, LR, MOMENTUM, run_processes, table, write_results
from benchmarks.race import Runs, best, median, race
from parallelwrapper import ParallelWrapper, Score, exchange_share
from parallelwrapper.app.mnist import load_mnist
from parallelwrapper.processes import keep_heap

Batch = tuple[torch.Tensor, torch.Tensor]  # images (B, 1, 28, 28) float32, labels (B,) int64
WORKERS, PARAMS, SEED, BATCH = 2, 10_000_000, 0, 32
IN, OUT = 28 * 28, 10
FIXED = ("wrapper", "int8", "params")  # the wrapper's fixed settings
KINDS = (*FIXED, "pma", "pma-heap")  # the contenders with a period
DEFAULT_CONTENDERS = "wrapper:8,wrapper:32,wrapper:64,int8:8,int8:32,int8:64,params:32,pma:8,pma:32,auto"
QUICK_CONTENDERS = "auto,wrapper:32,pma:8"  # auto skipped while refused: about 3 minutes, 5 with auto


def width(params: int) -> int:
    """The hidden width h of IN -> h -> h -> OUT with about `params` parameters: h² + (IN + OUT + 2)h."""
    b = IN + OUT + 2
    return round((-b + math.sqrt(b * b + 4 * params)) / 2)


def mlp(params: int = PARAMS) -> nn.Module:
    """The same initial weights in every contender and process."""
    torch.manual_seed(SEED)
    h = width(params)
    return nn.Sequential(nn.Flatten(), nn.Linear(IN, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, OUT))


def chunks(data_dir: str, epochs: int, steps: int, batch: int) -> Iterator[list[Batch]]:
    """`steps` batches per worker at a time (WORKERS * steps), over `epochs` epochs of MNIST's
    training set, each epoch shuffled with its own seed; an epoch's last chunk runs into the next."""
    train = load_mnist(data_dir, "train", download=False)
    stream = itertools.chain.from_iterable(train.batches(batch, shuffle=True, seed=SEED + e) for e in range(epochs))
    while chunk := list(itertools.islice(stream, WORKERS * steps)):
        yield chunk


@torch.no_grad()
def accuracy(model: nn.Module, test: list[Batch]) -> float:
    """Test accuracy, on both cores (nothing else runs while a contender scores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    model.eval()
    correct = sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in test)
    model.train()
    torch.set_num_threads(threads)
    return correct / sum(len(y) for _, y in test)


def test_set(data_dir: str) -> list[Batch]:
    return load_mnist(data_dir, "test", download=False).batches(1000)


# -- the wrapper --------------------------------------------------------------------------------------


def builder(kind: str, k: int, lr: float, model: nn.Module, scores: list[Score]) -> Any:
    """The job's builder for a wrapper contender: the shared settings, then the contender's own."""
    b = ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=lr, momentum=MOMENTUM, nesterov=True).workers(WORKERS).threads_per_worker(1).seed(SEED).listeners(scores.append)
    if kind == "auto":
        return b.averaging_frequency("auto")
    b = b.averaging_frequency(k)
    if kind == "int8":
        b = b.payload_dtype("int8")
    if kind == "params":
        b = b.average_updaters(False)
    return b


def auto_refused(lr: float) -> str | None:
    """Why the builder refuses .averaging_frequency("auto"), or None where it builds (no worker starts)."""
    try:
        builder("auto", 0, lr, mlp(), []).build().close()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def start_workers(wrapper: ParallelWrapper, batches: list[Batch]) -> None:
    """Start the workers off the clock, as `pw-fit compare` does: fit one batch per worker, then put
    the model and the optimizer back as they were."""
    model_state = copy.deepcopy(wrapper.model.state_dict())
    optimizer_state = copy.deepcopy(wrapper.optimizer.state_dict())
    wrapper.fit(batches[:WORKERS])
    wrapper.model.load_state_dict(model_state)
    wrapper.optimizer.load_state_dict(optimizer_state)


SCORE_FIELDS = ("round", "iteration", "training_s", "exchange_s")
SKIP_FIELDS = {"samples", "epoch", "score", "seconds", "skipped", "position", "encoding", "lr"}


def score_record(s: Score) -> dict[str, Any]:
    """What a Score says of its round's time, and any field this script does not know (the k and
    payload in force, once Scores carry them), as JSON."""
    record = {f: getattr(s, f) for f in SCORE_FIELDS}
    for f in dataclasses.fields(s):
        if f.name not in SKIP_FIELDS and f.name not in record:
            value = getattr(s, f.name)
            record[f.name] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    return record


def run_wrapper(kind: str, k: int, args: argparse.Namespace) -> dict[str, Any]:
    model, scores = mlp(args.params), []
    test = test_set(args.data_dir)
    points: list[dict[str, float]] = []
    seconds, samples = 0.0, 0
    pieces = chunks(args.data_dir, args.max_epochs, args.eval_every, args.batch)
    first = next(pieces)
    with builder(kind, k, args.lr, model, scores).build() as w:
        start_workers(w, first)
        scores.clear()
        for chunk in itertools.chain([first], pieces):
            start = time.perf_counter()
            w.fit(chunk)
            seconds += time.perf_counter() - start
            samples += sum(len(y) for _, y in chunk)
            acc = accuracy(w.model, test)
            busy = sum(s.training_s + s.exchange_s for s in scores)
            points.append({"seconds": seconds, "samples": samples, "steps": samples / (WORKERS * args.batch), "accuracy": acc, "rank0_busy_s": busy})
            print(f"  {kind}:{k}: {samples / (WORKERS * args.batch):.0f} steps, {seconds:.1f} s, accuracy {acc:.4f}", flush=True)
            if acc >= args.target or seconds >= args.budget:
                break
    steps = samples / (WORKERS * args.batch)  # each worker's, on average (first-come: rank 0's may differ a little)
    return {
        "points": points,
        "exchange_share": exchange_share(scores),
        "compute_s_per_step": sum(s.training_s for s in scores) / steps,
        "exchange_s_per_round": sum(s.exchange_s for s in scores) / len(scores) if scores else None,
        "rounds": len(scores),
        "scores": [score_record(s) for s in scores],
    }


# -- PeriodicModelAverager ------------------------------------------------------------------------------


def _pma_rank(rank: int, world: int, k: int, heap: bool, params: int, lr: float, data_dir: str, eval_every: int, batch: int, max_epochs: int, target: float, budget: float) -> dict[str, Any]:
    if heap and not keep_heap(dict(os.environ)):
        raise RuntimeError("pma-heap: glibc's thresholds could not be set here (no mallopt, or PW_KEEP_HEAP=0 or MALLOC_ variables set)")
    model = mlp(params)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM, nesterov=True)
    # Its counter starts at 0 and it averages when the counter is past warmup_steps and a multiple
    # of the period from there: warm-up k - 1 averages after steps k, 2k, ..., as the wrapper does.
    averager = PeriodicModelAverager(period=k, warmup_steps=k - 1)
    test = test_set(data_dir) if rank == 0 else []
    points: list[dict[str, float]] = []
    seconds = averaging = steps_s = 0.0
    samples = 0
    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for chunk in chunks(data_dir, max_epochs, eval_every, batch):
        start = time.perf_counter()
        for x, y in chunk[rank::world]:
            step = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            averaged = time.perf_counter()
            averager.average_parameters(model.parameters())
            steps_s += averaged - step
            averaging += time.perf_counter() - averaged
        dist.barrier()  # the chunk is done when the slower rank is done
        seconds += time.perf_counter() - start
        samples += sum(len(y) for _, y in chunk)
        # Off the clock: rank 0 scores while rank 1 waits; rank 0's clock decides the budget too.
        verdict = torch.tensor([accuracy(model, test) if rank == 0 else 0.0, float(seconds >= budget)], dtype=torch.float64)
        dist.broadcast(verdict, src=0)
        acc = float(verdict[0])
        points.append({"seconds": seconds, "samples": samples, "steps": samples / (world * batch), "accuracy": acc, "rank0_busy_s": steps_s + averaging})
        if rank == 0:
            print(f"  pma{'-heap' if heap else ''}:{k}: {samples / (world * batch):.0f} steps, {seconds:.1f} s, accuracy {acc:.4f}", flush=True)
        if acc >= target or bool(verdict[1]):
            break
    steps = samples / (world * batch)
    rounds = int(steps) // k
    return {
        "points": points,
        "minor_faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / (samples / world / batch),
        "exchange_share": averaging / (steps_s + averaging),
        "compute_s_per_step": steps_s / steps,
        "exchange_s_per_round": averaging / rounds if rounds else None,
        "rounds": rounds,
    }


def run_pma(k: int, heap: bool, args: argparse.Namespace) -> dict[str, Any]:
    parts = run_processes(_pma_rank, WORKERS, k, heap, args.params, args.lr, args.data_dir, args.eval_every, args.batch, args.max_epochs, args.target, args.budget, timeout=args.budget * 3 + 600)
    return parts[0]


# -- the race (race.py) ------------------------------------------------------------------------------------


def parse(contenders: str) -> list[tuple[str, str, int]]:
    """(name, kind, k) of each contender; SystemExit naming a bad one."""
    out = []
    for name in (c.strip() for c in contenders.split(",") if c.strip()):
        kind, _, k = name.partition(":")
        if name == "auto":
            out.append((name, "auto", 0))
        elif kind in KINDS and k.isdigit() and int(k) >= 1:
            out.append((name, kind, int(k)))
        else:
            raise SystemExit(f"unknown contender {name!r}: use wrapper:K, int8:K, params:K, pma:K, pma-heap:K or auto")
    return out


def summarise(runs: Runs) -> dict[str, dict[str, Any]]:
    """Per contender: medians over the repeats (seconds and samples only where every repeat
    reached the target), and the ratios to each repeat's best fixed wrapper setting and best PMA."""
    repeats = min(len(rs) for rs in runs.values())
    for i in range(repeats):
        for group, key in ((FIXED, "vs_best_fixed"), (("pma",), "vs_best_pma")):
            fastest = best(runs, i, group)
            for rs in runs.values():
                rs[i][key] = rs[i]["seconds"] / runs[fastest][i]["seconds"] if fastest and rs[i]["seconds"] else None
    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            "seconds": median([r["seconds"] for r in rs]),
            "seconds_each": [r["seconds"] for r in rs],
            "samples": median([r["samples"] for r in rs]),
            "ms_per_step": median([r["ms_per_step"] for r in rs]),
            "exchange_share": median([r["exchange_share"] for r in rs]),
            "compute_s_per_step": median([r["compute_s_per_step"] for r in rs]),
            "exchange_s_per_round": median([r["exchange_s_per_round"] for r in rs]),
            "vs_best_fixed": median([r.get("vs_best_fixed") for r in rs[:repeats]]),
            "vs_best_pma": median([r.get("vs_best_pma") for r in rs[:repeats]]),
            "best_accuracy": [r["best_accuracy"] for r in rs],
        }
    return summary


def report(settings: dict[str, Any], runs: Runs, skipped: dict[str, str]) -> dict[str, dict[str, Any]]:
    summary = summarise(runs) if runs else {}

    def cell(v: Any, fmt: str = "{:.3g}") -> str:
        return "-" if v is None else fmt.format(v)

    rows = [
        (
            name,
            f"{cell(s['seconds'])} ({' / '.join(cell(x) for x in s['seconds_each'])})",
            cell(s["samples"], "{:,.0f}"),
            cell(s["ms_per_step"]),
            cell(s["exchange_share"], "{:.0%}"),
            cell(s["compute_s_per_step"] and 1000 * s["compute_s_per_step"]),
            cell(s["exchange_s_per_round"] and 1000 * s["exchange_s_per_round"]),
            cell(s["vs_best_fixed"]),
            cell(s["vs_best_pma"]),
        )
        for name, s in summary.items()
    ]
    print(
        f"\nMLP {settings['params']:,} parameters, MNIST, batch {settings['batch']}, {WORKERS} workers of one thread, Nesterov SGD lr {settings['lr']}, "
        f"scored every {settings['eval_every']} steps per worker, {settings['repeats']} repeat(s)"
    )
    headers = ["contender", f"s to {settings['target']:.1%}, median (each)", "samples to target", "ms/step", "rank 0's time in exchanges",
               "compute ms/step (rank 0)", "exchange ms/round (rank 0)", "/ best fixed wrapper", "/ best PMA"]  # fmt: skip
    print(table(headers, rows))
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}")
    return summary


def provenance() -> dict[str, Any]:
    """Which package ran: its folder, and where that is a git work tree, its commit and the files
    of the package that differ from it (others may be editing the tree this runs from)."""
    import parallelwrapper

    package = Path(parallelwrapper.__file__).resolve().parent

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=package, capture_output=True, text=True)
        return done.stdout.rstrip("\n") if done.returncode == 0 else ""

    return {"package": str(package), "revision": git("rev-parse", "--short", "HEAD") or None, "modified": git("status", "--porcelain", "--", ".").splitlines()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default=None, help=f"default: {DEFAULT_CONTENDERS}")
    parser.add_argument("--quick", action="store_true", help=f"contenders {QUICK_CONTENDERS} unless --contenders says otherwise, 1 repeat")
    parser.add_argument("--target", type=float, default=0.97, help="test accuracy to reach")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every contender, in a rotated order")
    parser.add_argument("--eval-every", type=int, default=64, help="steps per worker between scores (a multiple of every K)")
    parser.add_argument("--params", type=int, default=PARAMS, help="the MLP's size, about (a smaller one is less communication-bound)")
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per step per worker")
    parser.add_argument("--lr", type=float, default=LR, help="Nesterov SGD, momentum 0.9, every contender")
    parser.add_argument("--budget", type=float, default=240, help="training seconds after which a contender stops at its next score")
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/comm_bound.json (--quick: comm_bound_quick.json)")
    parser.add_argument("--analyse", metavar="JSON", help="no runs: print a results file's table again")
    args = parser.parse_args(argv)
    if args.analyse:
        saved = json.loads(Path(args.analyse).read_text())
        report(saved["settings"], saved["runs"], saved.get("skipped", {}))
        return
    contenders = parse(args.contenders or (QUICK_CONTENDERS if args.quick else DEFAULT_CONTENDERS))
    repeats = 1 if args.quick else args.repeats
    out = args.out or f"benchmarks/results/comm_bound{'_quick' if args.quick else ''}.json"
    for name, kind, k in contenders:
        if kind in KINDS and args.eval_every % k:
            parser.error(f"--eval-every {args.eval_every} is not a multiple of {name}'s k: its model would be scored between averagings")
    skipped: dict[str, str] = {}
    if any(kind == "auto" for _, kind, _ in contenders):
        why = auto_refused(args.lr)
        if why is not None:
            skipped["auto"] = f"the builder refuses .averaging_frequency('auto') ({why})"
            print(f"auto: skipped: {skipped['auto']}", flush=True)
            contenders = [c for c in contenders if c[1] != "auto"]
    torch.set_num_threads(1)  # the main process feeds the workers; accuracy() takes both cores while they wait
    settings = {
        "params": sum(p.numel() for p in mlp(args.params).parameters()),
        "width": width(args.params),
        "batch": args.batch,
        "workers": WORKERS,
        "lr": args.lr,
        "momentum": MOMENTUM,
        "target": args.target,
        "eval_every": args.eval_every,
        "repeats": repeats,
        "budget": args.budget,
        "max_epochs": args.max_epochs,
        **provenance(),
    }
    specs = {name: (kind, k) for name, kind, k in contenders}

    def run(name: str, repeat: int) -> dict[str, Any]:
        kind, k = specs[name]
        print(f"repeat {repeat + 1}, {name}:", flush=True)
        return run_pma(k, kind == "pma-heap", args) if kind.startswith("pma") else run_wrapper(kind, k, args)

    started = time.monotonic()
    runs = race(list(specs), repeats, run, args.target)
    summary = report(settings, runs, skipped)
    print(f"total wall time {time.monotonic() - started:.0f} s")
    write_results(out, {"settings": settings, "skipped": skipped, "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
