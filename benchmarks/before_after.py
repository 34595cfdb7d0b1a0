"""The wrapper's throughput on this tree against an earlier revision, interleaved in one run:

    python benchmarks/before_after.py 4ec3bcd --frequencies 1,3,10 --repeats 5

For a refactor that should change no speed. Each repeat runs every contender of
`throughput.py` that trains with the wrapper (`wrapper k` and `overlap k`) once from each tree,
in alternating order, each in a fresh process that imports that tree's package and its own
`benchmarks/throughput.py`: the machine's drift over minutes touches both trees alike. Reports
the median samples/s of each and the ratio this tree / the revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import DEFAULT_DATA_DIR, table, write_results

ROOT = Path(__file__).resolve().parents[1]
_RUN = (
    "import json, sys; sys.path.insert(0, 'benchmarks'); from throughput import wrapper; "
    "print(json.dumps(wrapper(2, {k}, {steps}, {warmup}, {data!r}, overlap={overlap})))"
)


def export(revision: str, into: Path) -> Path:
    """The files of `revision`, as they were committed (git archive: no worktree to clean up)."""
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def once(tree: Path, k: int, overlap: bool, steps: int, warmup: int, data_dir: str) -> float:
    code = _RUN.format(k=k, steps=steps, warmup=warmup, data=data_dir, overlap=overlap)
    env = {**os.environ, "PYTHONPATH": str(tree)}  # that tree's package, for the spawned workers too
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the run in {tree} failed:\n{out.stderr}")
    rate: float = json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revision", help="the earlier revision, e.g. a commit before the change")
    parser.add_argument("--frequencies", default="1,3,10")
    parser.add_argument("--steps", type=int, default=200, help="batches per worker")
    parser.add_argument("--warmup", type=int, default=20, help="batches per worker not timed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/before_after.json")
    args = parser.parse_args()
    contenders = [(f"{name} k={k}", k, name == "overlap") for k in map(int, args.frequencies.split(",")) for name in ("wrapper", "overlap")]
    rates: dict[str, dict[str, list[float]]] = {name: {"before": [], "after": []} for name, _, _ in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": export(args.revision, Path(tmp)), "after": ROOT}
        for r in range(args.repeats):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for name, k, overlap in contenders:
                for which in order:
                    rates[name][which].append(once(trees[which], k, overlap, args.steps, args.warmup, args.data_dir))
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    rows, results = [], {}
    for name, by in rates.items():
        before, after = statistics.median(by["before"]), statistics.median(by["after"])
        rows.append((name, before, after, after / before, f"{min(by['before']):.0f}-{max(by['before']):.0f}", f"{min(by['after']):.0f}-{max(by['after']):.0f}"))
        results[name] = {"before": by["before"], "after": by["after"], "ratio": after / before}
    print(f"LeNet, MNIST, batch 128, 2 workers, {args.steps} batches each, median of {args.repeats}; before = {args.revision}")
    print(table(["run", "before samples/s", "after samples/s", "after / before", "before range", "after range"], rows))
    write_results(args.out, {"revision": args.revision, "steps": args.steps, "repeats": args.repeats, "runs": results})


if __name__ == "__main__":
    main()
