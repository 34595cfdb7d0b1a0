"""Overlap and an outer optimizer together: the 2-epoch MNIST test accuracy of DiLoCo's recipe
with and without `.overlap_averaging(True)` and an int8 payload (issue 37):

    python benchmarks/overlap_outer.py --seeds 1,2,3 --lock /tmp/pw-heavy.lock
    python benchmarks/overlap_outer.py --revision 0186700 --out benchmarks/results/overlap_outer_before.json

LeNet, 2 workers, k = 16, inner Nesterov SGD lr 0.02 (momentum 0.9), outer SGD lr 0.7 with
Nesterov momentum 0.9 where a contender has one, dealt batches (`--deterministic`: each seed's
run is the same every time), one `pw-fit` run per contender and seed. `--revision` runs the
package of an earlier commit instead of this tree (git archive, as before_after.py). A run
that fails (a NaN loss) counts as such, with the step pw-fit names. With `--lock`, each run
takes the lock file on its own (flock), so that others sharing the machine get turns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from before_after import export
from common import DEFAULT_DATA_DIR, table, write_results

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--epochs", "2", "--workers", "2", "--averaging-frequency", "16", "--optimizer", "nesterov", "--lr", "0.02", "--device", "cpu"]
OUTER = ["--outer-lr", "0.7", "--outer-momentum", "0.9"]
CONTENDERS: dict[str, list[str]] = {
    "sync-outer": OUTER,
    "sync-outer-int8": [*OUTER, "--payload-dtype", "int8"],
    "overlap": ["--overlap-averaging"],
    "overlap-outer": ["--overlap-averaging", *OUTER],
    "overlap-outer-int8": ["--overlap-averaging", *OUTER, "--payload-dtype", "int8"],
    "overlap-outer-int8-f2": ["--overlap-averaging", *OUTER, "--payload-dtype", "int8", "--fragments", "2"],
}
LABELS = {
    "sync-outer": "outer, no overlap",
    "sync-outer-int8": "outer, no overlap, int8",
    "overlap": "overlap, no outer",
    "overlap-outer": "overlap and outer",
    "overlap-outer-int8": "overlap and outer, int8",
    "overlap-outer-int8-f2": "overlap and outer, int8, 2 fragments",
}


def once(tree: Path, flags: list[str], seed: int, deterministic: bool, data_dir: str, lock: str | None) -> dict[str, Any]:
    """One pw-fit run of the recipe with `flags` from the package in `tree`: its accuracies, or its failure."""
    with tempfile.TemporaryDirectory() as out:
        args = [*RECIPE, *flags, "--seed", str(seed), "--data-dir", data_dir, "--no-download", "--out", out]
        args += ["--deterministic"] if deterministic else []
        command = [sys.executable, "-c", "from parallelwrapper.app.cli import main; main()", *args]
        command = ["flock", lock, *command] if lock else command
        env = {**os.environ, "PYTHONPATH": str(tree)}  # that tree's package, for the spawned workers too
        start = time.monotonic()
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
        seconds = time.monotonic() - start
        summary = Path(out) / "summary.json"
        if done.returncode != 0 or not summary.exists():
            lines = [line for line in done.stderr.splitlines() if "Error" in line] or [f"exit {done.returncode}"]
            return {"accuracy": None, "failure": lines[-1], "seconds": seconds}
        s = json.loads(summary.read_text())
        return {"accuracy": s["test_accuracy"], "epoch_accuracies": s["epoch_accuracies"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--revision", default=None, help="an earlier commit to run instead of this tree")
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false", help="the first-come feed instead of dealt batches")
    parser.add_argument("--lock", default=None, help="a file each run takes with flock, e.g. /tmp/pw-heavy.lock")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/overlap_outer.json")
    args = parser.parse_args()
    names, seeds = args.contenders.split(","), [int(s) for s in args.seeds.split(",")]
    runs: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    with tempfile.TemporaryDirectory() as exported:
        tree = ROOT if args.revision is None else export(args.revision, Path(exported))
        for seed in seeds:  # every contender on a seed before the next seed: the machine's drift touches all alike
            for name in names:
                runs[name][seed] = once(tree, CONTENDERS[name], seed, args.deterministic, args.data_dir, args.lock)
                print(f"{name} seed {seed}: {runs[name][seed]}", flush=True)
    rows = []
    for name in names:
        accuracies = [r["accuracy"] for r in runs[name].values()]
        finished = [a for a in accuracies if a is not None]
        cells = " / ".join("NaN" if a is None else f"{a:.4f}" for a in accuracies)
        mean = f"{statistics.fmean(finished):.4f}" if finished else "–"
        rows.append([LABELS[name], cells, mean, f"{len(accuracies) - len(finished)} of {len(accuracies)}"])
    print(table(["run", f"test accuracy (seeds {args.seeds})", "mean of finished", "failed"], rows))
    revision = args.revision or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    write_results(args.out, {"revision": revision, "recipe": RECIPE, "outer": OUTER, "deterministic": args.deterministic, "seeds": seeds, "runs": runs})


if __name__ == "__main__":
    main()
