"""Run a function in N real processes joined in a gloo group, with a timeout (no hangs, no orphans).

The function must be defined at module level in a test module (each child imports it). The
children start as the library's workers do (processes.py): forked from a server that imported
torch once per test process, each a fresh process that imports the test module, as with spawn,
without each importing torch again (some 5 s of CPU a process on this machine).
"""

from __future__ import annotations

import datetime
import io
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from parallelwrapper.processes import worker_context


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple[Any, ...]) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
        # By value: a tensor sent by reference (shared memory) dies with this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """fn(rank, world, *args) in `world` processes; their return values, by rank."""
    ctx = worker_context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, store.port, results, args), name=f"parallelwrapper-test-{r}")
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"group did not finish within {timeout} s; got ranks {sorted(out)}")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world)]


def _each(rank: int, world: int, fn: Callable[..., Any], arg_sets: list[tuple[Any, ...]]) -> list[Any]:
    return [fn(rank, world, *args) for args in arg_sets]


def run_each(fn: Callable[..., Any], world: int, arg_sets: list[tuple[Any, ...]], timeout: float = 60.0) -> list[list[Any]]:
    """fn(rank, world, *args) for each of `arg_sets` in turn, in one group of `world` processes (a
    group's start, some 3 s here, once for all): for each, its return values by rank."""
    by_rank = run_group(_each, world, fn, arg_sets, timeout=timeout)
    return [[by_rank[r][i] for r in range(world)] for i in range(len(arg_sets))]
