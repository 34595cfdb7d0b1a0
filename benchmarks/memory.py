"""Peak memory of a fit: the main process and each worker of `ParallelWrapper`, against each rank
of DistributedDataParallel on the same job.

    python -m benchmarks memory                      # the code of this checkout
    python -m benchmarks memory --before /tmp/pw-before   # and another checkout's, side by side

The job: an MLP of about 10M and 50M parameters (float32), SGD with momentum, 2 workers of one
thread, k = 4, `--batches` small batches in all, fit `--fits` times (from the second fit on, the
main process holds the optimizer's state too, and sends it). Each wrapper fit runs in a fresh process (the
"main" process here), with PYTHONPATH set to the checkout measured, so that its peak is this fit's
alone; its baseline is its resident size with torch imported, the data made and an optimizer made on a
throwaway layer (that imports torch._dynamo, as any training script's optimizer does), before the model.
Workers are read from /proc after the fit, before close(): VmHWM, the peak resident size of each
process over its life (shared memory it touched included). DDP's ranks report their own VmHWM.

A second table (`--fleet-rounds`, 0 to leave it out): what a fleet's averager holds to resume a
round (`FlatAverager(intact=True)`, replacement/fleet.py), beside the plain one, in float32 and
int8: two processes (forked from the library's workers' forkserver, a pair for each) average the
model and its momentum a few times, each reporting its peak above its own with the model made and
stepped once.

On CUDA each process also reports `torch.cuda.max_memory_allocated()` on its device: a DDP rank at
the end; a worker at each local step, from `.before_step` (so its figure is the peak up to its
last step: the last averaging, which allocates nothing new on the device, is not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import run_processes, table, vm, worker_pids, write_results

MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]
IN, OUT, BATCH, K, LR, MOMENTUM = 128, 10, 16, 4, 0.01, 0.9


def width(params: int) -> int:
    """The hidden width h of IN → h → h → OUT with about `params` parameters: h² + (IN + OUT + 2)h."""
    b = IN + OUT + 2
    return int((-b + (b * b + 4 * params) ** 0.5) / 2)


def mlp(params: int) -> nn.Module:
    torch.manual_seed(0)
    h = width(params)
    return nn.Sequential(nn.Linear(IN, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, OUT))


def mlp_size(params: int) -> tuple[int, float]:
    """The MLP of about `params` parameters: its parameters, and their MiB."""
    model = mlp(params)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() * p.element_size() for p in model.parameters()) / MIB


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)) for _ in range(n)]


def device_peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None


# -- DDP --------------------------------------------------------------------------------------------


def _ddp_rank(rank: int, world: int, params: int, n: int) -> dict[str, Any]:
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() else torch.device("cpu")
    data = batches(n)[rank::world]
    model = mlp(params).to(device)
    net = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x.to(device)), y.to(device)).backward()
        optimizer.step()
    return {"rss_peak_mib": vm("VmHWM"), "device_peak_mib": device_peak(device)}


# -- the wrapper, in a process of its own -----------------------------------------------------------


class _DevicePeak:
    """`.before_step`: a worker writes its device's peak allocation to `folder`/<pid>.json."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if torch.cuda.is_available():
            peak = device_peak(next(model.parameters()).device)
            Path(self.folder, f"{os.getpid()}.json").write_text(json.dumps(peak))


def _wrapper_main(params: int, n: int, fits: int) -> dict[str, Any]:
    """`fits` fits as a user's script runs them; the figures of this process and of its workers."""
    from parallelwrapper import ParallelWrapper

    data = batches(n)
    # Making any torch optimizer imports torch._dynamo (some 70 MiB here), which a plain training
    # script pays as well: the baseline is taken after one, on a throwaway layer.
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=LR)
    baseline = vm("VmRSS")
    first_round: list[float] = []  # the main process's peak by its first score: the workers' start

    def at_first_score(score: Any) -> None:
        if not first_round:
            first_round.append(vm("VmHWM"))

    with tempfile.TemporaryDirectory() as folder:
        w = (
            ParallelWrapper.builder(mlp(params))
            .optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
            .before_step(_DevicePeak(folder))
            .workers(2)
            .threads_per_worker(1)
            .averaging_frequency(K)
            .listeners(at_first_score)
            .build()
        )
        with w:
            w.fit(data)
            after_first = vm("VmHWM")
            for _ in range(fits - 1):
                w.fit(data)
            workers: list[dict[str, Any]] = [{"pid": pid, "rss_peak_mib": vm("VmHWM", pid)} for pid in worker_pids(os.getpid())[1]]
            for worker in workers:
                peak = Path(folder, f"{worker['pid']}.json")
                worker["device_peak_mib"] = json.loads(peak.read_text()) if peak.exists() else None
        import parallelwrapper

        return {
            "code": str(Path(parallelwrapper.__file__).parents[1]),
            "main_baseline_mib": baseline,
            "main_peak_mib": vm("VmHWM"),
            "main_peak_by_first_round_mib": first_round[0],
            "main_peak_by_first_fit_mib": after_first,
            "workers": workers,
        }


