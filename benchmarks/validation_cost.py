"""What validation costs a fit, and who should do it: every worker scoring its share of the
validation set (what `.validation(data)` does) against one worker scoring all of it while the
others wait at the gather, and against no validation. LeNet on MNIST, two workers of one thread
each, training on the first `--train-batches` batches, validation on the 10,000 test images
every `--every` averagings and at the epoch's end; the three contenders alternate, `--repeats`
times each.

    python benchmarks/validation_cost.py --repeats 5

"One worker" hands the validation data to the workers as a DataLoader whose sampler (a
DistributedSampler, which the wrapper takes as each rank's share already) gives every batch to
rank 0 and none to the others: the same batches, the same single gather, only the split differs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import BATCH, DEFAULT_DATA_DIR, lenet, mnist_batches, nesterov, table, write_results
from parallelwrapper import ParallelWrapper
from parallelwrapper.app.mnist import load_mnist


class RankZeroSampler(DistributedSampler):  # type: ignore[type-arg]
    """Every index on rank 0, none elsewhere."""

    def __init__(self, dataset: Any) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=False)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.dataset)) if dist.get_rank() == 0 else [])  # type: ignore[arg-type]


def run(train: list[Any], validation: Any, every: int, k: int) -> float:
    builder = ParallelWrapper.builder(lenet()).optimizer(nesterov).workers(2).threads_per_worker(1).averaging_frequency(k)
    if validation is not None:
        builder = builder.validation(validation, every=every)
    with builder.build() as wrapper:
        wrapper.fit(train[:8])  # start-up, outside the timing
        start = time.perf_counter()
        history = wrapper.fit(train)
        seconds = time.perf_counter() - start
    if validation is not None:
        assert history.validations and history.validations[-1].metrics["val_accuracy"] > 0.9
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-batches", type=int, default=120)
    parser.add_argument("--every", type=int, default=5, help="averagings between validations")
    parser.add_argument("--k", type=int, default=4, help="averaging frequency")
    parser.add_argument("--out", default="benchmarks/results/validation_cost.json")
    args = parser.parse_args()
    train = mnist_batches(args.data_dir)[: args.train_batches]
    test = load_mnist(args.data_dir, "test", download=False)
    shared = test.batches(1000)
    dataset = TensorDataset(*(torch.cat(parts) for parts in zip(*shared, strict=True)))
    one_worker = DataLoader(dataset, batch_size=1000, sampler=RankZeroSampler(dataset))
    contenders = {"no validation": None, "every worker its share": shared, "one worker, others wait": one_worker}
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, validation in contenders.items():
            seconds[name].append(run(train, validation, args.every, args.k))
            print(f"{name}: {seconds[name][-1]:.2f} s", flush=True)
    base = statistics.median(seconds["no validation"])
    rounds = -(-len(train) // (2 * args.k))
    validations = rounds // args.every + (rounds % args.every != 0)  # the last due one may be the epoch's end
    rows = []
    for name, times in seconds.items():
        median = statistics.median(times)
        per = (median - base) / validations if name != "no validation" else 0.0
        rows.append([name, median, median / base, per])
    print(table(["contender", "fit s (median)", "× no validation", "s per validation"], rows))
    print(f"{len(train)} batches of {BATCH}, k = {args.k}: {rounds} rounds, {validations} validations of 10,000 images")
    write_results(args.out, {"args": vars(args), "seconds": seconds, "validations": validations, "rows": rows})


if __name__ == "__main__":
    main()
