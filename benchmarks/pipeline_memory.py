"""A model too large for one worker's memory budget, trained as 2 stages (issue 24): an MLP of 8
equal layers with Adam, as 2 unsplit workers and as 2 workers x 2 stages (`.pipeline(stages=2)`),
each worker process's peak resident size against a stated per-worker budget. (Two workers: one
unsplit CPU worker would train in the caller's own process.)

    python benchmarks/pipeline_memory.py                       # width 4096: 134M parameters, budget 1,536 MiB
    python benchmarks/pipeline_memory.py --width 512 --budget-mib 400 --batches 2   # a smoke run

A worker's peak is its VmHWM, read from /proc after the fit and before close(): the most it held
over its life, the torch it shares with the forkserver it was forked from included (that baseline
is reported: the forkserver's own size). Parameters, gradients and Adam's two moments are 4 model
sizes in float32; a stage holds about half of them. The budget stands for a device's memory: a
worker above it could not train there, and every stage below it can.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from common import table, vm, worker_pids, write_results
from parallelwrapper import ParallelWrapper
from pipeline import mlp  # benchmarks/pipeline.py

MIB = 2**20


def fit(width: int, batches: list[tuple[torch.Tensor, torch.Tensor]], stages: int) -> dict[str, Any]:
    """One fit of 2 workers (of `stages` stages, or unsplit for 1); each worker process's peak in MiB."""
    builder = ParallelWrapper.builder(mlp(width)).optimizer(torch.optim.Adam, lr=1e-4).workers(2).threads_per_worker(1)
    if stages > 1:
        builder = builder.pipeline(stages=stages, microbatches=2)
    with builder.build() as wrapper:
        history = wrapper.fit(batches)
        server, workers = worker_pids(os.getpid())
        peaks = [vm("VmHWM", pid) for pid in workers]
        return {"stages": stages, "processes": len(workers), "peaks_mib": peaks, "forkserver_mib": vm("VmRSS", server), "final_loss": history.scores[-1].score}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096, help="each of the 8 layers is width x width")
    parser.add_argument("--budget-mib", type=float, default=1536.0, help="the per-worker memory budget")
    parser.add_argument("--batches", type=int, default=4, help="batches of 32 in the fit")
    parser.add_argument("--out", default="benchmarks/results/pipeline_memory.json")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, args.width, generator=g), torch.randint(0, args.width, (32,), generator=g)) for _ in range(args.batches)]
    model = mlp(args.width)
    params = sum(p.numel() for p in model.parameters())
    model_mib = params * 4 / MIB
    del model
    runs = [fit(args.width, batches, stages) for stages in (1, 2)]
    rows = []
    for run in runs:
        for stage, peak in enumerate(run["peaks_mib"]):
            name = f"unsplit worker {stage}" if run["stages"] == 1 else f"worker {stage // 2} stage {stage % 2}"
            rows.append([name, peak, peak - run["forkserver_mib"], peak / args.budget_mib, "yes" if peak <= args.budget_mib else "no"])
    print(f"MLP of 8 layers of {args.width}: {params / 1e6:.1f}M parameters ({model_mib:.0f} MiB in float32), Adam, 2 workers, "
          f"{args.batches} batches of 32; budget {args.budget_mib:.0f} MiB a worker process; forkserver {runs[0]['forkserver_mib']:.0f} MiB")  # fmt: skip
    print(table(["process", "peak MiB", "over the forkserver", "/ budget", "fits"], rows))
    write_results(args.out, {"width": args.width, "parameters": params, "model_mib": model_mib, "budget_mib": args.budget_mib, "batches": args.batches, "runs": runs})


if __name__ == "__main__":
    main()