def wrapper(code: Path, params: int, n: int, fits: int) -> dict[str, Any]:
    """`_wrapper_main` in a fresh Python, importing parallelwrapper from `code`."""
    # This checkout's benchmarks (the harness), `code`'s parallelwrapper: `code` first on the path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--one", str(params), "--batches", str(n), "--fits", str(fits)],
        env=env, check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    run: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return run


# -- a fleet's averager: what its survivors keep to resume a round ----------------------------------


def _averager_rank(rank: int, world: int, params: int, payload: str, intact: bool, rounds: int) -> dict[str, Any]:
    """`rounds` averages of the model and its momentum, as a round lands them (the model trained a
    step between two), by a FlatAverager in `payload` (float32, or int8 by its deltas), `intact` as
    a fleet's (each survivor keeps its own state until a round lands); this rank's peak RSS over its
    peak with the model and optimizer made and stepped once."""
    from parallelwrapper.averaging import FlatAverager

    data = batches(world * (rounds + 1))[rank::world]
    model = mlp(params)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step(*data[0])
    baseline = vm("VmHWM")
    state = [*model.parameters(), *(optimizer.state[p]["momentum_buffer"] for p in model.parameters())]
    averager = FlatAverager(state, torch.device("cpu"), trailer=1, wire=None if payload == "float32" else payload, intact=intact)
    averager.average(1.0 / world)  # the start every coded round takes its change from
    for r in range(rounds):
        step(*data[r + 1])
        averager.send(1.0 / world, [1.0])
        averager.wait()
        averager.apply(1.0)
    averager.release()
    return {"baseline_mib": baseline, "peak_mib": vm("VmHWM")}


def fleet_rows(params: int, rounds: int) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """Each payload's averager, plain and intact, in 2 processes of their own apiece: their peaks
    above the stepped model's, in MiB and in models."""
    size = mlp_size(params)[1]
    runs: dict[str, Any] = {"model_mib": size}
    rows = []
    for payload in ("float32", "int8"):
        for intact in (False, True):
            ranks = run_processes(_averager_rank, 2, params, payload, intact, rounds)
            above = max(r["peak_mib"] - r["baseline_mib"] for r in ranks)
            runs[f"{payload}{' intact' if intact else ''}"] = {"ranks": ranks, "above_mib": above, "above_in_models": above / size}
        plain, kept = runs[payload], runs[f"{payload} intact"]
        kept["intact_costs_in_models"] = (kept["above_mib"] - plain["above_mib"]) / size
        rows += [
            (f"{size:.0f}", payload, "", f"{plain['above_mib']:.0f}", f"{plain['above_in_models']:.2f}", ""),
            (f"{size:.0f}", payload, "intact (a fleet's)", f"{kept['above_mib']:.0f}", f"{kept['above_in_models']:.2f}", f"{kept['intact_costs_in_models']:+.2f}"),
        ]  # fmt: skip
    return runs, rows


# -- the report -------------------------------------------------------------------------------------


