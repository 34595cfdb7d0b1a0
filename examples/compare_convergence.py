"""Synchronous gradients against model averaging, from Python: what `pw-fit compare` runs.

Shared gradients average the gradients after every step (one all-reduce of the gradients per
step, the DataParallelTable / DDP way). Model averaging lets each worker take k steps on its own,
then averages the parameters and the optimizer state (one all-reduce per k steps, of about twice
the size with momentum). Which converges faster, per sample and per second, and what does each
send? Every run starts from the same weights and sees the same batches on the same workers.

    python examples/compare_convergence.py --data-dir ../shared/data/mnist --out runs/compare
    python examples/compare_convergence.py --data-dir ../shared/data/mnist --out /tmp/c --tiny

It writes compare.csv, compare.md and compare.png into --out, and prints the table and a line per run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parallelwrapper.app.compare import CompareOptions, compare
from parallelwrapper.app.options import RunOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=None, help="MNIST IDX files (default: the cache dir, downloading)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--tiny", action="store_true", help="2,048 training and 1,000 test images, k = 1 and 4: a smoke run")
    args = parser.parse_args()

    # Everything the runs share: DL4J's example setup (LeNet, 2 workers, batch 128, Nesterov).
    base = RunOptions.of(workers=2, batch_size=128, optimizer="nesterov", epochs=1, data_dir=args.data_dir)
    options = CompareOptions(base, frequencies=(1, 4, 16), shared_gradients=True, evals_per_epoch=8, target_accuracy=0.97, out=args.out)
    if args.tiny:
        base = RunOptions.of(workers=2, data_dir=args.data_dir, train_samples=2048, test_samples=1000)
        options = CompareOptions(base, frequencies=(1, 4), evals_per_epoch=2, target_accuracy=0.5, out=args.out)

    results = compare(options, echo=print)  # prints each run's progress, then compare.md's table
    for r in results:
        hit = r.first_reaching(options.target_accuracy)
        reached = f"{hit.samples:,} samples, {hit.seconds:.1f} s" if hit else "not reached"
        print(f"{r.spec.label:>18}: {r.final.test_accuracy:.4f} after {r.final.samples:,} samples; "
              f"{options.target_accuracy:.0%} reached at {reached}; "
              f"{r.final.collectives:,} collectives, {r.final.bytes_per_worker / 1e6:.1f} MB sent per worker")  # fmt: skip


if __name__ == "__main__":
    main()
