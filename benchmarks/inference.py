"""Serving LeNet to concurrent callers, each sending single MNIST test images (issue 22).

    python -m benchmarks inference                      # 1, 8 and 32 callers, each contender
    python -m benchmarks inference --requests 1000000   # and the soak: BATCHED, 32 callers, RSS sampled

Contenders, one after another in this process, on the same images and the same LeNet:
- batched: ParallelInference BATCHED, 2 workers (batch_limit 32, max_wait_ms 2, the defaults);
- sequential: ParallelInference SEQUENTIAL, 2 workers;
- locked: a plain `model(x)` under one lock, in this process, torch.inference_mode;
- offline: the whole set in batches of 256 under torch.inference_mode, one loop (the ceiling:
  no callers, no requests).
Each caller thread sends `--per-caller` requests one after the other (output(x): it waits for
each answer), after `--warmup` of its own, with no barrier between (the callers are running when
the timed calls start). requests/s is all callers' timed requests over the wall time from the
first timed call to the last answer; latency is each request's, from the call to its answer.

The soak runs `--requests` requests through BATCHED from 32 callers and reads the resident size
(VmRSS) of this process and of each worker from /proc every `--sample-every` requests.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DEFAULT_DATA_DIR, lenet, table, write_results
from parallelwrapper import InferenceMode, ParallelInference
from parallelwrapper.app.mnist import load_mnist

CALLERS = (1, 8, 32)
MIB = 2**20


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no VmRSS for process {pid}")


def drive(call: Callable[[torch.Tensor], Any], images: torch.Tensor, callers: int, per_caller: int, warmup: int) -> dict[str, float]:
    """`callers` threads, each `warmup` then `per_caller` timed calls of one image; requests/s and latency percentiles."""
    latencies: list[list[float]] = [[] for _ in range(callers)]
    spans: list[tuple[float, float]] = []  # each caller's first timed call and last answer

    def caller(c: int) -> None:
        # No barrier between the warm-up and the timed calls: released at once, 32 threads queue for
        # the GIL (one switch interval each), and each one's first call would time that queue.
        with torch.inference_mode():  # thread-local: the locked contender needs it in each caller
            for i in range(warmup):
                call(images[(c * 7919 + i) % len(images)])
            mine, first = latencies[c], time.perf_counter()
            for i in range(per_caller):
                x = images[(c * 7919 + warmup + i) % len(images)]
                t = time.perf_counter()
                call(x)
                mine.append(time.perf_counter() - t)
            spans.append((first, time.perf_counter()))

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    every = sorted(x for mine in latencies for x in mine)
    return {
        "requests_per_s": len(every) / wall,
        "p50_ms": 1000 * every[len(every) // 2],
        "p99_ms": 1000 * every[min(len(every) - 1, int(len(every) * 0.99))],
        "mean_ms": 1000 * statistics.fmean(every),
        "requests": len(every),
        "seconds": wall,
    }


def offline(model: torch.nn.Module, images: torch.Tensor, batch: int = 256, repeats: int = 3) -> dict[str, float]:
    """The ceiling: every image in batches of `batch`, one loop, no requests; the best of `repeats`."""
    best = 0.0
    with torch.inference_mode():
        model(images[:batch])
        for _ in range(repeats):
            start = time.perf_counter()
            for x in torch.split(images, batch):
                model(x)
            best = max(best, len(images) / (time.perf_counter() - start))
    return {"requests_per_s": best}


def served(model: torch.nn.Module, mode: InferenceMode) -> ParallelInference:
    return ParallelInference.builder(model).workers(2).devices(["cpu", "cpu"]).inference_mode(mode).input_shape(1, 28, 28).build()


def soak(model: torch.nn.Module, images: torch.Tensor, requests: int, sample_every: int) -> list[dict[str, float]]:
    """BATCHED from 32 callers for `requests` requests; RSS of this process and each worker every `sample_every`."""
    callers, samples = 32, []
    done = 0
    lock = threading.Lock()
    with served(model, InferenceMode.BATCHED) as pi:
        start = time.perf_counter()

        def caller(c: int) -> None:
            nonlocal done
            i = c
            while True:
                with lock:
                    if done >= requests:
                        return
                    done += 1
                    if done % sample_every == 0:
                        pids = [p for p in pi.worker_pids if p is not None]
                        samples.append({
                            "requests": done, "seconds": time.perf_counter() - start, "main_mib": rss_mib(),
                            "workers_mib": sum(rss_mib(p) for p in pids),
                        })  # fmt: skip
                        print(f"  {done:,} requests, {time.perf_counter() - start:.0f} s: main {samples[-1]['main_mib']:.1f} MiB, workers {samples[-1]['workers_mib']:.1f} MiB", flush=True)
                pi.output(images[i % len(images)])
                i += callers

        threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return samples


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--per-caller", type=int, default=0, help="timed requests per caller (default: 3000 / callers, at least 100)")
    parser.add_argument("--callers", default=",".join(map(str, CALLERS)), help="concurrent callers of each run, comma-separated")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests per caller first")
    parser.add_argument("--requests", type=int, default=0, help="also soak BATCHED with this many requests from 32 callers")
    parser.add_argument("--sample-every", type=int, default=50_000, help="soak: read RSS every this many requests")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "inference.json"))
    args = parser.parse_args(argv)
    callers = [int(n) for n in args.callers.split(",")]

    ((images, _),) = load_mnist(args.data_dir, "test", download=False).batches(10_000)
    model = lenet().eval()
    results: dict[str, dict[str, dict[str, float]]] = {}
    lock = threading.Lock()

    def locked(x: torch.Tensor) -> torch.Tensor:
        with lock:
            out: torch.Tensor = model(x[None])
        return out[0]

    for name in ("batched", "sequential", "locked"):
        pi = None if name == "locked" else served(model, InferenceMode(name))
        call = locked if pi is None else pi.output
        try:
            for n in callers:
                per_caller = args.per_caller or max(100, 3000 // n)
                results.setdefault(name, {})[str(n)] = figures = drive(call, images, n, per_caller, args.warmup)
                print(f"{name:>10}, {n:>2} callers: {figures['requests_per_s']:,.0f} requests/s, p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms", flush=True)
        finally:
            if pi is not None:
                pi.close()
    ceiling = offline(model, images)
    print(f"   offline: {ceiling['requests_per_s']:,.0f} images/s (batches of 256)")

    rows = []
    for name, by_callers in results.items():
        for n, f in by_callers.items():
            ratio = f["requests_per_s"] / results["locked"][n]["requests_per_s"]
            rows.append([name, n, f["requests_per_s"], f["p50_ms"], f["p99_ms"], ratio, f["requests_per_s"] / ceiling["requests_per_s"]])
    rows.append(["offline (ceiling)", "-", ceiling["requests_per_s"], "-", "-", "-", 1.0])
    print(table(["contender", "callers", "requests/s", "p50 ms", "p99 ms", "/ locked", "/ ceiling"], rows))

    samples = soak(model, images, args.requests, args.sample_every) if args.requests else []
    if samples:
        first, last = samples[0], samples[-1]
        print(
            f"soak: {last['requests']:,} requests in {last['seconds']:.0f} s; main {first['main_mib']:.1f} -> {last['main_mib']:.1f} MiB, "
            f"workers {first['workers_mib']:.1f} -> {last['workers_mib']:.1f} MiB (from {first['requests']:,} requests on)"
        )
    write_results(args.out, {"callers": callers, "contenders": results, "offline": ceiling, "soak": samples})


if __name__ == "__main__":
    main()
