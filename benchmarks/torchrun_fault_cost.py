"""What losing a rank costs under torchrun: restart-and-resume against survivors going on.

    flock /tmp/pw-heavy.lock python benchmarks/torchrun_fault_cost.py --run lib-free-e2
    flock /tmp/pw-heavy.lock python benchmarks/torchrun_fault_cost.py --run lib-kill-e2
    ...                                                                      (one run a call: --list)
    python benchmarks/torchrun_fault_cost.py --report        # the table, from the JSON

LeNet on MNIST (batch 128, Nesterov SGD, averaging every k = 8 steps, one thread a rank), two
ranks on loopback, gloo, a fixed number of epochs. Each run merges its figures into
results/torchrun_fault_cost.json under its name.

lib-*: the wrapper under `torchrun --nproc-per-node 2 --max-restarts 1` with .checkpoint(dir,
  every=R). "kill": rank 1 SIGKILLs itself once at its FAULT_STEP-th step; torchrun's agent stops
  rank 0 and restarts both, and the group resumes from the last checkpoint. "stop": rank 1
  SIGSTOPs itself there; rank 0 names it after .peer_timeout and exits, and the agent stops
  (SIGTERM, then SIGKILL) and restarts both.
proto-*: a standalone prototype of survivors going on (no library code in its loop: plain local
  SGD with a flat all-reduce every k steps), under two torchrun agents of one rank each
  (`--nnodes 2 --nproc-per-node 1 --max-restarts 0`): one agent per rank is the only layout in
  which torchrun lets a survivor live on, since an agent restarts or stops *all* its local
  workers when one fails. gloo cannot shrink a group in torch 2.13 (`shrink_group` raises
  TypeError: `supports_shrinking` is False for ProcessGroupGloo, true only for NCCL built with
  NCCL_HAS_COMM_SHRINK), so the survivors build a fresh ProcessGroupGloo of the ranks left under
  a new prefix of torchrun's store, redo the lost rank's batches of the round that failed, and
  go on at the smaller world size.

Every step appends its time and batch size to OUT/stamps-<rank>-<pid>.txt (one file an
incarnation), from which the figures come: wall seconds (the command, and first step to last
step), samples trained (in all, and after the fault), the seconds from the fault to the first
step after it, steps redone, and throughput kept = the fault-free run's training seconds / this
run's, for the same samples.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import BATCH, DEFAULT_DATA_DIR, LR, MOMENTUM, lenet, machine, mnist_batches, table

K = 8  # steps between averages
EPOCHS = int(os.environ.get("PW_FAULT_EPOCHS", "4"))  # the environment's values are for a quick check of the script
BATCHES = int(os.environ.get("PW_FAULT_BATCHES", "0"))  # 0: all of MNIST's 469 batches an epoch
FAULT_STEP = int(os.environ.get("PW_FAULT_STEP", "568"))  # rank 1's step of 4 x 235: 60% through; mid-interval for every=2 (568 % 16 = 8) and every=20 (568 % 160 = 88)
RESULTS = Path(__file__).parent / "results" / "torchrun_fault_cost.json"
RUNS: dict[str, dict[str, Any]] = {
    "lib-free-e2": {"kind": "lib", "fault": "none", "every": 2},
    "lib-kill-e2": {"kind": "lib", "fault": "kill", "every": 2},
    "lib-free-e20": {"kind": "lib", "fault": "none", "every": 20},
    "lib-kill-e20": {"kind": "lib", "fault": "kill", "every": 20},
    "lib-stop-e2": {"kind": "lib", "fault": "stop", "every": 2, "peer_timeout": 5.0},
    "proto-free": {"kind": "proto", "fault": "none"},
    "proto-kill": {"kind": "proto", "fault": "kill"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batches_of(data_dir: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = mnist_batches(data_dir)
    return batches[:BATCHES] if BATCHES else batches


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


# ---- in every rank --------------------------------------------------------------------------


class Stamps:
    """This incarnation's stamps, and rank 1's fault at its FAULT_STEP-th step (once a run)."""

    def __init__(self, out: Path, fault: str) -> None:
        self.rank = int(os.environ["RANK"])
        self.out, self.fault, self.steps = out, fault, 0
        self.file = open(out / f"stamps-{self.rank}-{os.getpid()}.txt", "a", buffering=1)

    def step(self, samples: int) -> None:
        self.steps += 1
        self.file.write(f"{time.time():.6f} {samples}\n")
        if self.rank == 1 and self.steps == FAULT_STEP and self.fault != "none" and not (self.out / "fault").exists():
            (self.out / "fault").write_text(f"{os.getpid()} {time.time()!r}")
            os.kill(os.getpid(), signal.SIGKILL if self.fault == "kill" else signal.SIGSTOP)


class Step:
    """The wrapper's training step: LeNet's loss, stamped."""

    def __init__(self, out: Path, fault: str) -> None:
        self.out, self.fault = out, fault
        self.stamps: Stamps | None = None

    def __call__(self, net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.stamps is None:
            self.stamps = Stamps(self.out, self.fault)
        self.stamps.step(int(batch[0].shape[0]))
        return torch.nn.functional.cross_entropy(net(batch[0]), batch[1])


def lib_rank(out: Path, fault: str, every: int, peer_timeout: float, data_dir: str) -> None:
    from parallelwrapper import ParallelWrapper

    torch.set_num_threads(1)
    builder = (
        ParallelWrapper.builder(lenet()).optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM, nesterov=True)
        .averaging_frequency(K).threads_per_worker(1).checkpoint(out / "ckpt", every=every)
        .peer_timeout(peer_timeout).training_step(Step(out, fault))
    )  # fmt: skip
    with builder.build() as wrapper:
        wrapper.fit(batches_of(data_dir), epochs=EPOCHS)
        if int(os.environ["RANK"]) == 0:
            (out / "done.json").write_text(json.dumps({"rounds": wrapper.rounds}))


def proto_rank(out: Path, fault: str, data_dir: str) -> None:
    """Survivors going on: local SGD, a flat all-reduce of the parameters every K steps. When the
    all-reduce fails (gloo: 'Connection closed by peer' as soon as a peer's process is gone), the
    survivors register under the next generation's prefix of torchrun's store, wait for the ranks
    that are left (one loss at a time here: the previous members less one), build a fresh
    ProcessGroupGloo of them, average their models in it, put the lost rank's batches of the
    failed round back at the head of the queue, and go on. Every sample is trained once."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore  # type: ignore[attr-defined]

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60))
    timeout = timedelta(seconds=30)
    generation, members = 0, list(range(world))
    pg = ProcessGroupGloo(PrefixStore(f"proto/{generation}", store), rank, world, timeout)
    net = lenet()
    params = [p for p in net.parameters()]
    flat = torch.nn.utils.parameters_to_vector(params).detach()
    root = dist.BroadcastOptions()
    root.rootRank = 0
    pg.broadcast([flat], root).wait()  # type: ignore[attr-defined]  # every rank from rank 0's model
    torch.nn.utils.vector_to_parameters(flat, params)
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, nesterov=True)
    batches = batches_of(data_dir)
    queue = deque(itertools.product(range(EPOCHS), range(len(batches))))
    stamps = Stamps(out, fault)
    reforms: list[dict[str, Any]] = []

    def average(group: Any, size: int) -> None:
        v = torch.nn.utils.parameters_to_vector(params).detach()
        group.allreduce([v]).wait()
        torch.nn.utils.vector_to_parameters(v / size, params)

    while queue:
        size, me = len(members), members.index(rank)
        take = list(itertools.islice(queue, K * size))
        mine = take[me::size]
        for _, i in mine:
            x, y = batches[i]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            stamps.step(int(x.shape[0]))
        try:
            average(pg, size)
            for _ in take:
                queue.popleft()
        except RuntimeError as e:
            failed = time.time()
            generation += 1
            key = f"proto/{generation}/alive"
            store.set(f"{key}/{rank}", "1")
            expected = size - 1
            deadline = time.monotonic() + 30
            while True:
                alive = [r for r in members if store.check([f"{key}/{r}"])]
                if len(alive) >= expected or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            lost = [r for r in members if r not in alive]
            kept = [item for j, item in enumerate(take) if members[j % size] in alive]
            redo = [item for j, item in enumerate(take) if members[j % size] not in alive]
            for _ in take:
                queue.popleft()
            queue.extendleft(reversed(redo))  # the lost ranks' batches of the failed round, first
            members = alive
            pg = ProcessGroupGloo(PrefixStore(f"proto/{generation}", store), members.index(rank), len(members), timeout)
            average(pg, len(members))
            reforms.append({"error_at": failed, "reformed_at": time.time(), "lost": lost, "redo_steps": len(redo), "kept_steps": len(kept), "error": str(e).splitlines()[0][:160]})
    if rank == min(members):
        (out / "done.json").write_text(json.dumps({"reforms": reforms, "world_at_end": len(members)}))


