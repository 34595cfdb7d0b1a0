"""The one way in: `python -m benchmarks list | quick | NAME [its flags]`, from the repository root.

    python -m benchmarks list                  # each maintained benchmark, and what it measures
    python -m benchmarks throughput --help     # one benchmark's own flags
    python -m benchmarks throughput --smoke    # one at its smallest size (its flags in BENCHMARKS)
    python -m benchmarks quick [--out DIR] [--jobs N]   # every one at its smallest size, each in a process of its own

`quick` is what to run after a change to the library: it exercises every benchmark's real code
path (spawned workers, gloo, torchrun) in a few minutes, and fails naming the benchmarks that
broke. Its figures are too small to quote; the sizes in benchmarks/README.md are. Run it, and any
benchmark, under `flock /tmp/pw-heavy.lock` where others share the machine.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# name: what it measures (one line), and its flags at its smallest size.
BENCHMARKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "throughput": (
        "samples/s of LeNet on 2 workers against DDP, PeriodicModelAverager and no communication",
        ("--steps", "12", "--warmup", "4", "--frequencies", "3", "--repeats", "1", "--only", "ddp,wrapper k=3"),
    ),
    "torchft_lenet": (
        "ms/step against torchft's DiLoCo and LocalSGD (torchft where installed)",
        ("--steps", "12", "--warmup", "2", "--k", "4", "--repeats", "1", "--contenders", "none,wrapper"),
    ),
    "comm_bound": (
        "training seconds to a test accuracy on a communication-bound 10M MLP: fixed k, int8, PMA, auto",
        ("--contenders", "wrapper:4,pma:4", "--params", "100000", "--eval-every", "4", "--target", "0.2", "--max-epochs", "1", "--budget", "5"),
    ),
    "slow_link": (
        "time to a target over a shaped link between two network namespaces (root), or loopback: every peer",
        ("--loopback", "--interleave", "--seed", "7", "--seed-each", "--contenders", "wrapper:4,pma:4", "--eval-every", "4", "--target", "0.1", "--max-epochs", "1", "--timeout", "120"),
    ),
    "gpt_arena": (
        "the GPT arena's payload race: bytes sent and validation loss of float32, int8 and sparse payloads",
        ("--payloads", "float32-params-average,int8-params-diloco", "--layers", "1", "--width", "32", "--context", "32", "--steps", "8", "--k", "4", "--batch", "2"),
    ),
    "fault_soak": (
        "the share of samples/s kept with .on_worker_failure('replace') under a fault every few seconds",
        ("--workers", "2", "--epochs", "6", "--batches", "200", "--every", "1", "--most", "1", "--faults", "SIGKILL"),
    ),
    "memory": (
        "peak memory of the main process and each worker against DDP's ranks",
        ("--params", "100000", "--batches", "4", "--fits", "1", "--fleet-rounds", "1"),
    ),
    "pipeline": (
        "a 2-stage pipeline's speed against one process, and torch's own pipelining",
        ("--width", "64", "--batch", "64", "--batches", "2", "--microbatches", "2", "--schedules", "1f1b", "--repeats", "1"),
    ),
    "inference": (
        "requests/s and latency of ParallelInference BATCHED and SEQUENTIAL against a locked model",
        ("--per-caller", "10", "--warmup", "2", "--callers", "1,8"),
    ),
    "fleet_sim": (
        "a simulated fleet that loses machines: throughput kept at 64 to 1,024 workers, by design, calibrated on this machine's runs",
        ("--workers", "16", "--every", "60", "--hours", "0.05", "--seeds", "1", "--calibrate"),
    ),
    "fleet_soak": (
        "emulated machines, one lost every 30 s and back 10 s later: throughput kept by a fleet, by torchrun's restarts and by torchft",
        ("--loopback", "--machines", "2", "--epochs", "4", "--width", "64", "--every", "0.5", "--back", "60", "--designs", "fleet", "--store", "tcp", "--timeout", "120"),
    ),
    "outer_rescale": (
        "an outer optimizer's loss when k changes mid-run (the autopilot's), by how its momentum is carried over",
        ("--steps", "8", "--layers", "1", "--width", "16", "--context", "16", "--batch", "2", "--k", "2,4", "--seeds", "0"),
    ),
    "loss_side": (
        "what a longer round costs in loss per doubling of k, against an online signal's estimate of it (the average's worth over the loss curve's fall)",
        ("--steps", "16", "--k", "2,4", "--eval-every", "4", "--jobs", "1x16,mlp16"),
    ),
    "gpu_checks": (
        "the CUDA paths, each a short fit on cuda:0 (on a lent GPU; --device cpu tries it here)",
        ("--device", "cpu", "--batches", "30", "--only", "channels_last"),
    ),
}


def run(name: str, argv: Sequence[str]) -> None:
    """Run benchmark `name` in this process with `argv` (`--smoke`: its smallest size)."""
    if name not in BENCHMARKS:
        raise SystemExit(f"benchmarks: no benchmark {name!r}: `python -m benchmarks list` names them ({', '.join(BENCHMARKS)})")
    args = [a for arg in argv for a in (BENCHMARKS[name][1] if arg == "--smoke" else (arg,))]
    if "--smoke" in argv and not any(a == "--out" or a.startswith("--out=") for a in argv):
        # A smoke run's figures are too small to keep: never over the results file of record.
        args += ["--out", str(Path(tempfile.gettempdir()) / f"pw-smoke-{name}.json")]
    sys.argv = [f"python -m benchmarks {name}", *args]
    result = importlib.import_module(f"benchmarks.{name}").main(args)
    if result:  # gpu_checks: the number of checks that failed
        raise SystemExit(result)


def _logged(name: str, argv: Sequence[str], log: str | None) -> None:
    """`run(name, argv)` in a process of quick's, its output to the file `log` (None: quick's)."""
    if log is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    run(name, argv)


def quick(out: Path, jobs: int = 1) -> int:
    """Every benchmark at its smallest size, each in a fresh process writing `out`/NAME.json, `jobs`
    at a time (more than 1: each one's output goes to `out`/NAME.log); the number that failed. The
    processes fork from the server the library's workers start from, which has imported torch and
    the library once, and here the benchmarks' common parts too (each benchmark's own module is
    light): a process of its own each, without some 5 s of CPU each for the imports."""
    from parallelwrapper.processes import worker_context

    began = time.monotonic()
    ctx = worker_context("benchmarks.common")
    # By its module's name: run as `python -m benchmarks` this module is __main__, which the
    # server's processes do not import.
    from benchmarks.__main__ import _logged as logged

    def one(name: str) -> bool:
        gpu = name == "gpu_checks" and torch.cuda.is_available()
        argv = ["--smoke", *(["--device", "cuda:0"] if gpu else []), "--out", str(out / f"{name}.json")]
        wall = time.monotonic()
        log = None if jobs == 1 else out / f"{name}.log"
        process = ctx.Process(target=logged, args=(name, argv, None if log is None else str(log)), name=f"benchmark-{name}")
        process.start()
        process.join()
        code = process.exitcode
        if code != 0 and log is not None:
            print(f"quick: {name}'s last lines ({log}):\n" + "\n".join(log.read_text().splitlines()[-30:]), file=sys.stderr, flush=True)
        print(f"quick: {name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {time.monotonic() - wall:.0f} s", flush=True)
        return code == 0

    with ThreadPoolExecutor(jobs) as pool:
        ok = dict(zip(BENCHMARKS, pool.map(one, BENCHMARKS)))
    failed = [name for name, passed in ok.items() if not passed]
    print(f"quick: {len(ok) - len(failed)} of {len(ok)} ran in {time.monotonic() - began:.0f} s; results in {out}")
    if failed:
        print(f"quick: failed: {', '.join(failed)}: run each alone (`python -m benchmarks NAME --smoke`) to see why", file=sys.stderr)
    return len(failed)


def main(argv: Sequence[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("list", [])
    if command in ("list", "-h", "--help"):
        print(__doc__)
        width = max(map(len, BENCHMARKS))
        for name, (what, _) in BENCHMARKS.items():
            print(f"  {name:<{width}}  {what}")
        return 0
    if command == "quick":
        parser = argparse.ArgumentParser(prog="python -m benchmarks quick", description="every benchmark at its smallest size")
        parser.add_argument("--out", type=Path, default=None, help="where each writes NAME.json (default: a temporary folder)")
        parser.add_argument("--jobs", type=int, default=1, help="benchmarks run at once (their figures then share the cores)")
        args = parser.parse_args(rest)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            return quick(args.out, args.jobs)
        with tempfile.TemporaryDirectory(prefix="pw-quick-") as folder:
            return quick(Path(folder), args.jobs)
    run(command, rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
