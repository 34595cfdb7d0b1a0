"""What replacing a lost worker costs on MNIST: `pw-fit` (LeNet, two workers, one epoch,
--deterministic) three ways, alternating, `--repeats` times each:

- raise: the default, no fault;
- replace: `--max-replacements 1`, no fault: what keeping each round's starting state (a copy in
  every worker) and holding each round's slots until it lands cost;
- replace+kill: `--max-replacements 1`, and worker 1's process SIGKILLed once
  `--kill-after` score records are written (the kernel's OOM killer would do the same).

For the kill: the seconds from the kill to the first score written after the replacement's
record (training again), and the wall time and samples/s lost against `replace`.

Then where the state a replacement starts from is best kept, for pw-fit's model and optimizer:
a copy in every worker at each round's start (what `replace` does), or rank 0 sending it to the
main process each round, timed as its pickling through a multiprocessing queue and back.

    python benchmarks/recovery_cost.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from common import DEFAULT_DATA_DIR, lenet, mnist_batches, nesterov, table, write_results
from parallelwrapper.job import Job
from parallelwrapper.parts import Parts

CONTENDERS = ("raise", "replace", "replace+kill")


def pw_fit() -> str:
    return str(Path(sys.executable).with_name("pw-fit"))


def worker_1(pid: int) -> int:
    """The process of worker 1 among those pw-fit spawned (not its resource tracker): the
    workers start in rank order, and the standby a replacement takes after them."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sorted(int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())[1]


def records(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def run(contender: str, data_dir: str, kill_after: int) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="pw-recovery-"))
    args = [pw_fit(), "--data-dir", data_dir, "--deterministic", "--out", str(out)]
    if contender != "raise":
        args += ["--max-replacements", "1"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    result: dict[str, Any] = {"contender": contender}
    try:
        if contender == "replace+kill":
            metrics = out / "metrics.jsonl"
            while sum(r["kind"] == "score" for r in records(metrics)) < kill_after:
                time.sleep(0.02)
            killed = time.monotonic()
            os.kill(worker_1(proc.pid), signal.SIGKILL)
            while True:
                kinds = [r["kind"] for r in records(metrics)]
                if "replacement" in kinds and "score" in kinds[kinds.index("replacement") :]:
                    break
                if proc.poll() is not None:
                    raise RuntimeError("pw-fit ended without training again after the kill")
                time.sleep(0.02)
            result["seconds_to_training_again"] = time.monotonic() - killed
        stdout, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"{contender}: pw-fit exited with {proc.returncode}:\n{stdout}")
    summary = json.loads((out / "summary.json").read_text())
    result.update({k: summary[k] for k in ("wall_seconds", "wall_samples_per_second", "train_samples_per_second", "test_accuracy", "rounds", "replacements")})
    return result


def keeping_cost(data_dir: str, rounds: int = 50) -> dict[str, float]:
    """Seconds per round to keep pw-fit's state: a deep copy in the worker, or a trip through a queue."""
    model = lenet()
    job = Job(model, torch.optim.SGD, {}, torch.nn.functional.cross_entropy, None, optimizer_fn=nesterov)
    parts = Parts(model, job, 2)
    for x, y in mnist_batches(data_dir)[:2]:  # the momentum buffers exist, as after any round
        parts.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        parts.optimizer.step()
    start = time.perf_counter()
    for _ in range(rounds):
        parts.state()  # a copy: what a worker keeps at each round's start
    copied = (time.perf_counter() - start) / rounds
    q = mp.get_context("spawn").Queue()
    start = time.perf_counter()
    for _ in range(rounds):
        q.put(parts.state())
        q.get()
    sent = (time.perf_counter() - start) / rounds
    q.close()
    return {"copy_in_worker_s": copied, "queue_to_main_s": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=20, help="score records written before the kill")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "recovery_cost.json"))
    a = parser.parse_args()
    runs: list[dict[str, Any]] = []
    for repeat in range(a.repeats):
        for contender in CONTENDERS:
            runs.append(run(contender, a.data_dir, a.kill_after))
            print(f"repeat {repeat}: {runs[-1]}", flush=True)

    def median(contender: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["contender"] == contender)

    base = {key: median("replace", key) for key in ("wall_seconds", "wall_samples_per_second", "train_samples_per_second")}
    rows = []
    for contender in CONTENDERS:
        wall, samples_s, train_s = (median(contender, k) for k in ("wall_seconds", "wall_samples_per_second", "train_samples_per_second"))
        again = median(contender, "seconds_to_training_again") if contender == "replace+kill" else None
        rows.append([contender, wall, samples_s, train_s, samples_s / base["wall_samples_per_second"], median(contender, "test_accuracy"), again if again is not None else "-"])
    keeping = keeping_cost(a.data_dir)
    per_round = base["wall_seconds"] / median("replace", "rounds")
    print(table(["contender", "wall s", "samples/s (wall)", "samples/s (training)", "x replace", "test accuracy", "s to training again"], rows))
    print(
        f"\nkeeping the state a round starts from (LeNet + Nesterov momentum): a copy in the worker "
        f"{keeping['copy_in_worker_s'] * 1e3:.2f} ms, through a queue to the main process "
        f"{keeping['queue_to_main_s'] * 1e3:.2f} ms; a round takes {per_round * 1e3:.1f} ms of wall time"
    )
    write_results(a.out, {"runs": runs, "rows": rows, "keeping": keeping, "round_wall_s": per_round})


if __name__ == "__main__":
    main()
