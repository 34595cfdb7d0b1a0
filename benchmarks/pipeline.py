"""A pipeline's speed (issue 24): 1 worker x 2 stages (`.pipeline(stages=2)`, one thread per
stage) against one process with one thread, on an MLP of 8 equal layers, for 1, 4 and 8
microbatches (and 16), by the 1F1B and zero bubble V ("zbv") schedules, as the ratio to the ideal
2x, beside torch.distributed.pipelining's own schedule in two bare processes (what the wrapper
adds); and 2 workers x 2 stages against 4 unsplit workers.
Two independent processes, each training every batch at once, give the speedup the machine's two
cores allow at all (the last column's ratios are to it).

    python -m benchmarks pipeline                      # width 1024, batch 2048, 16 batches a fit
    python -m benchmarks pipeline --batch 256 --batches 24   # microbatches of 32 rows at M = 8
    python -m benchmarks pipeline --width 256 --batches 8 --repeats 1   # a smoke run

A microbatch must be large enough for a matrix product to run as fast per row as a whole
batch's: the row "microbatches accumulated" is one thread training each batch cut into the most
microbatches asked for. The default batch, 2048, makes microbatches of 256 rows at M = 8 (the
batch of 256 that an earlier run used made them of 32, and 8 microbatches did worse than 4).

Each contender trains the same batches, and stays up from round to round. For each M, the one
process and the pipelines run one fit each in turn, `repeats` + 1 rounds, the order rotating,
and the first round (processes starting, a schedule's buffers shaped) is not counted: a row's
ratios are the medians of each round's ratio to the one process's time in the same round, so
that the machine's speed drifting over minutes does not move them. A fit's time includes
sending the state to the stages and joining it back, once per fit. With M microbatches GPipe's
and 1F1B's bubble is (S - 1) / (M + S - 1), so the best ratio two stages can reach is M / (M + 1)
(0.89 at M = 8). Zero bubble's V fills it with the weights' gradients, which no stage waits for;
each stage holds two pieces of the model, so that the activations cross between the processes
three times a microbatch instead of once.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZBVZeroBubble

from benchmarks.common import median_ratio, peer_context, rotated, run_processes, table, write_results
from parallelwrapper import ParallelWrapper

Batches = list[tuple[torch.Tensor, torch.Tensor]]


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


class Plain:
    """One process, one thread (this one), over `batches` cut into `microbatches`."""

    def __init__(self, width: int, batches: Batches, microbatches: int = 1) -> None:
        self.model, self.batches, self.microbatches = mlp(width), batches, microbatches
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def __call__(self) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _pass(self.model, self.optimizer, self.batches, self.microbatches)
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        pass


def _independent(rank: int, world: int, width: int, batches: Batches, repeats: int) -> float:
    """One of `world` processes each running `Plain`'s loop at once, in step: what this machine's
    cores give two processes that never wait for each other (the ceiling a pipeline can reach)."""
    model = mlp(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        times.append(_pass(model, optimizer, batches))
    return statistics.median(times[1:])


def pieces(width: int, count: int) -> list[nn.Sequential]:
    """`mlp(width)` cut into `count` pieces of equal layers, each Linear with the ReLU after it: how
    `.pipeline(stages=2)` cuts these 8 equal layers (2 pieces; 4 with "zbv")."""
    modules = list(mlp(width))
    layers = [modules[i : i + 2] for i in range(0, len(modules), 2)]  # (Linear, ReLU), the last Linear alone
    per = len(layers) // count
    return [nn.Sequential(*(m for layer in layers[p * per : (p + 1) * per] for m in layer)) for p in range(count)]


def _bare_stage(rank: int, world: int, width: int, batches: Batches, microbatches: int, schedule: str, commands: list[Any], times: Any) -> None:
    """One stage of torch.distributed.pipelining's own schedule, no wrapper, on the pieces that
    `.pipeline(stages=2, schedule=schedule)` makes, held as a stage's process holds them (with
    "zbv" pieces s and 2S - 1 - s, the first stage scoring): a pass over `batches` for each
    command, its seconds on `times` (rank 0), until a None."""
    v = schedule == "zbv"
    count = 2 * world if v else world
    held = (rank, count - 1 - rank) if v else (rank,)
    mine = [pieces(width, count)[i] for i in held]
    stages = [PipelineStage(piece, i, count, torch.device("cpu")) for piece, i in zip(mine, held)]
    loss = nn.functional.cross_entropy
    # torch's 1F1B refuses fewer microbatches than stages, where its warm-up takes them all: GPipe.
    run: Any = ScheduleZBVZeroBubble(stages, microbatches, loss_fn=loss) if v else (Schedule1F1B if microbatches >= world else ScheduleGPipe)(stages[0], microbatches, loss_fn=loss)
    scores = 0 if v else world - 1
    optimizer = torch.optim.SGD([p for piece in mine for p in piece.parameters()], lr=0.01)
    while commands[rank].get() is not None:
        dist.barrier()
        start = time.perf_counter()
        for x, y in batches:
            optimizer.zero_grad()
            given = (x,) if rank == 0 else ()
            if rank == scores:
                run.step(*given, target=y)
            else:
                run.step(*given)
            optimizer.step()
        dist.barrier()
        if rank == 0:
            times.put(time.perf_counter() - start)


class Bare:
    """`_bare_stage` in two processes (common.run_processes') that stay up between passes."""

    def __init__(self, width: int, batches: Batches, microbatches: int, schedule: str) -> None:
        ctx = peer_context()  # run_processes', whose processes take the queues
        self.commands, self.times = [ctx.Queue() for _ in range(2)], ctx.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(width, batches, microbatches, schedule), daemon=True)
        self.thread.start()

    def _run(self, *args: Any) -> None:
        try:
            run_processes(_bare_stage, 2, *args, self.commands, self.times)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            self.error = e

    def __call__(self) -> float:
        for q in self.commands:
            q.put(True)
        while True:
            try:
                return float(self.times.get(timeout=5))
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError(f"the bare pipeline's processes ended: {self.error}") from self.error

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        self.thread.join()


