"""torchft on fault_soak.py's schedule (issue 38): replica groups of one process each train
fault_soak.py's MLP (784-128-10, SGD lr 0.05, momentum 0.9, batches of 128 from the same shuffled
MNIST) with torchft's LocalSGD at sync_every=k (fault_soak's .averaging_frequency(8)), on a
torchft ProcessGroupGloo on the CPU, one thread each. A LighthouseServer runs in this process,
which also supervises the replicas as torchelastic would: a replica process that ends is started
again at once (same replica id, a new process; torchft heals it from a peer). Every `--every`
seconds a thread strikes a random live replica, the kinds in turn as fault_soak.py's Injector
does: SIGKILL, SIGSTOP for 5 s (then SIGCONT), and an error raised in its training step (a flag
file it checks each step; the replica exits 1). Victims are drawn with torch.randint from a
generator seeded 0.

    pip install --no-deps torchft==0.2.0   # then opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
    python benchmarks/torchft_soak.py [--replicas 8] [--every 10] [--seconds 180] [--k 8] [--out benchmarks/results/torchft_soak.json]

torchft's settings are those of its LocalSGD example (examples/localsgd/train_localsgd.py):
Manager(min_replica_size=1, timeout=30 s), ProcessGroupGloo(timeout=5 s), use_async_quorum=False
(which LocalSGD and DiLoCo need), init_sync=False (every replica starts from the same seeded
model); the lighthouse at min_replicas=1 with the Python LighthouseServer's defaults
(join_timeout_ms=100, heartbeat_timeout_ms=5000) unless --join-timeout-ms says otherwise.

Measured as fault_soak.py measures the wrapper: a fault-free run first, then the faulted one,
each over the same `--seconds`, counted from the moment the whole fleet first committed a sync
together (start-up left out; the faults start then). Samples are those of committed syncs: a
replica adds the samples of its k steps when its sync commits (a sync that does not commit, or
steps a killed replica took since its last commit, count nothing); samples/s are the fleet's,
over the window. Each run is also given against its own pace (fault_soak.pace: the median of
its seconds' samples), and each fault's cost in seconds of it. Every process this script starts
is killed at the end; the processes left (checked with ps) must be none.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torch import nn

FAULTS = ("SIGKILL", "SIGSTOP 5 s", "raise")
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# A replica group of one process (run as `torchft_soak.py --replica R ...` by the supervisor).


def mlp() -> nn.Module:
    """fault_soak.py's model, from the same seed (not imported from it: a replica needs torch
    and torchft only, so that its start-up is torchft's and not parallelwrapper's)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def replica(args: argparse.Namespace) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import LocalSGD

    torch.set_num_threads(1)
    folder, r, k, n = Path(args.dir), args.replica, args.k, args.replicas
    data = torch.load(folder / "batches.pt", mmap=True)
    xs, ys, sizes = data["x"], data["y"], data["sizes"]  # batches padded to 128; sizes say how many are real
    flag = folder / f"raise-{os.getpid()}"
    events = open(folder / f"events-{r}-{os.getpid()}.txt", "a", buffering=1)
    events.write(f"start {time.monotonic():.6f}\n")

    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=args.pg_timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replica_size,
        use_async_quorum=False,
        replica_id=f"soak_{r}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="localhost",
        timeout=datetime.timedelta(seconds=args.timeout),
        quorum_timeout=datetime.timedelta(seconds=args.timeout),
        connect_timeout=datetime.timedelta(seconds=args.timeout),
        init_sync=False,
    )
    local, pending, losses = 0, 0, []
    with LocalSGD(manager, model, inner, sync_every=k):
        while True:
            if flag.exists():
                flag.unlink()
                raise RuntimeError("injected fault")
            i = ((manager.current_step() * k + local) * n + r) % len(sizes)  # batch i to replica i mod n
            m = int(sizes[i])
            x, y = xs[i, :m], ys[i, :m]
            inner.zero_grad()
            loss = nn.functional.cross_entropy(model(x.flatten(1)), y)
            loss.backward()
            before = manager.current_step()
            inner.step()  # LocalSGD's post-hook: every k-th step a quorum, the parameters' allreduce, should_commit
            local, pending = local + 1, pending + m
            losses.append(loss.item())
            if local == k:
                committed = manager.current_step() > before
                events.write(f"sync {time.monotonic():.6f} {pending} {int(committed)} {manager.num_participants()} {statistics.fmean(losses):.4f} {manager.current_step()}\n")
                local, pending, losses = 0, 0, []


def replica_main(args: argparse.Namespace) -> None:
    try:
        replica(args)
    except BaseException:  # noqa: BLE001 - the raise fault and anything else: exit non-zero, as a crashed trainer does
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # torchft's threads must not keep a failed replica alive


