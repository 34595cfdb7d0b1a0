"""What the feed costs a spawned worker: the same worker loop in a spawned process, fed two ways.
(`.workers(1)` on the CPU trains in the caller's process and has no feed; two or more workers
are spawned and fed this way.)

    python benchmarks/feed_cost.py

  fed          batches arrive through the shared queue and shared-memory slots while the worker
               trains: a Feeder thread in this process packs one each time the worker frees a slot
  received     the same queue and slots, but every batch is received before the clock starts

Both run `Rounds.run` (one worker, a gloo group of one, averaging every 3 steps) with as many
intra-op threads as this machine has cores, on the same batches, alternating, and report
steady-state samples/s over the whole epoch. The difference is what feeding during training
costs the worker.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from common import DEFAULT_DATA_DIR, LR, MOMENTUM, lenet, mnist_batches, table, write_results
from parallelwrapper.config import Config
from parallelwrapper.feed.queue import Feeder, QueueSource
from parallelwrapper.feed.slots import SlotReader, SlotWriter
from parallelwrapper.job import Job
from parallelwrapper.rounds import Rounds
from parallelwrapper.worker import Replica


class _Received:
    """Every item of a source, taken before training."""

    def __init__(self, source: QueueSource) -> None:
        self._items: list[Any] = []
        while isinstance(item := source.next_batch(), tuple):
            self._items.append(item)
        self._items.append(item)  # END

    def epoch_length(self, epoch: int) -> int | None:
        return None

    def next_batch(self) -> Any:
        return self._items.pop(0)


def _worker(data: Any, free: Any, mode: str, threads: int, results: Any) -> None:
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = lenet()
    job = Job(model, torch.optim.SGD, {"lr": LR, "momentum": MOMENTUM, "nesterov": True}, nn.functional.cross_entropy, None)
    config, cpu = Config(workers=1, averaging_frequency=3), torch.device("cpu")
    rounds = Rounds(Replica(model, job, config, cpu, 0, 1), config, cpu, 0, 1)
    source: Any = QueueSource(data, SlotReader(free), os.getppid())
    if mode == "received":
        source = _Received(source)
    samples = []
    start = time.monotonic()
    rounds.run(1, source, lambda report: samples.append(report.counters.samples))
    results.put(samples[-1] / (time.monotonic() - start))
    dist.destroy_process_group()


def _run(batches: list[Any], mode: str, threads: int) -> float:
    ctx = mp.get_context("spawn")
    slots = len(batches) + 1 if mode == "received" else 16  # received: all packed at once
    data, free, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    writer = SlotWriter(free, slots)
    process = ctx.Process(target=_worker, args=(data, free, mode, threads, results), daemon=True)
    process.start()
    feeder = Feeder(batches, 0, 1, 0, [data], 1, writer).start()
    try:
        rate: float = results.get(timeout=600)
    finally:
        process.join(timeout=30)
        feeder.stop()
        writer.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/feed_cost.json")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    batches = mnist_batches(args.data_dir)[: args.steps]
    rates: dict[str, list[float]] = {"fed": [], "received": []}
    for _ in range(args.repeats):
        for mode in rates:
            rates[mode].append(_run(batches, mode, threads))
    fed, received = statistics.median(rates["fed"]), statistics.median(rates["received"])
    print(f"LeNet, MNIST, batch 128, one worker of {threads} threads, {args.steps} batches, median of {args.repeats}")
    print(table(["fed samples/s", "received samples/s", "ratio"], [(fed, received, fed / received)]))
    write_results(args.out, {"steps": args.steps, "threads": threads, "all": rates, "ratio": fed / received})


if __name__ == "__main__":
    main()