class Wrapped:
    """`workers` workers (of `stages` stages each, by `schedule`), one thread a process: a fit over `batches`."""

    def __init__(self, width: int, batches: Batches, workers: int, stages: int, microbatches: int = 1, schedule: str = "1f1b") -> None:
        builder = ParallelWrapper.builder(mlp(width)).workers(workers).threads_per_worker(1).deterministic(True)
        builder = builder.optimizer(torch.optim.SGD, lr=0.01).averaging_frequency(len(batches))
        if stages > 1:
            builder = builder.pipeline(stages=stages, microbatches=microbatches, schedule=schedule)
        self.wrapper, self.batches = builder.build(), batches

    def __call__(self) -> float:
        start = time.perf_counter()
        self.wrapper.fit(self.batches)
        return time.perf_counter() - start

    def close(self) -> None:
        self.wrapper.close()


def interleaved(contenders: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Each contender's seconds a fit over `repeats` rounds, one fit each a round in an order
    that rotates, after a first round that is not counted; the contenders are closed after."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for r in range(repeats + 1):
            for name in rotated(names, r):
                times[name].append(contenders[name]())
    finally:
        for contender in contenders.values():
            contender.close()
    return {name: t[1:] for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2048, help="rows a batch; cut into M microbatches")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", choices=["1f1b", "zbv"], default=["1f1b", "zbv"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/pipeline.json")
    args = parser.parse_args(argv)
    batches = data(args.width, args.batch, args.batches)
    # What this machine's two cores give two processes that never wait for each other (2x on
    # ideal cores), and what cutting a batch costs one thread at all (smaller matrix products):
    # each against the one process, measured just before it.
    context = interleaved({"one": Plain(args.width, batches), "cut": Plain(args.width, batches, max(args.microbatches))}, args.repeats)
    one = statistics.median(context["one"])
    ceiling = 2 * one / max(run_processes(_independent, 2, args.width, batches, args.repeats))
    cut = statistics.median(context["cut"])
    rows: list[list[Any]] = [
        ["1 process, 1 thread", "-", one, 1.0, "-", "-"],
        ["2 independent processes (the cores' ceiling)", "-", "-", ceiling, ceiling / 2, 1.0],
        [f"1 process, 1 thread, {max(args.microbatches)} microbatches accumulated", max(args.microbatches), cut, median_ratio(context["one"], context["cut"]), "-", "-"],
    ]
    rounds: dict[str, dict[str, list[float]]] = {}
    for m in args.microbatches:
        contenders: dict[str, Any] = {"1 process, 1 thread": Plain(args.width, batches)}
        for schedule in args.schedules:
            contenders[f"1 worker x 2 stages, {schedule}"] = Wrapped(args.width, batches, 1, 2, m, schedule)
            # torch.distributed.pipelining's schedule alone, in 2 processes: what the wrapper adds to it.
            contenders[f"bare torch pipelining, {schedule}, 2 processes"] = Bare(args.width, batches, m, schedule)
        times = rounds[f"M={m}"] = interleaved(contenders, args.repeats)
        base = times["1 process, 1 thread"]
        for name, t in list(times.items())[1:]:
            speedup = median_ratio(base, t)
            rows.append([name, m, statistics.median(t), speedup, speedup / 2, speedup / ceiling])
    # Two workers of two stages each against four unsplit workers: the same four processes, each
    # deal of the batches trained by half as many, at twice the speed at best.
    dp: dict[str, Any] = {"4 workers": Wrapped(args.width, batches, 4, 1)}
    for schedule in args.schedules:
        dp[f"2 workers x 2 stages, {schedule}"] = Wrapped(args.width, batches, 2, 2, 8, schedule)
    times = rounds["data parallel"] = interleaved(dp, args.repeats)
    four = times["4 workers"]
    rows.append(["4 workers", "-", statistics.median(four), "-", "-", "-"])
    over_four = {}
    for name, t in list(times.items())[1:]:
        over_four[name] = median_ratio(t, four)
        rows.append([name, 8, statistics.median(t), "-", "-", "-"])
    headers = ["contender", "microbatches", "s per fit", "speedup", "ratio to ideal 2x", "ratio to the cores' ceiling"]
    print(table(headers, rows))
    print("the time of 4 unsplit workers, by " + ", ".join(f"{name}: {r:.2f}x" for name, r in over_four.items()))
    write_results(args.out, {"args": vars(args), "headers": headers, "rows": rows, "two_by_two_over_four": over_four, "rounds": rounds})


if __name__ == "__main__":
    main()
