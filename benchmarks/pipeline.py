"""A pipeline's speed (issue 24): 1 worker x 2 stages (`.pipeline(stages=2)`, one thread per
stage) against one process with one thread, on an MLP of 8 equal layers, for 1, 4 and 8
microbatches (and 16), as the ratio to the ideal 2x, beside torch.distributed.pipelining's own schedule
in two bare processes (what the wrapper adds); and 2 workers x 2 stages against 4 unsplit workers.
Two independent processes, each training every batch at once, give the speedup the machine's two
cores allow at all (the last column's ratios are to it).

    python benchmarks/pipeline.py                      # width 1024, batch 2048, 16 batches a fit
    python benchmarks/pipeline.py --batch 256 --batches 24   # microbatches of 32 rows at M = 8
    python benchmarks/pipeline.py --width 256 --batches 8 --repeats 1   # a smoke run

A microbatch must be large enough for a matrix product to run as fast per row as a whole
batch's: the row "microbatches accumulated" is one thread training each batch cut into the most
microbatches asked for. The default batch, 2048, makes microbatches of 256 rows at M = 8 (the
batch of 256 that an earlier run used made them of 32, and 8 microbatches did worse than 4).

Each contender trains the same batches; the wrapper's first fit() starts its processes and shapes
the schedule's buffers, and is not timed: the median of the next `repeats` fits is. A fit's time
includes sending the state to the stages and joining it back, once per fit. With M microbatches
GPipe's and 1F1B's bubble is (S - 1) / (M + S - 1), so the best ratio two stages can reach is
M / (M + 1) (0.89 at M = 8).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from common import run_processes, table, write_results
from parallelwrapper import ParallelWrapper


def mlp(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def data(width: int, batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, width, (batch,), generator=g)) for _ in range(n)]


def _pass(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]], microbatches: int = 1) -> float:
    """Seconds to train `batches` once, each batch's gradients accumulated over its microbatches."""
    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (nn.functional.cross_entropy(model(xs), ys) / microbatches).backward()
        optimizer.step()
    return time.perf_counter() - start


def plain(batches: list[tuple[torch.Tensor, torch.Tensor]], width: int, repeats: int, microbatches: int = 1) -> float:
    """Seconds per fit of one process, one thread, over `batches` (cut into `microbatches`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = mlp(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        return statistics.median([_pass(model, optimizer, batches, microbatches) for _ in range(repeats + 1)][1:])
    finally:
        torch.set_num_threads(threads)


def _independent(rank: int, world: int, width: int, batches: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> float:
    """One of `world` processes each running `plain`'s loop at once, in step: what this machine's
    cores give two processes that never wait for each other (the ceiling a pipeline can reach)."""
    model = mlp(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        times.append(_pass(model, optimizer, batches))
    return statistics.median(times[1:])


def _bare_stage(rank: int, world: int, width: int, batches: list[tuple[torch.Tensor, torch.Tensor]], repeats: int, microbatches: int) -> float:
    """One stage of torch.distributed.pipelining's own schedule, no wrapper: seconds per pass over `batches`."""
    stage = PipelineStage(_half(width, rank), rank, world, torch.device("cpu"))
    kind = Schedule1F1B if microbatches >= world else ScheduleGPipe
    schedule = kind(stage, microbatches, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        for x, y in batches:
            optimizer.zero_grad()
            schedule.step(x) if rank == 0 else schedule.step(target=y)
            optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _half(width: int, rank: int) -> nn.Module:
    """The stage of `mlp(width)` that `.pipeline(stages=2)` makes: 4 layers each, the cut at the first
    place where half the parameters are before it (the ReLU after it goes to stage 1)."""
    layers = list(mlp(width))
    return nn.Sequential(*(layers[:7] if rank == 0 else layers[7:]))


def wrapped(batches: list[tuple[torch.Tensor, torch.Tensor]], width: int, repeats: int, workers: int, stages: int, microbatches: int) -> float:
    """Seconds per fit of `workers` workers (of `stages` stages each) over `batches`, one thread a process."""
    builder = ParallelWrapper.builder(mlp(width)).workers(workers).threads_per_worker(1).deterministic(True)
    builder = builder.optimizer(torch.optim.SGD, lr=0.01).averaging_frequency(len(batches))
    if stages > 1:
        builder = builder.pipeline(stages=stages, microbatches=microbatches)
    with builder.build() as wrapper:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            wrapper.fit(batches)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2048, help="rows a batch; cut into M microbatches")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/pipeline.json")
    args = parser.parse_args()
    batches = data(args.width, args.batch, args.batches)
    one = plain(batches, args.width, args.repeats)
    # Two processes that never wait for each other, each training all the batches: the speedup
    # this machine's two cores give at best (2x on ideal cores).
    ceiling = 2 * one / max(run_processes(_independent, 2, args.width, batches, args.repeats))
    rows: list[list[Any]] = [["1 process, 1 thread", "-", one, 1.0, "-", "-"], ["2 independent processes (the cores' ceiling)", "-", "-", ceiling, ceiling / 2, 1.0]]
    # What cutting a batch costs one thread at all: the microbatches' smaller matrix products.
    cut = plain(batches, args.width, args.repeats, max(args.microbatches))
    rows.append([f"1 process, 1 thread, {max(args.microbatches)} microbatches accumulated", max(args.microbatches), cut, one / cut, "-", "-"])
    for m in args.microbatches:
        t = wrapped(batches, args.width, args.repeats, 1, 2, m)
        rows.append(["1 worker x 2 stages", m, t, one / t, one / t / 2, one / t / ceiling])
        # torch.distributed.pipelining's schedule alone, in 2 processes: what the wrapper adds to it.
        bare = run_processes(_bare_stage, 2, args.width, batches, args.repeats, m)[0]
        rows.append(["bare torch pipelining, 2 processes", m, bare, one / bare, one / bare / 2, one / bare / ceiling])
    # Two workers of two stages each against four unsplit workers: the same four processes, each
    # deal of the batches trained by half as many, at twice the speed at best.
    four = wrapped(batches, args.width, args.repeats, 4, 1, 1)
    two_by_two = wrapped(batches, args.width, args.repeats, 2, 2, 8)
    rows += [["4 workers", "-", four, one / four, "-", "-"], ["2 workers x 2 stages", 8, two_by_two, one / two_by_two, "-", "-"]]
    headers = ["contender", "microbatches", "s per fit", "speedup", "ratio to ideal 2x", "ratio to the cores' ceiling"]
    print(table(headers, rows))
    print(f"2 workers x 2 stages take {two_by_two / four:.2f}x the time of 4 unsplit workers")
    write_results(args.out, {"args": vars(args), "headers": headers, "rows": rows, "two_by_two_over_four": two_by_two / four})


if __name__ == "__main__":
    main()
