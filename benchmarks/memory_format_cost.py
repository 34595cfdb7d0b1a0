"""What keeping a batch's memory format through the shared-memory slots costs (issue 35, item A):

    python benchmarks/memory_format_cost.py

A batch of images (float32, labels beside them) through a SlotWriter and a SlotReader, three ways:

  row-major            a row-major batch: a plain contiguous copy each side, the reference
  channels_last kept   a channels_last batch, copied as it lies in memory and rebuilt with its
                       strides: it arrives channels_last (what the slots do now)
  made row-major       the same channels_last batch made contiguous on the feeder's side (what the
                       slots did before), and converted back to channels_last by the worker, as a
                       channels_last model's convolution does with a row-major input

Timed apart: the feeder's side (the copy into the slot, `SlotWriter.pack`, and the row-major
copy before it) and the worker's side (the copy out, `SlotReader.unpack`, and the conversion
after it), in ms a batch, one thread, in this process (the slots' copies are the same in any).
Each round runs the contenders in a rotated order, `--batches` batches each; the medians over
the rounds are reported, and the ratios to the row-major batch (the median of the rounds' own
ratios). Every batch is checked to arrive as the contender says.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from common import median_ratio, rotated, table, write_results
from parallelwrapper.feed.slots import SlotReader, SlotWriter

SHAPES = {"CIFAR, 128 x 3 x 32 x 32": (128, 3, 32, 32), "ImageNet, 32 x 3 x 224 x 224": (32, 3, 224, 224)}
CL = torch.channels_last

# name: (what the feeder sends of the channels_last batch, what the worker does with what arrives,
# the format it must then be in)
Contender = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], torch.memory_format]
CONTENDERS: dict[str, Contender] = {
    "row-major": (lambda x: x, lambda x: x, torch.contiguous_format),
    "channels_last kept": (lambda x: x, lambda x: x, CL),
    "made row-major": (lambda x: x.contiguous(), lambda x: x.contiguous(memory_format=CL), CL),
}


def _one(writer: SlotWriter, reader: SlotReader, batch: tuple[torch.Tensor, torch.Tensor], contender: Contender) -> tuple[float, float]:
    """(feeder's s, worker's s) for one batch."""
    send, receive, arrives = contender
    t0 = time.perf_counter()
    packed = writer.pack((send(batch[0]), batch[1]), lambda: True)
    t1 = time.perf_counter()
    assert packed is not None
    x, _ = reader.unpack(*packed)
    x = receive(x)
    t2 = time.perf_counter()
    if not x.is_contiguous(memory_format=arrives):
        raise RuntimeError(f"the batch arrived with strides {x.stride()}, not in {arrives}")
    return t1 - t0, t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40, help="batches a contender a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/memory_format_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    free = multiprocessing.get_context("spawn").Queue()
    writer, reader = SlotWriter(free, slots=2), SlotReader(free)
    names = list(CONTENDERS)
    results: dict[str, Any] = {}
    rows = []
    try:
        for shape_name, shape in SHAPES.items():
            g = torch.Generator().manual_seed(0)
            images = torch.randn(*shape, generator=g)
            batches = {
                "row-major": (images, torch.randint(0, 10, (shape[0],), generator=g)),
                "channels_last": (images.contiguous(memory_format=CL), torch.randint(0, 10, (shape[0],), generator=g)),
            }
            ms: dict[str, dict[str, list[float]]] = {name: {"feeder": [], "worker": []} for name in names}
            for r in range(args.rounds):
                for name in rotated(names, r):
                    batch = batches["row-major" if name == "row-major" else "channels_last"]
                    _one(writer, reader, batch, CONTENDERS[name])  # the slots sized, the pages touched
                    times = [_one(writer, reader, batch, CONTENDERS[name]) for _ in range(args.batches)]
                    for side, i in (("feeder", 0), ("worker", 1)):
                        ms[name][side].append(1000 * statistics.fmean(t[i] for t in times))
            base = ms["row-major"]
            for name in names:
                mine = ms[name]
                rows.append(
                    (
                        shape_name, name,
                        statistics.median(mine["feeder"]), median_ratio(mine["feeder"], base["feeder"]),
                        statistics.median(mine["worker"]), median_ratio(mine["worker"], base["worker"]),
                    )
                )  # fmt: skip
            kept, made = ms["channels_last kept"], ms["made row-major"]
            results[shape_name] = {
                "shape": shape,
                "ms": ms,
                "ratios_to_row_major": {name: {side: median_ratio(ms[name][side], base[side]) for side in base} for name in names},
                "made_row_major_over_kept": {side: median_ratio(made[side], kept[side]) for side in kept},
            }
    finally:
        reader.close()
        writer.close()
    print(f"one thread, {args.batches} batches a contender a round, median of {args.rounds} rounds, ms a batch")
    print(table(["batch", "contender", "feeder ms", "x row-major", "worker ms", "x row-major"], rows))
    for shape_name, r in results.items():
        over = r["made_row_major_over_kept"]
        print(f"{shape_name}: made row-major over kept, feeder {over['feeder']:.3g}x, worker {over['worker']:.3g}x")
    write_results(args.out, {"batches": args.batches, "rounds": args.rounds, "threads": 1, "results": results})


if __name__ == "__main__":
    main()
