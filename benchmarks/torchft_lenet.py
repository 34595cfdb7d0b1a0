"""LeNet on MNIST against torchft's DiLoCo and LocalSGD (issue 21, item 5): ms per step.

    pip install --no-deps torchft==0.2.0   # then its pure-python needs: opentelemetry-api,
                                           # opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http
    python -m benchmarks torchft_lenet --workers 2 --k 16 --steps 208 --warmup 32 --repeats 5

Contenders, each worker (torchft: each replica group of one process) training `steps` batches of
its own (batch i to worker i mod N, the wrapper's deal), batch 128, Nesterov SGD (momentum 0.9,
lr --lr, default common.py's 0.02), one thread per process, gloo on loopback:
  none              N independent processes, no communication at all: the ceiling
  torchft-diloco    torchft's DiLoCo, outer SGD (lr 0.7, momentum 0.9, Nesterov), sync_every=k
  torchft-localsgd  torchft's LocalSGD (parameters averaged), sync_every=k
  wrapper           ParallelWrapper, .averaging_frequency(k), averaging in step (overlap off)
  wrapper-overlap   the same with .overlap_averaging(True)
  wrapper-outer     overlap and .outer_optimizer(SGD, lr 0.7, momentum 0.9, Nesterov): Streaming DiLoCo
  wrapper-params    wrapper with .average_updaters(False): the parameters only, LocalSGD's bytes
  wrapper-diloco    wrapper-params with the outer optimizer, in step: DiLoCo's algorithm and bytes
torchft runs as `torchft_sync` below sets it up, with a LighthouseServer in this process
(min_replicas=N, a fresh one per run).

Steady state, timed alike for all: every process stamps the clock after each step's backward,
before the optimizer's step (the wrapper's workers through `.before_step`, writing to a file per
process); the window runs from the stamp of step `warmup` to the stamp whole rounds of k steps
later (as many as `steps` allows), so it holds the same number of syncs for everyone and leaves
out start-up and the closing sync. ms/step is per worker: independent processes (`none`) add
their own step rates; the others take the span from the first process's start stamp to the last
one's end stamp. (The wrapper's Score listener is not used: with overlap a round's Score arrives
when the round lands, a round late, which would count one round too many in the window.) Each
round of the benchmark runs the contenders in turn, starting one further along each time; the
median over rounds is reported.

torchft is a benchmark-only peer, not a dependency of this project (see MISSING). Each replica
group has its own TCPStore and a Manager (use_async_quorum=False, which DiLoCo requires;
init_sync=False, every replica starting from the same seeded model, as Manager's docs advise
then) on a torchft ProcessGroupGloo, and asks a LighthouseServer for its quorum, as torchft's
examples and integration tests set it up; slow_link_worker.py uses the same `torchft_sync`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import BATCH, DEFAULT_DATA_DIR, LR, MOMENTUM, lenet, mnist_batches, ms_per_step, rotated, run_processes, table, timed_fit, window, write_results

KINDS = ("torchft-diloco", "torchft-localsgd")
MISSING = (
    "torchft is not importable ({error}). It is a benchmark-only peer, not a dependency: "
    "pip install --no-deps torchft==0.2.0 (--no-deps keeps this torch), then its pure-python needs "
    "opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http; "
    "or leave the torchft contenders out with --contenders"
)


def version() -> str:
    """torchft's installed version; SystemExit with MISSING's advice where it does not import."""
    try:
        import torchft  # noqa: F401  (its import needs opentelemetry too)
    except ImportError as error:
        raise SystemExit(MISSING.format(error=error)) from None
    return importlib.metadata.version("torchft")


@contextmanager
def torchft_sync(
    kind: str,
    model: nn.Module,
    inner: torch.optim.Optimizer,
    k: int,
    *,
    lighthouse: str,
    replica_id: str,
    replicas: int,
    outer: dict[str, Any],
    host: str = "localhost",
    timeout: float = 60.0,
    pg_timeout: float | None = None,
    min_replicas: int | None = None,
) -> Iterator[Any]:
    """Within the block, `inner.step()` runs torchft's `kind` ("torchft-diloco": DiLoCo with an
    outer SGD of `outer`'s arguments; "torchft-localsgd": LocalSGD, parameters averaged) every `k`
    steps, among `replicas` replica groups that meet at `lighthouse`. `host` is the address the
    other groups reach this one at (its store and manager); `pg_timeout`, the seconds a collective
    waits for a peer (default `timeout`); `min_replicas`, the fewest groups a quorum goes on with
    (default all `replicas`). Yields the Manager."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo, LocalSGD

    if kind not in KINDS:
        raise ValueError(f"unknown torchft contender {kind!r}: use one of {', '.join(KINDS)}")

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait if pg_timeout is None else datetime.timedelta(seconds=pg_timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=replicas if min_replicas is None else min_replicas,
        use_async_quorum=False,
        replica_id=replica_id,
        store_addr=host,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname=host,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
        init_sync=False,
    )
    try:
        if kind == "torchft-diloco":
            algo: Any = DiLoCo(manager, [model], inner, torch.optim.SGD(model.parameters(), **outer), sync_every=k)
        else:
            algo = LocalSGD(manager, model, inner, sync_every=k)
        with algo:
            yield manager
    finally:
        manager.shutdown(wait=False)


OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}  # DiLoCo's outer SGD (torchft's train_diloco.py)
CONTENDERS = ("none", "torchft-diloco", "torchft-localsgd", "wrapper", "wrapper-overlap", "wrapper-outer", "wrapper-params", "wrapper-diloco")


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], k: int) -> dict[str, Any]:
    """Train on `batches`; the clock after each backward, as `_stamp` reads it for the wrapper,
    and the mean loss of the last k steps (a diverged run's timing would mean nothing)."""
    stamps, losses = [], []
    for x, y in batches:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        stamps.append(time.monotonic())
        optimizer.step()  # torchft's LocalSGD and DiLoCo sync in this step's post-hook
        losses.append(loss.item())
    return {"stamps": stamps, "last_loss": statistics.fmean(losses[-k:])}


def _peer(rank: int, world: int, kind: str, lighthouse: str | None, k: int, steps: int, lr: float, data_dir: str) -> dict[str, Any]:
    batches = mnist_batches(data_dir)[rank::world][:steps]
    model = lenet()
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM, nesterov=True)
    if kind == "none":
        return _steps(model, inner, batches, k)

    with torchft_sync(kind, model, inner, k, lighthouse=lighthouse, replica_id=f"lenet_{rank}", replicas=world, outer=OUTER) as manager:
        out = _steps(model, inner, batches, k)
        out["syncs_committed"] = manager.current_step()  # the manager's step counts committed syncs
        out["participants"] = manager.num_participants()
    return out


def peers(kind: str, world: int, k: int, steps: int, warmup: int, lr: float, data_dir: str) -> dict[str, Any]:
    server = None
    if kind != "none":
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=world)  # fresh: no quorum left from the last run
    wall = time.monotonic()
    try:
        parts = run_processes(_peer, world, kind, server.address() if server else None, k, steps, lr, data_dir, group=False)
    finally:
        if server is not None:
            server.shutdown()
    wall = time.monotonic() - wall
    out: dict[str, Any] = {
        "ms_per_step": ms_per_step(kind, [p["stamps"] for p in parts], *window(warmup, steps, k)),
        "wall_s": wall,
        "last_loss": statistics.fmean(p["last_loss"] for p in parts),
    }
    if kind != "none":
        out["syncs_committed"] = [p["syncs_committed"] for p in parts]
        out["participants"] = [p["participants"] for p in parts]
    return out


def wrapper(world: int, k: int, steps: int, warmup: int, lr: float, data_dir: str, overlap: bool, outer: bool, updaters: bool = True) -> dict[str, Any]:
    def configure(b: Any) -> Any:
        b = b.overlap_averaging(overlap).average_updaters(updaters)  # set either way: the builder's defaults are not pinned here
        return b.outer_optimizer(torch.optim.SGD, **OUTER) if outer else b

    return timed_fit(world, k, steps, warmup, data_dir, configure, lr)


