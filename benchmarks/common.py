"""What the benchmarks share: the MNIST workload, process groups for the peers, timing, output.

Every benchmark measures its contenders one after another in the same run, on the same data,
and reports ratios; the JSON it writes holds every figure the printed table shows.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import queue
import resource
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallelwrapper import ParallelWrapper, Score, exchange_share
from parallelwrapper.app.mnist import load_mnist
from parallelwrapper.app.models import LeNet
from parallelwrapper.processes import worker_context

BATCH = 128
LR, MOMENTUM = 0.02, 0.9  # Nesterov SGD; 0.04 (pw-fit's default) spikes to NaN at k = 1 from this seed
# The real MNIST files: $PW_DATA_DIR where set (the package's own, as for pw-fit and the tests), else the shared copy beside the repository.
DEFAULT_DATA_DIR = os.environ.get("PW_DATA_DIR") or str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist")


def mnist_batches(data_dir: str, split: str = "train", batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return load_mnist(data_dir, split, download=False).batches(batch, shuffle=split == "train", seed=0)


def lenet() -> torch.nn.Module:
    torch.manual_seed(0)
    return LeNet()


def nesterov(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True)


STAMPS_ENV = "PW_BENCH_STAMPS"  # where `stamp` writes, in spawned workers
_stamps: Any = None  # this process's stamp file


def window(warmup: int, steps: int, k: int) -> tuple[int, int]:
    """The steps whose stamps open and close the timed window: whole rounds of k after warmup."""
    rounds = (steps - 1 - warmup) // k
    if rounds < 1:
        raise SystemExit(f"--steps {steps} leaves no whole round of k={k} after --warmup {warmup}: need {warmup + k + 1} at least")
    return warmup, warmup + rounds * k


def mark() -> tuple[float, int]:
    """The clock and this process's minor page faults so far."""
    return time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def stamp(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """`.before_step` in the wrapper's workers: the `mark` after each backward, one file a process
    in the folder $STAMPS_ENV (the spawned workers inherit it). A Score listener would not do: with
    overlap_averaging a round's Score arrives when it lands, a round late."""
    global _stamps
    if _stamps is None:
        _stamps = open(Path(os.environ[STAMPS_ENV]) / str(os.getpid()), "a", buffering=1)
    clock, faults = mark()
    _stamps.write(f"{clock:.9f} {faults}\n")


def per_step(marks: Sequence[tuple[float, int]], a: int, b: int) -> tuple[float, float]:
    """One process's minor page faults and ms a step from its mark at step a to step b."""
    (t0, f0), (t1, f1) = marks[a], marks[b]
    return (f1 - f0) / (b - a), (t1 - t0) / (b - a) * 1000


def ms_per_step(kind: str, stamps: list[list[float]], a: int, b: int) -> float:
    """Per worker: independent processes add their rates, the others share one span."""
    if kind == "none":
        return 1000.0 / sum((b - a) / (s[b] - s[a]) for s in stamps) * len(stamps)
    return 1000.0 * (max(s[b] for s in stamps) - min(s[a] for s in stamps)) / (b - a)


def read_stamps(folder: str | Path, world: int, steps: int, first_come: bool = False) -> list[list[tuple[float, int]]]:
    """Each worker's marks, as `stamp` wrote them; every worker must have stamped every step, or
    (`first_come`, where a faster worker takes more) all of them together `world · steps`."""
    stamps = [[(float(t), int(f)) for t, f in (line.split() for line in p.read_text().splitlines())] for p in sorted(Path(folder).iterdir())]
    counts = [len(s) for s in stamps]
    if len(stamps) != world or (sum(counts) != world * steps if first_come else any(n != steps for n in counts)):
        raise RuntimeError(f"expected {world} workers of {steps} steps{' together' if first_come else ''}, stamped {counts}")
    return stamps


def fleet_ms_per_step(stamps: list[list[float]], warmup: int) -> float:
    """First-come steps: a worker's ms a step at the fleet's pace, from when every worker is past
    its `warmup` steps to when the first one takes its last: the span over every step stamped
    in it, times the workers."""
    start, end = max(s[warmup] for s in stamps), min(s[-1] for s in stamps)
    steps = sum(start < t <= end for s in stamps for t in s)
    return 1000.0 * (end - start) * len(stamps) / steps


def timed_fit(
    world: int, k: int, steps: int, warmup: int, data_dir: str, configure: Callable[[Any], Any], lr: float = LR, given: Callable[[list[Any]], Any] | None = None
) -> dict[str, Any]:
    """LeNet on `steps` batches per worker through a ParallelWrapper (Nesterov SGD at `lr`, one
    thread a worker, averaging every k, then `configure(builder)`; fit() is given the list of
    batches, or `given(batches)` such as a DataLoader of them), timed by `stamp` over whole
    rounds after `warmup`: ms per step, the wall seconds, the last round's loss, the share of rank
    0's time after `warmup` in exchanges (its Scores' exchange_s over training_s + exchange_s), and
    each worker's (minor page faults, ms) a step by its own marks over the same window."""
    batches = mnist_batches(data_dir)[: world * steps]
    scores: list[Score] = []
    with tempfile.TemporaryDirectory(prefix="pw_bench_") as folder:
        os.environ[STAMPS_ENV] = folder  # the spawned workers inherit it
        wall = time.monotonic()
        b = (
            ParallelWrapper.builder(lenet())
            .optimizer(torch.optim.SGD, lr=lr, momentum=MOMENTUM, nesterov=True)
            .workers(world)
            .threads_per_worker(1)
            .averaging_frequency(k)
            .before_step(stamp)
            .listeners(scores.append)  # the last round's loss only, not the timing
        )
        with configure(b).build() as w:
            w.fit(batches if given is None else given(batches))
        wall = time.monotonic() - wall
        marks = read_stamps(folder, world, steps, first_come=True)
    a, b = window(warmup, min(len(m) for m in marks), k)
    exchange = exchange_share([s for s in scores if s.iteration > world * warmup])
    stamps = [[t for t, _ in m] for m in marks]
    return {
        "ms_per_step": fleet_ms_per_step(stamps, warmup),
        "wall_s": wall,
        "last_loss": scores[-1].score,
        "exchange_share": exchange,
        "per_worker": [per_step(m, a, b) for m in marks],
    }


def rotated(names: Sequence[str], r: int) -> list[str]:
    """The contenders' order in round `r` of interleaved repeats: rotated by r, so that no
    contender always runs first, or always after the same one."""
    return [*names[r % len(names) :], *names[: r % len(names)]]


def median_ratio(over: Sequence[float], under: Sequence[float]) -> float:
    """The median of the rounds' ratios over / under, round by round: the machine's drift
    between rounds cancels, as it does not in a ratio of medians."""
    return statistics.median(a / b for a, b in zip(over, under, strict=True))


def machine() -> dict[str, Any]:
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int | None, results: Any, args: tuple[Any, ...]) -> None:
    try:
        torch.set_num_threads(1)
        if port is not None:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the caller
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def peer_context(spawn: bool = False) -> Any:
    """The multiprocessing context the peers of `run_processes` start from (and the queues they
    take): the library's workers' forkserver (processes.worker_context), which imports torch once
    for them all and for the wrapper's own workers in the same benchmark; or, `spawn`, a fresh
    interpreter each, which imports torch, and torch._dynamo at its first optimizer, some 4 s each."""
    return mp.get_context("spawn") if spawn else worker_context("benchmarks.common")


def run_processes(fn: Callable[..., Any], world: int, *args: Any, group: bool = True, timeout: float = 900, spawn: bool = False) -> list[Any]:
    """fn(rank, world, *args) in `world` single-thread processes of `peer_context(spawn)`, in a
    gloo group when `group`; returns their (picklable, tensor-free) results by rank. What they
    time starts after their start, either way."""
    ctx = peer_context(spawn)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if group else None
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, store.port if store else None, results, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"benchmark processes failed or timed out; results from {sorted(out)}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def vm(field: str, pid: int | str = "self") -> float:
    """A /proc/<pid>/status size (VmHWM: the peak resident size over the process's life; VmRSS)
    in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def worker_pids(pid: int) -> tuple[int, list[int]]:
    """(the forkserver, the worker processes it started for `pid`'s wrappers, by pid). Workers are
    the forkserver's children (processes.py), not the main process's."""

    def children(parent: int) -> list[int]:
        return [int(c) for c in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]

    servers = [c for c in children(pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    if len(servers) != 1:
        raise RuntimeError(f"process {pid} has {len(servers)} forkservers, not 1: start a wrapper's workers first")
    return servers[0], sorted(children(servers[0]))


def write_results(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table, floats to three significant figures."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