# ----------------------------------------------------------------------------------------------
# The supervisor, the injector and the measure.


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan if this script dies


class Fleet:
    """The replica processes, started again when they end (as torchelastic would)."""

    def __init__(self, args: argparse.Namespace, folder: Path, lighthouse: str) -> None:
        self.args, self.folder, self.lighthouse = args, folder, lighthouse
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()
        self.exits: list[dict[str, Any]] = []  # each ended process: replica, pid, status, when
        self.started: list[tuple[float, int, int]] = []  # (monotonic, replica, pid)
        self.stopping = False

    def start(self, r: int) -> None:
        a = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), "--replica", str(r), "--replicas", str(a.replicas), "--k", str(a.k),
               "--dir", str(self.folder), "--lighthouse", self.lighthouse, "--pg-timeout", str(a.pg_timeout),
               "--timeout", str(a.timeout), "--min-replica-size", str(a.min_replica_size)]  # fmt: skip
        log = open(self.folder / f"log-{r}-{len(self.started)}.txt", "wb")
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn"), "OMP_NUM_THREADS": "1"}
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        log.close()
        self.procs[r] = p
        self.started.append((time.monotonic(), r, p.pid))

    def supervise(self) -> int:
        """Start again every replica whose process ended; how many were."""
        n = 0
        with self.lock:
            for r, p in list(self.procs.items()):
                status = p.poll()
                if status is not None and not self.stopping:
                    self.exits.append({"replica": r, "pid": p.pid, "status": status, "at": time.monotonic()})
                    self.start(r)
                    n += 1
        return n

    def live(self) -> list[tuple[int, int]]:
        with self.lock:
            return [(r, p.pid) for r, p in sorted(self.procs.items()) if p.poll() is None]

    def close(self) -> None:
        with self.lock:
            self.stopping = True
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()  # SIGKILL ends a stopped process too
            for p in self.procs.values():
                p.wait()


class Injector(threading.Thread):
    """fault_soak.py's Injector over the replicas: every `every` s one fault on a random live
    replica, the kinds in turn."""

    def __init__(self, fleet: Fleet, every: float, kinds: tuple[str, ...], until: float) -> None:
        super().__init__(daemon=True)
        self.fleet, self.every, self.kinds, self.until, self.done = fleet, every, kinds, until, threading.Event()
        self.struck: list[tuple[float, str, int, int]] = []  # (seconds since the window opened, fault, replica, pid)
        self.timers: list[threading.Timer] = []
        self.generator = torch.Generator().manual_seed(0)

    def run(self) -> None:
        start, n = time.monotonic(), 0
        while not self.done.wait(max(0.0, start + self.every * (n + 1) - time.monotonic())):
            if time.monotonic() >= self.until:
                return
            live = self.fleet.live()
            r, pid = live[int(torch.randint(len(live), (), generator=self.generator))]
            fault = self.kinds[n % len(self.kinds)]
            n += 1
            try:
                if fault == "SIGKILL":
                    os.kill(pid, signal.SIGKILL)
                elif fault == "raise":
                    (self.fleet.folder / f"raise-{pid}").touch()
                else:
                    os.kill(pid, signal.SIGSTOP)
                    timer = threading.Timer(5.0, _continue, (pid,))
                    timer.start()
                    self.timers.append(timer)
            except ProcessLookupError:
                continue
            self.struck.append((time.monotonic() - start, fault, r, pid))


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def read_events(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob("events-*.txt")):
        _, r, pid = path.stem.split("-")
        for line in path.read_text().splitlines():
            f = line.split()
            if f and f[0] == "sync" and len(f) == 7:
                out.append({"replica": int(r), "pid": int(pid), "t": float(f[1]), "samples": int(f[2]), "committed": f[3] == "1",
                            "participants": int(f[4]), "loss": float(f[5]), "step": int(f[6])})  # fmt: skip
            elif f and f[0] == "start" and len(f) == 2:
                out.append({"replica": int(r), "pid": int(pid), "t": float(f[1]), "start": True})
    return sorted(out, key=lambda e: e["t"])


def full_fleet_at(folder: Path, n: int) -> float | None:
    """When every replica had committed a sync of all n together: the window opens there."""
    seen: dict[int, float] = {}
    for e in read_events(folder):
        if e.get("committed") and e["participants"] == n:
            seen.setdefault(e["replica"], e["t"])
    return max(seen.values()) if len(seen) == n else None


def leftovers(token: str) -> list[str]:
    """Processes whose command line holds `token` (this run's folder), this one aside."""
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    return [line.strip() for line in out if token in line and int(line.split()[0]) != os.getpid()]