def _commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "parallelwrapper"], cwd=here.parent, capture_output=True, text=True).stdout
        return head + (" (parallelwrapper/ modified)" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers, or torchft replica groups of one process")
    parser.add_argument("--k", type=int, default=16, help="local steps between two syncs")
    parser.add_argument("--steps", type=int, default=208, help="batches per worker (13 rounds of 16)")
    parser.add_argument("--warmup", type=int, default=32, help="batches per worker not timed (2 rounds of 16)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds over all contenders; the median is reported")
    parser.add_argument("--lr", type=float, default=LR, help="inner Nesterov SGD's learning rate (momentum 0.9)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default="benchmarks/results/torchft_lenet.json")
    args = parser.parse_args(argv)
    n, k, steps, warmup = args.workers, args.k, args.steps, args.warmup
    names = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {','.join(CONTENDERS)}")
    timed = window(warmup, steps, k)
    torchft_version = None
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at info
    if any(c.startswith("torchft") for c in names):
        torchft_version = version()

    make: dict[str, Callable[[], dict[str, Any]]] = {
        "none": functools.partial(peers, "none", n, k, steps, warmup, args.lr, args.data_dir),
        "torchft-diloco": functools.partial(peers, "torchft-diloco", n, k, steps, warmup, args.lr, args.data_dir),
        "torchft-localsgd": functools.partial(peers, "torchft-localsgd", n, k, steps, warmup, args.lr, args.data_dir),
        "wrapper": functools.partial(wrapper, n, k, steps, warmup, args.lr, args.data_dir, False, False),
        "wrapper-overlap": functools.partial(wrapper, n, k, steps, warmup, args.lr, args.data_dir, True, False),
        "wrapper-outer": functools.partial(wrapper, n, k, steps, warmup, args.lr, args.data_dir, True, True),
        "wrapper-params": functools.partial(wrapper, n, k, steps, warmup, args.lr, args.data_dir, False, False, False),
        "wrapper-diloco": functools.partial(wrapper, n, k, steps, warmup, args.lr, args.data_dir, False, True, False),
    }
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    began = time.monotonic()
    for r in range(args.repeats):
        for name in rotated(names, r):
            try:
                samples[name].append(make[name]())
            except Exception as error:  # noqa: BLE001 - e.g. a wrapper whose loss went NaN: recorded, the others go on
                first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
                print(f"{name} failed: {first}", flush=True)
                samples[name].append({"failed": first})
        print(f"round {r + 1}/{args.repeats} done ({time.monotonic() - began:.0f} s)", flush=True)

    runs: dict[str, dict[str, Any]] = {}
    for name, xs in samples.items():
        ok = [x for x in xs if "failed" not in x]
        runs[name] = {
            "ms_per_step": statistics.median(x["ms_per_step"] for x in ok) if ok else None,
            "all_ms_per_step": [x.get("ms_per_step") for x in xs],
            "wall_s": statistics.median(x["wall_s"] for x in ok) if ok else None,
            "last_loss": statistics.median(x["last_loss"] for x in ok) if ok else None,
            "failed": len(xs) - len(ok),
            "repeats": xs,
        }
    ceiling = runs["none"]["ms_per_step"] if "none" in runs else None
    for r in runs.values():
        r["vs_ceiling"] = ceiling / r["ms_per_step"] if ceiling and r["ms_per_step"] else None
    rows = [
        (
            name,
            r["ms_per_step"] if r["ms_per_step"] is not None else "failed",
            r["vs_ceiling"] if r["vs_ceiling"] is not None else "-",
            " / ".join("failed" if v is None else f"{v:.1f}" for v in r["all_ms_per_step"]),
            r["last_loss"] if r["last_loss"] is not None else "-",
        )
        for name, r in runs.items()
    ]
    print(
        f"LeNet, MNIST, batch {BATCH}, {n} workers, k={k}, {steps} batches each, timed from step {timed[0]} "
        f"to {timed[1]}, median of {args.repeats}; torchft {torchft_version}"
    )
    print(table(["run", "ms/step (median)", "ceiling / this", "each repeat, ms/step", "last round's loss"], rows))
    verdict = None
    d = runs.get("torchft-diloco", {}).get("ms_per_step")
    if d:
        verdict = {name: r["ms_per_step"] / d for name, r in runs.items() if name.startswith("wrapper") and r["ms_per_step"]}
        print("ms/step over torchft-diloco's: " + ", ".join(f"{name} {v:.3f}" for name, v in verdict.items()))
    write_results(
        args.out,
        {
            "torchft": torchft_version,
            "parallelwrapper_commit": _commit(),
            "workers": n,
            "k": k,
            "batch": BATCH,
            "lr": args.lr,
            "momentum": MOMENTUM,
            "steps": steps,
            "warmup": warmup,
            "timed_steps": list(timed),
            "repeats": args.repeats,
            "outer": OUTER,
            "seconds": time.monotonic() - began,
            "runs": runs,
            "vs_torchft_diloco": verdict,
        },
    )


if __name__ == "__main__":
    main()