# ---- the driver -----------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def launch(name: str, spec: dict[str, Any], out: Path, data_dir: str) -> float:
    """Run one configuration; return the command's wall seconds."""
    me = [sys.executable, str(Path(__file__).resolve())]
    tr = [sys.executable, "-m", "torch.distributed.run"]
    port = free_port()
    if spec["kind"] == "lib":
        worker = [*me, "--rank-of", "lib", "--out", str(out), "--fault", spec["fault"], "--every", str(spec["every"]),
                  "--peer-timeout", str(spec.get("peer_timeout", 30.0)), "--data-dir", data_dir]  # fmt: skip
        shutdown = ["--shutdown-timeout", str(spec["shutdown_timeout"])] if "shutdown_timeout" in spec else []
        commands = [[*tr, "--nproc-per-node", "2", "--max-restarts", "1", *shutdown, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *worker[1:]]]
    else:
        worker = [*me, "--rank-of", "proto", "--out", str(out), "--fault", spec["fault"], "--data-dir", data_dir]
        commands = [
            [*tr, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={int(n == 0)}", *worker[1:]]
            for n in (0, 1)
        ]  # fmt: skip
    print(f"{name}: " + " | ".join(" ".join(c) for c in commands), flush=True)
    start = time.time()
    logs = [open(out / f"agent{n}.log", "wb") for n in range(len(commands))]
    agents = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT, env=clean_env()) for c, log in zip(commands, logs)]
    try:
        if spec["fault"] == "stop":  # let the stopped rank go once torchrun has stopped the group around it
            while not (out / "fault").exists() and agents[0].poll() is None:
                time.sleep(0.05)
        if spec["kind"] == "proto" and spec["fault"] != "none":
            # The survivor's agent waits in torchelastic's exit barrier for the lost rank's agent,
            # which left: 300 s (LocalElasticAgent's exit_barrier_timeout, which torchrun does
            # not expose). Once the survivor's process is gone, give its agent 5 s, then SIGTERM.
            deadline = time.time() + 240
            while not (out / "done.json").exists() and time.time() < deadline and agents[0].poll() is None:
                time.sleep(0.05)
            for f in out.glob("stamps-0-*.txt"):
                while time.time() < deadline and _alive(int(f.name.split("-")[2].split(".")[0])):
                    time.sleep(0.05)
            worker_gone = time.time()
            try:
                agents[0].wait(timeout=5)
            except subprocess.TimeoutExpired:
                agents[0].terminate()  # in the barrier's store wait it may not heed SIGTERM
                try:
                    agents[0].wait(timeout=3)
                except subprocess.TimeoutExpired:
                    agents[0].kill()
                (out / "exit_barrier").write_text(repr(worker_gone))
        codes = [a.wait(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
        if (out / "fault").exists() and spec["fault"] == "stop":
            try:
                os.kill(int((out / "fault").read_text().split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall = time.time() - start
    if (out / "exit_barrier").exists():
        wall = float((out / "exit_barrier").read_text()) - start  # up to the survivor's exit, not its agent's 300 s wait
    print(f"{name}: exit codes {codes}, {wall:.1f} s", flush=True)
    if codes[0] != 0 and not (out / "exit_barrier").exists():
        print((out / "agent0.log").read_text()[-4000:])
        raise SystemExit(f"{name}: rank 0's agent failed")
    return wall


def figures(name: str, spec: dict[str, Any], out: Path, wall: float, data_dir: str) -> dict[str, Any]:
    per_epoch = len(batches_of(data_dir))
    incarnations = []
    for f in sorted(out.glob("stamps-*.txt")):
        rows = [line.split() for line in f.read_text().splitlines() if line.strip()]
        times = [float(t) for t, _ in rows]
        incarnations.append({"rank": int(f.name.split("-")[1]), "first": times[0], "last": times[-1], "steps": len(rows), "samples": sum(int(s) for _, s in rows)})
    first = min(i["first"] for i in incarnations)
    last = max(i["last"] for i in incarnations)
    steps = sum(i["steps"] for i in incarnations)
    result: dict[str, Any] = {
        **spec,
        "command_wall_s": round(wall, 2),
        "train_wall_s": round(last - first, 2),
        "samples": sum(i["samples"] for i in incarnations),
        "samples_expected": EPOCHS * sum(int(x.shape[0]) for x, _ in batches_of(data_dir)),
        "steps": steps,
        "steps_expected": EPOCHS * per_epoch,
        "steps_redone": steps - EPOCHS * per_epoch,
        "incarnations": [{**i, "first": round(i["first"] - first, 2), "last": round(i["last"] - first, 2)} for i in incarnations],
    }
    if (out / "fault").exists():
        fault = float((out / "fault").read_text().split()[1])
        after = [i for i in incarnations if i["first"] > fault]
        result["fault_at_s"] = round(fault - first, 2)
        result["fault_share_of_steps"] = round(FAULT_STEP * 2 / (EPOCHS * per_epoch), 3)
        if after:  # restarted processes: their first steps
            result["fault_to_resume_s"] = round(max(i["first"] for i in after) - fault, 2)
            result["samples_after_fault"] = sum(i["samples"] for i in after)
        result["rounds_redone"] = round(result["steps_redone"] / (2 * K), 2)  # a round is K steps on each of 2 ranks
    if (out / "exit_barrier").exists():
        result["survivor_agent"] = "waited in torchelastic's exit barrier for the lost rank's agent (300 s default); ended by this script (SIGTERM, then SIGKILL) 5 s after the survivor exited"
    done = out / "done.json"
    if done.exists():
        result["done"] = json.loads(done.read_text())
        for r in result["done"].get("reforms", []):
            result["fault_to_reformed_s"] = round(r["reformed_at"] - float((out / "fault").read_text().split()[1]), 2)
            result["error_after_fault_s"] = round(r["error_at"] - float((out / "fault").read_text().split()[1]), 2)
            result["lost_rank_steps_given_back"] = r["redo_steps"]  # the lost rank's share of the failed round, trained by the survivor
            result["samples_after_fault"] = sum(int(s) for f in out.glob("stamps-0-*.txt") for t, s in (line.split() for line in f.read_text().splitlines()) if float(t) > r["error_at"])
    for n in range(2):
        log = out / f"agent{n}.log"
        if log.exists():
            text = log.read_text(errors="replace")
            result.setdefault("agent_lines", {})[str(n)] = [line[-220:] for line in text.splitlines() if "parallelwrapper: rank" in line or "restart" in line.lower() or "Traceback" in line][:6]
    return result


def report(results: dict[str, Any]) -> str:
    runs = results.get("runs", {})
    rows = []
    for name, r in runs.items():
        base = runs.get("lib-free-e2" if r["kind"] == "lib" else "proto-free")
        kept = base["train_wall_s"] / r["train_wall_s"] if base else float("nan")
        rows.append([
            name, r["fault"], r.get("every", "-"), r["command_wall_s"], r["train_wall_s"], r["samples"], r.get("samples_after_fault", "-"),
            r.get("fault_to_resume_s", r.get("fault_to_reformed_s", "-")), r.get("rounds_redone", "-"), round(r["samples"] / r["train_wall_s"]), round(kept, 3),
        ])  # fmt: skip
    return table(["run", "fault", "ckpt every", "command s", "training s", "samples", "after the fault", "fault to training s", "rounds redone", "samples/s", "kept"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", choices=sorted(RUNS))
    p.add_argument("--list", action="store_true")
    p.add_argument("--report", action="store_true")
    p.add_argument("--out-json", default=str(RESULTS))
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--keep", help="copy the run's folder (agents' logs, stamps) here")
    p.add_argument("--rank-of", choices=["lib", "proto"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--fault", default="none", help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--peer-timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_of == "lib":
        return lib_rank(Path(args.out), args.fault, args.every, args.peer_timeout, args.data_dir)
    if args.rank_of == "proto":
        return proto_rank(Path(args.out), args.fault, args.data_dir)
    path = Path(args.out_json)
    results = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    if args.list:
        print("\n".join(RUNS))
        return
    if args.run:
        spec = RUNS[args.run]
        with tempfile.TemporaryDirectory(prefix="pw_fault_") as folder:
            out = Path(folder)
            wall = launch(args.run, spec, out, args.data_dir)
            results["runs"][args.run] = {"machine": machine(), **figures(args.run, spec, out, wall, args.data_dir)}
            if args.keep:
                shutil.copytree(out, Path(args.keep) / args.run, dirs_exist_ok=True, ignore=shutil.ignore_patterns("ckpt"))
        results["setup"] = {"model": "LeNet", "batch": BATCH, "k": K, "epochs": EPOCHS, "fault_step_of_rank_1": FAULT_STEP, "ranks": 2, "backend": "gloo", "threads_per_rank": 1}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results["runs"][args.run], indent=1))
    print(report(results))


if __name__ == "__main__":
    main()