def ratios(run: dict[str, Any], ddp: list[dict[str, Any]], model_mib: float) -> dict[str, float]:
    worker, rank = max(w["rss_peak_mib"] for w in run["workers"]), max(r["rss_peak_mib"] for r in ddp)
    return {
        "worker_peak_mib": worker,
        "ddp_rank_peak_mib": rank,
        "worker_over_ddp": worker / rank,
        "worker_minus_ddp_in_models": (worker - rank) / model_mib,
        "main_over_model": run["main_peak_mib"] / model_mib,
        "main_above_baseline_in_models": (run["main_peak_mib"] - run["main_baseline_mib"]) / model_mib,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="10000000,50000000", help="MLP sizes, in parameters")
    parser.add_argument("--batches", type=int, default=48, help=f"batches of {BATCH} in all, shared by the 2 workers")
    parser.add_argument("--fits", type=int, default=2, help="fits in a row on one wrapper")
    parser.add_argument("--before", type=Path, default=None, help="another checkout, measured beside this one")
    parser.add_argument("--out", default="benchmarks/results/memory.json")
    parser.add_argument("--fleet-rounds", type=int, default=4, help="rounds of each fleet averager measured (0: none)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a wrapper fit's own process
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(_wrapper_main(args.one, args.batches, args.fits)))
        return
    measured = [int(p) for p in args.params.split(",")]
    fleet: dict[str, Any] = {}
    if args.fleet_rounds:
        fleet_table = []
        for params in measured:
            fleet[f"{mlp_size(params)[0] / 1e6:.1f}M"], rows = fleet_rows(params, args.fleet_rounds)
            fleet_table += rows
        print(f"A fleet's averager (2 processes, the model and its momentum, {args.fleet_rounds} rounds): peak RSS above the stepped model's")
        print(table(["model MiB", "payload", "averager", "above MiB", "above, in models", "intact's cost, in models"], fleet_table))
    codes = {"after": ROOT} if args.before is None else {"before": args.before.resolve(), "after": ROOT}
    runs: dict[str, Any] = {}
    rows = []
    for params in measured:
        count, size = mlp_size(params)
        ddp = run_processes(_ddp_rank, 2, params, args.batches, spawn=True)  # as the results of record were measured: each rank its own interpreter
        entry: dict[str, Any] = {"parameters": count, "model_mib": size, "ddp_ranks": ddp}
        rows.append((f"{count / 1e6:.1f}M", size, "DDP ranks", "", " / ".join(f"{r['rss_peak_mib']:.0f}" for r in ddp), "", "", "", ""))
        for label, code in codes.items():
            run = wrapper(code, params, args.batches, args.fits)
            run.update(ratios(run, ddp, size))
            entry[label] = run
            workers = " / ".join(f"{w['rss_peak_mib']:.0f}" for w in run["workers"])
            main_peaks = f"{run['main_peak_by_first_round_mib']:.0f} / {run['main_peak_by_first_fit_mib']:.0f} / {run['main_peak_mib']:.0f} ({run['main_baseline_mib']:.0f})"
            rows.append(
                (f"{count / 1e6:.1f}M", size, f"wrapper ({label})", main_peaks, workers, run["worker_over_ddp"],
                 run["worker_minus_ddp_in_models"], run["main_over_model"], run["main_above_baseline_in_models"])
            )  # fmt: skip
            print(f"{count / 1e6:.1f}M {label}: done", flush=True)
        runs[f"{count / 1e6:.1f}M"] = entry
    print(f"MLP, SGD momentum, 2 workers of 1 thread, k={K}, {args.batches} batches of {BATCH}, {args.fits} fits; peak RSS (VmHWM) in MiB")
    headers = ["model", "model MiB", "run", "main: peak by round 1 / by fit 1's end / in all (baseline)", "each process", "worker / DDP rank",
               "(worker − DDP) / model", "main / model", "(main − baseline) / model"]  # fmt: skip
    print(table(headers, rows))
    sizes = list(runs.values())
    if len(sizes) > 1:  # what the main process holds per MiB of model, its fixed cost aside: the copies it holds
        for label in codes:
            (a, b) = ((x["model_mib"], x[label]["main_peak_mib"] - x[label]["main_baseline_mib"]) for x in (sizes[0], sizes[-1]))
            copies = (b[1] - a[1]) / (b[0] - a[0])
            fixed = a[1] - copies * a[0]
            print(f"main process ({label}): {copies:.2f} copies of the model at its peak, and {fixed:.1f} MiB that do not grow with it")
            for x in sizes:
                x[label]["main_copies_of_model"], x[label]["main_fixed_mib"] = copies, fixed
    payload = {"job": {"in": IN, "out": OUT, "batch": BATCH, "batches": args.batches, "fits": args.fits, "k": K, "workers": 2, "momentum": MOMENTUM}, "runs": runs, "fleet": fleet}
    write_results(args.out, {**payload, "codes": {k: str(v) for k, v in codes.items()}})


if __name__ == "__main__":
    main()