def soak(args: argparse.Namespace, batches_file: Path, faults: bool) -> dict[str, Any]:
    from torchft.coordination import LighthouseServer

    from fault_soak import pace

    kinds = tuple(args.faults.split(","))
    folder = Path(tempfile.mkdtemp(prefix="torchft-soak-"))
    os.link(batches_file, folder / "batches.pt")
    server = LighthouseServer(bind="[::]:0", min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms)
    fleet = Fleet(args, folder, server.address())
    launched = time.monotonic()
    injector = None
    try:
        for r in range(args.replicas):
            fleet.start(r)
        t0 = None
        while t0 is None:  # start-up: restart what dies, wait for the whole fleet's first common commit
            fleet.supervise()
            time.sleep(0.2)
            t0 = full_fleet_at(folder, args.replicas)
            if time.monotonic() - launched > args.startup_timeout:
                raise SystemExit(f"{args.replicas} replicas did not all commit a sync together within {args.startup_timeout} s (logs in {folder})")
        startup = t0 - launched
        end = t0 + args.seconds
        print(f"{'faulted' if faults else 'fault-free'}: fleet of {args.replicas} up after {startup:.1f} s", flush=True)
        restarts_before = len(fleet.exits)
        if faults:
            injector = Injector(fleet, args.every, kinds, end)
            injector.start()
        while time.monotonic() < end:
            fleet.supervise()
            time.sleep(0.02)
        if injector is not None:
            injector.done.set()
            injector.join()
            for timer in injector.timers:
                timer.cancel()
    finally:
        fleet.close()
        server.shutdown()
    time.sleep(0.5)
    left = leftovers(str(folder))
    events = read_events(folder)
    syncs = [e for e in events if "start" not in e and t0 <= e["t"] <= end]
    committed = [e for e in syncs if e["committed"]]
    points, total = [(0.0, 0)], 0
    for e in committed:
        total += e["samples"]
        points.append((e["t"] - t0, total))
    points.append((float(args.seconds), total))
    sps = total / args.seconds
    own = pace(points)
    # each restart: how long until that replica's new process committed a sync
    back = []
    for ex in fleet.exits[restarts_before:]:
        later = [s for s in fleet.started if s[1] == ex["replica"] and s[0] >= ex["at"]]
        if later:
            pid = later[0][2]
            first = next((e["t"] for e in events if e["pid"] == pid and e.get("committed")), None)
            back.append(None if first is None else first - ex["at"])
    stopped, stalls = [], []
    if injector is not None:
        fleet_commits = [e["t"] for e in committed]
        for at, fault, r, pid in injector.struck:
            struck = t0 + at
            # the fleet's longest wait between two commits (of any replica) in the 8 s after the fault
            ts = [struck] + [t for t in fleet_commits if struck < t <= struck + 8] + [min(struck + 8, end)]
            stalls.append({"at": at, "fault": fault, "replica": r, "stall_s": max(b - a for a, b in zip(ts, ts[1:]))})
            if fault.startswith("SIGSTOP"):
                resumed = struck + 5.0
                mine = [e for e in events if e["pid"] == pid and "start" not in e and e["t"] > resumed]
                others = [e for e in syncs if e["pid"] != pid and e["committed"] and e["t"] > struck]
                stopped.append({
                    "at": at, "replica": r, "pid": pid,
                    "others_first_commit_after_s": others[0]["t"] - struck if others else None,
                    "others_first_commit_participants": others[0]["participants"] if others else None,
                    "resumed_first_sync_after_resume_s": mine[0]["t"] - resumed if mine else None,
                    "resumed_first_sync_committed": mine[0]["committed"] if mine else None,
                    "resumed_first_commit_after_resume_s": next((e["t"] - resumed for e in mine if e["committed"]), None),
                    "exited": any(x["pid"] == pid for x in fleet.exits),
                })  # fmt: skip
    result = {
        "seconds": args.seconds,
        "startup_s": startup,
        "samples": total,
        "samples_per_s": sps,
        "pace": own,
        "syncs": len(syncs),
        "syncs_committed": len(committed),
        "samples_all_steps": sum(e["samples"] for e in syncs),
        "participants_mean": statistics.fmean(e["participants"] for e in committed) if committed else None,
        "last_loss": statistics.fmean(e["loss"] for e in syncs[-args.replicas :]) if syncs else None,
        "faults": [] if injector is None else injector.struck,
        "restarts": len(fleet.exits) - restarts_before,
        "restarts_at_startup": restarts_before,
        "exits": [{**x, "at": x["at"] - t0} for x in fleet.exits],
        "restart_to_first_commit_s": back,
        "sigstops": stopped,
        "stalls": stalls,
        "left_processes": left,
    }
    if args.keep:
        result["folder"] = str(folder)
    else:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8, help="replica groups of one process")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between faults")
    parser.add_argument("--seconds", type=float, default=180.0, help="the window each run is measured over")
    parser.add_argument("--k", type=int, default=8, help="LocalSGD's sync_every (fault_soak's averaging_frequency)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"the kinds struck in turn, of {', '.join(FAULTS)}")
    parser.add_argument("--runs", default="fault-free,faulted", help="which runs, in order")
    parser.add_argument("--join-timeout-ms", type=int, default=100, help="the lighthouse's wait for stragglers (LighthouseServer's default)")
    parser.add_argument("--min-replicas", type=int, default=1, help="the lighthouse's min_replicas")
    parser.add_argument("--min-replica-size", type=int, default=1, help="the Manager's min_replica_size")
    parser.add_argument("--pg-timeout", type=float, default=5.0, help="ProcessGroupGloo's timeout, s")
    parser.add_argument("--timeout", type=float, default=30.0, help="the Manager's timeouts, s")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--keep", action="store_true", help="keep each run's folder (events, logs)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default="benchmarks/results/torchft_soak.json")
    parser.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        return replica_main(args)

    import importlib.metadata

    from common import DEFAULT_DATA_DIR, mnist_batches, table, write_results

    kinds = tuple(args.faults.split(","))
    if not set(kinds) <= set(FAULTS):
        parser.error(f"--faults {args.faults}: each kind must be one of {', '.join(FAULTS)}")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at info
    batches = mnist_batches(args.data_dir or DEFAULT_DATA_DIR)
    with tempfile.TemporaryDirectory(prefix="torchft-soak-data-") as data:
        batches_file = Path(data) / "batches.pt"
        x = torch.zeros(len(batches), 128, *batches[0][0].shape[1:])
        y = torch.zeros(len(batches), 128, dtype=torch.long)
        for i, (bx, by) in enumerate(batches):
            x[i, : len(by)], y[i, : len(by)] = bx, by
        torch.save({"x": x, "y": y, "sizes": torch.tensor([len(by) for _, by in batches])}, batches_file)
        runs: dict[str, dict[str, Any]] = {}
        for name in args.runs.split(","):
            runs[name] = soak(args, batches_file, name == "faulted")
            r = runs[name]
            print(f"{name}: {r['samples_per_s']:.0f} samples/s, own pace {r['pace']:.0f}, {len(r['faults'])} faults, "
                  f"{r['restarts']} restarts, {len(r['left_processes'])} processes left", flush=True)  # fmt: skip
    free, faulted = runs.get("fault-free"), runs.get("faulted")
    rows = []
    for name, r in runs.items():
        struck = {k: sum(f[1] == k for f in r["faults"]) for k in kinds}
        kept = r["samples_per_s"] / free["samples_per_s"] if free else float("nan")
        rows.append([name if name == "fault-free" else f"a fault every {args.every:g} s", f"{r['seconds']:.0f}", f"{r['samples_per_s']:.0f}", f"{kept:.3f}",
                     f"{r['samples_per_s'] / r['pace']:.3f}", f"{len(r['faults'])} {struck}" if r["faults"] else "0", r["restarts"],
                     f"{r['participants_mean']:.2f}", len(r["left_processes"])])  # fmt: skip
    print(table(["run", "seconds", "samples/s", "kept", "kept of its own pace", "faults", "restarts", "mean participants", "processes left"], rows))
    payload: dict[str, Any] = {"torchft": importlib.metadata.version("torchft"), "replicas": args.replicas, "every_s": args.every, "k": args.k,
                               "faults": kinds, "settings": {"join_timeout_ms": args.join_timeout_ms, "min_replicas": args.min_replicas,
                               "min_replica_size": args.min_replica_size, "pg_timeout_s": args.pg_timeout, "timeout_s": args.timeout},
                               **{n.replace("-", "_"): r for n, r in runs.items()}}  # fmt: skip
    if free and faulted:
        payload["kept"] = faulted["samples_per_s"] / free["samples_per_s"]
        payload["kept_own_pace"] = (faulted["samples_per_s"] / faulted["pace"]) / (free["samples_per_s"] / free["pace"])
        payload["seconds_per_fault"] = faulted["seconds"] * (1 - faulted["samples_per_s"] / faulted["pace"]) / max(1, len(faulted["faults"]))
        print(f"each fault cost the fleet {payload['seconds_per_fault']:.2f} s of its own pace ({faulted['pace']:.0f} samples/s); "
              f"kept, each run against its own pace: {payload['kept_own_pace']:.3f}")  # fmt: skip
    write_results(args.out, payload)
    left = [p for r in runs.values() for p in r["left_processes"]]
    if left:
        raise SystemExit(f"processes left: {left}")


if __name__ == "__main__":
    main()
