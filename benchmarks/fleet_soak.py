"""A fleet that loses a machine every 30 s, on emulated machines: the throughput it keeps, beside torchrun's restart-and-resume (issue 54).

`--machines` network namespaces stand for machines of one process each, joined through a bridge
in one more namespace, the hub; each machine's link is shaped to `--rate` both ways. The fleet's
store (`--store`) is either an etcd cluster whose three members run on the first three machines
(etcd 3.4 with its v2 API, and python-etcd), so that a lost machine takes its member with it, rank
0's first of all; or a TCPStore in the hub, which no machine hosts. The hub also holds the restart
design's rendezvous store and torchft's lighthouse (torchft's own single point). Every design trains the same MLP on
MNIST for `--epochs` (benchmarks/fleet_soak_worker.py; `--schedule cosine` lowers its learning rate
to 0 by the end), once without faults and once while, from
its first step, one machine is lost every `--every` seconds (its torchrun agent and process
SIGKILLed, in turn, the machine of rank 0 among them; for the fleet, once every machine lost
before has been taken in again) and comes back `--back` seconds later (its torchrun started again).
With `--loss power` the machine's link goes down first and comes back up with it, so that nothing
its killed processes close reaches the others, as when a machine loses its power: its peers must
find it silent (`peer_timeout`). With `--strike spare-rank-0` the machine lost is the next in turn
but the one whose process started first, which holds the group's rank 0 and its claims: its peers
see the loss at the round's end, not at their next claim, as in a fleet of many machines:

    fleet    `.fleet(store).on_worker_failure("replace")`, a torchrun per machine: the survivors go
             on from the last average and the machine that comes back joins with a peer's state;
    restart  one torchrun job across the machines (c10d rendezvous in the store, `--nnodes 1:N`,
             `--max-restarts`), checkpoints every 4 rounds: at each change of machines every
             agent restarts its process, and the group resumes from the last checkpoint;
    torchft  torchft 0.2.0's LocalSGD, a replica group of one process per machine (no torchrun),
             going on with any one of them, a lighthouse in the hub; a machine that comes back
             heals from a peer (fleet_soak_worker.py says how its samples are counted).

Kept = the fault-free run's seconds over the faulted run's, from the first step to the last
process's end: the same samples, so the share of samples/s kept. Checked (else exit status 1):
every process that finished trained every epoch's batches once (its History's counters; torchft
has no such counters, and trains its replicas' own batches), and no process is left in any
namespace. Told: the faulted run's test loss against the fault-free
one's. Needs root and iproute2; `--loopback` runs the machines as sessions of processes on this
machine's loopback, unshaped, with no root. `--fault-free FILE` takes each design's fault-free run
from an earlier result of the same job instead of running it again: for a change that acts only
when a machine is lost (a fault-free fleet never runs short of a process), such as `--rescale off`,
the fleet's rounds short of a machine moving the model all the way to their average
(`.fleet(..., rescale=False)`) instead of their share of it.

    python -m benchmarks fleet_soak [--machines 4] [--every 30] [--back 10] [--epochs 40] [--rate 1gbit] [--designs fleet,restart,torchft]
        [--schedule constant|cosine] [--rescale on|off] [--payload float32|int8|...] [--store tcp|etcd] [--loss kill|power] [--strike turn|spare-rank-0] [--loopback]
        [--fault-free FILE] [--logs DIR] [--out benchmarks/results/fleet_soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import BATCH, machine, table, write_results
from benchmarks.slow_link import _remove_namespace, _run, _shape, check_privileges

ROOT = Path(__file__).resolve().parents[1]
HUB_ADDRESS, PORT = "10.214.0.100", 29400  # the bridge's address, in a namespace of this benchmark's own
_JOINED = re.compile(r"members? ([\d, ]+) joined \(generation")  # a survivor's line: who was taken in
BATCHES = -(-60_000 // BATCH)  # MNIST's training images in batches of BATCH
DESIGNS = ("fleet", "restart", "torchft")
ETCD_MEMBERS = 3  # on the first machines: a lost one leaves a quorum of two
# etcd's timing for a LAN (its tuning guide: a heartbeat about the round trip, an election 10 heartbeats),
# as docs/guides/many-machines.md advises; a new leader is what a fleet's survivors wait for after a loss
# (hosts/fleet._steady: 0.66 s at these settings on loopback).
ETCD_TIMING = ("--heartbeat-interval", "50", "--election-timeout", "500")


@dataclass(frozen=True)
class Machines:
    """The hub's namespace (bridge and store) and each machine's namespace, device and address;
    names "" for this machine's own network (`--loopback`), where a machine is a session of processes."""

    hub: str
    names: tuple[str, ...]
    devices: tuple[str, ...]
    addresses: tuple[str, ...]
    hub_address: str = HUB_ADDRESS
    port: int = PORT
    links: tuple[str, ...] = ()  # the hub's end of each machine's link (none on loopback)

    def link(self, i: int, up: bool) -> None:
        """Machine `i`'s link up or down, at the hub's end."""
        _run("ip", "-n", self.hub, "link", "set", self.links[i], "up" if up else "down")

    def inside(self, ns: str) -> tuple[str, ...]:
        """The prefix that runs a command in namespace `ns` (nothing on loopback)."""
        return ("ip", "netns", "exec", ns) if ns else ()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def loopback(machines: int) -> Iterator[Machines]:
    """`machines` sessions of processes on this machine's loopback, unshaped: no root needed."""
    yield Machines("", ("",) * machines, ("lo",) * machines, ("127.0.0.1",) * machines, "127.0.0.1", _free_port())


@contextmanager
def emulated(machines: int, rate: str) -> Iterator[Machines]:
    """`machines` namespaces joined through a bridge in a hub namespace, each link shaped to
    `rate` both ways; all removed on exit (with whatever still runs in them)."""
    tag = f"pwf{os.getpid() % 100000}"
    made = Machines(f"{tag}h", tuple(f"{tag}m{i}" for i in range(machines)), tuple(f"{tag}m{i}" for i in range(machines)),
                    tuple(f"10.214.0.{i + 1}" for i in range(machines)), links=tuple(f"{tag}p{i}" for i in range(machines)))  # fmt: skip
    try:
        _run("ip", "netns", "add", made.hub)
        _run("ip", "-n", made.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", made.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
        for dev in ("lo", "br0"):
            _run("ip", "-n", made.hub, "link", "set", dev, "up")
        for ns, dev, address, port in zip(made.names, made.devices, made.addresses, made.links):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", made.hub)
            _run("ip", "-n", made.hub, "link", "set", port, "master", "br0")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            for name, where in (("lo", ns), (dev, ns), (port, made.hub)):
                _run("ip", "-n", where, "link", "set", name, "up")
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", *_shape(rate))
            _run("tc", "-n", made.hub, "qdisc", "add", "dev", port, "root", "tbf", *_shape(rate))
        yield made
    finally:
        for ns in (*made.names, made.hub):
            _remove_namespace(ns)


def left_in(ns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split() if ns else []


class Etcd:
    """An etcd cluster of ETCD_MEMBERS members, member i on machine i, its data in `directory`
    (kept while its machine is lost, so that the member rejoins when the machine comes back)."""

    def __init__(self, made: Machines, directory: Path) -> None:
        self.made, self.directory = made, directory
        self.ports = [(_free_port(), _free_port()) if not made.names[0] else (2379, 2380) for _ in range(ETCD_MEMBERS)]  # (client, peer)
        self.members: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def address(self) -> str:
        """The fleet's store: etcd://every member's client address."""
        return "etcd://" + ",".join(f"{self.made.addresses[i]}:{client}" for i, (client, _) in enumerate(self.ports))

    def start(self, machine: int) -> None:
        """Machine `machine`'s member, if it holds one and it is not running."""
        if machine >= ETCD_MEMBERS or machine in self.members:
            return
        (client, peer), address = self.ports[machine], self.made.addresses[machine]
        cluster = ",".join(f"e{i}=http://{self.made.addresses[i]}:{p}" for i, (_, p) in enumerate(self.ports))
        command = [*self.made.inside(self.made.names[machine]), "etcd", "--name", f"e{machine}", "--data-dir", str(self.directory / f"etcd{machine}"),
                   "--enable-v2", "--listen-client-urls", f"http://{address}:{client}", "--advertise-client-urls", f"http://{address}:{client}",
                   "--listen-peer-urls", f"http://{address}:{peer}", "--initial-advertise-peer-urls", f"http://{address}:{peer}",
                   "--initial-cluster", cluster, "--initial-cluster-state", "new", *ETCD_TIMING]  # fmt: skip
        log = (self.directory / f"etcd{machine}.log").open("ab")
        self.members[machine] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy(self, timeout_s: float = 30.0) -> None:
        """Wait until every member answers."""
        endpoints = ",".join(f"http://{self.made.addresses[i]}:{client}" for i, (client, _) in enumerate(self.ports))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            probe = subprocess.run([*self.made.inside(self.made.hub), sys.executable, "-c",
                                    f"import json, urllib.request\nfor u in {endpoints!r}.split(','):\n"
                                    "    assert json.load(urllib.request.urlopen(u + '/health', timeout=1))['health'] == 'true', u"],
                                   capture_output=True)  # fmt: skip
            if probe.returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the etcd cluster at {endpoints} was not healthy within {timeout_s:g} s: {probe.stdout.decode()} {probe.stderr.decode()}")

    def lose(self, machine: int) -> None:
        member = self.members.pop(machine, None)
        if member is not None:
            member.kill()
            member.wait()


class Run:
    """One design's run on the machines: each machine's torchrun (torchft: its replica's process),
    started, lost and started again, with the machine's etcd member where the fleet's store is etcd."""

    def __init__(self, design: str, made: Machines, out: Path, job: tuple[int, int, str, str, str], run_id: str, etcd: Etcd | None = None,
                 lighthouse: str = "", power: bool = False) -> None:  # fmt: skip
        """`job`: the worker's EPOCHS, WIDTH, SCHEDULE, RESCALE and PAYLOAD (fleet_soak_worker.py); `power`: a machine
        lost loses its link first (`lose`)."""
        self.design, self.made, self.out, self.job, self.id = design, made, out, job, run_id
        self.etcd, self.lighthouse, self.power = etcd, lighthouse, power
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.began: dict[int, float] = {}  # when each machine's agent last started
        self.starts = 0
        self.down: set[int] = set()  # the machines whose link is down

    def start(self, i: int) -> None:
        n, ns, address = len(self.made.names), self.made.names[i], self.made.addresses[i]
        if i in self.down:
            self.made.link(i, up=True)
            self.down.discard(i)
        hub_store = f"tcp://{self.made.hub_address}:{self.made.port}/{self.id}"
        env = ["env", "-u", "RANK", "-u", "WORLD_SIZE", "-u", "MASTER_ADDR", "-u", "MASTER_PORT", f"GLOO_SOCKET_IFNAME={self.made.devices[i]}",
               f"PYTHONPATH={ROOT}", "OMP_NUM_THREADS=1", f"MACHINE={i}", f"ADDRESS={address}", f"LIGHTHOUSE={self.lighthouse}", "RUST_LOG=warn"]  # fmt: skip
        worker = [str(ROOT / "benchmarks" / "fleet_soak_worker.py"), self.design, hub_store, str(n), str(self.out), *map(str, self.job)]
        if self.design == "torchft":  # no torchrun; its hostname its address, which torchft's checkpoint server gives its peers
            named = ("unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', address) if ns else ()
            command = [*self.made.inside(ns), *named, *env, sys.executable, *worker]
        else:
            if self.design == "fleet":
                launch: tuple[str, ...] = ("--standalone", "--nproc-per-node", "1")
                if self.etcd is not None:
                    worker[2] = f"{self.etcd.address}/{self.id}"
                    self.etcd.start(i)
            else:
                conf = "is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120"
                launch = ("--nnodes", f"1:{n}", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.made.hub_address}:{self.made.port}",
                          "--rdzv-id", self.id, "--rdzv-conf", conf, "--max-restarts", "100", "--local-addr", address)  # fmt: skip
            command = [*self.made.inside(ns), *env, sys.executable, "-m", "torch.distributed.run", *launch, *worker]
        self.starts += 1
        log = (self.out / f"machine{i}-{self.starts}.log").open("wb")
        self.agents[i] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        self.began[i] = time.monotonic()

    def lose(self, i: int) -> None:
        """Machine `i` lost at once: everything in its namespace (on loopback, its agent's process
        tree: torchrun starts each worker in a session of its own; and its etcd member) SIGKILLed;
        with `power`, once its link is down."""
        if self.power:
            self.made.link(i, up=False)
            self.down.add(i)
        for pid in [*left_in(self.made.names[i]), *_tree(self.agents[i].pid)]:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.agents[i].wait()
        if self.etcd is not None:
            self.etcd.lose(i)

    def running(self) -> list[int]:
        return [i for i, agent in self.agents.items() if agent.poll() is None]

    def news(self) -> list[str]:
        """The fleet's lines so far ("parallelwrapper: member ..."), over every machine's logs."""
        return [line for log in sorted(self.out.glob("machine*.log")) for line in log.read_text(errors="replace").splitlines()
                if line.startswith("parallelwrapper: member")]  # fmt: skip


def _tree(root: int) -> list[int]:
    """`root` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def soak(design: str, made: Machines, job: tuple[int, int, str, str, str], every: float | None, back: float, timeout_s: float, logs: Path | None,
         cap_s: float | None = None, store_kind: str = "tcp", power: bool = False, spare_eldest: bool = False) -> dict[str, Any]:  # fmt: skip
    """One run of `design` on `job` (its epochs, the MLP's width, the learning rate's schedule, the fleet's rescale, the payload),
    with a machine lost every `every` seconds from the first step (None: none) and back `back`
    seconds later; its machines' logs copied into `logs`, if given. A run
    still going `cap_s` seconds after its first step is stopped there, and its progress is its
    last checkpoint's (the restart design's: it writes one every 4 rounds). A fleet's store is
    `store_kind`'s: "etcd" (members on the first machines) or "tcp" (in the hub). `power`: a lost
    machine's link goes down first. `spare_eldest`: the machine struck is never the one whose
    process started first (`--strike`)."""
    with tempfile.TemporaryDirectory(prefix="fleet_soak-") as directory:
        out = Path(directory)
        store = _serve(made, made.port, f"from torch.distributed import TCPStore\ns = TCPStore('{made.hub_address}', {made.port}, is_master=True, wait_for_workers=False)")
        etcd = Etcd(made, out) if design == "fleet" and store_kind == "etcd" else None
        lighthouse_port = made.port + 1 if made.names[0] else _free_port()
        lighthouse = None
        if design == "torchft":  # torchft's own single point, in the hub: quorums of any one replica, as its LocalSGD example's
            lighthouse = _serve(made, lighthouse_port, f"from torchft.coordination import LighthouseServer\ns = LighthouseServer(bind='[::]:{lighthouse_port}', min_replicas=1)")
        run = Run(design, made, out, job, f"{design}-{int(time.time())}", etcd, f"http://{made.hub_address}:{lighthouse_port}", power)
        faults: list[dict[str, Any]] = []
        try:
            if etcd is not None:
                for i in range(ETCD_MEMBERS):
                    etcd.start(i)
                etcd.healthy()
            for i in range(len(made.names)):
                run.start(i)
            deadline = time.monotonic() + timeout_s
            while not (out / "first.txt").exists():
                if not run.running():
                    raise RuntimeError(f"{design}: every machine's process ended before a first step (their logs' ends below): {_logs(out)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{design}: no step within {timeout_s:g} s: {_logs(out)}")
                time.sleep(0.05)
            first = float((out / "first.txt").read_text())
            due, lost, returns = first + (every or 0.0), 0, dict[int, float]()
            seen: set[str] = set()
            striking, capped = every is not None, None
            events: list[dict[str, Any]] = []  # when each of the fleet's lines appeared, and what it says
            while run.running() or returns:
                now = time.time()
                if any(out.glob("result-*.json")):  # the fit has ended: no machine is lost or taken back from now on
                    striking, returns = False, {}
                for line in run.news():
                    if line not in seen:
                        seen.add(line)
                        events.append({"at": round(now - first, 2), "line": line})
                for i, at in list(returns.items()):
                    if now >= at:
                        del returns[i]
                        if run.running():  # a run that has ended takes no one back
                            run.start(i)
                            next(f for f in reversed(faults) if f["machine"] == i)["back_at"] = round(now - first, 2)
                # A fleet's machine is struck only once every machine lost before has been taken in
                # again: else a newcomer still starting would be all that is left of the fleet.
                taken_in = {m for line in seen if (said := _JOINED.search(line)) for m in said.group(1).split(", ")}
                whole = design != "fleet" or len(taken_in) >= lost
                if striking and now >= due and whole and len(run.running()) == len(made.names):
                    victim = lost % len(made.names)
                    if spare_eldest:  # the next in turn but the machine that started first, which holds the group's rank 0
                        eldest = min(run.running(), key=run.began.__getitem__)
                        victim = next(v for v in ((lost + j) % len(made.names) for j in range(len(made.names))) if v != eldest)
                    run.lose(victim)
                    faults.append({"machine": victim, "at": round(now - first, 2)})
                    returns[victim], lost, due = now + back, lost + 1, due + every
                if cap_s is not None and now - first > cap_s:
                    capped = _capped(design, out, faults, events, cap_s)
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{design}: not done within {timeout_s:g} s: {_logs(out)}")
                time.sleep(0.05)
            if capped is not None:
                return capped
            results = [json.loads(p.read_text()) for p in sorted(out.glob("result-*.json"))]
            codes = {i: agent.returncode for i, agent in run.agents.items()}
            if not results:
                raise RuntimeError(f"{design}: no process finished ({codes}): {_logs(out)}")
            end = max(r["finished"] for r in results)
            return {
                "design": design, "faults": faults, "seconds": round(end - first, 2), "finished": len(results),
                "exit_codes": codes, "test_loss": results[0]["test_loss"], "test_accuracy": results[0]["test_accuracy"],
                "iterations": sorted({r["epochs"][-1][1] for r in results if r["epochs"]}),
                "restarts": max(r["restarts"] for r in results), "events": events,
                "rounds": max(r["rounds"] for r in results), "samples": max(r.get("samples", 0) for r in results),
                "test_losses": sorted({r["test_loss"] for r in results}), "last_lr": sorted({str(r.get("lr")) for r in results}),
                "train_loss": results[0]["train_loss"],
            }  # fmt: skip
        finally:
            for i in run.running():  # a stopped run's machines, or a failed one's
                run.lose(i)
            for i in run.down:  # for the next run
                made.link(i, up=True)
            for server in (store, lighthouse, *(etcd.members.values() if etcd else ())):
                if server is not None:
                    server.kill()
                    server.wait()
            if logs is not None:
                shutil.copytree(out, logs / f"{design}-{'faults' if every else 'clean'}", ignore=shutil.ignore_patterns("ckpt"), dirs_exist_ok=True)


def _capped(design: str, out: Path, faults: list[dict[str, Any]], events: list[dict[str, Any]], cap_s: float) -> dict[str, Any]:
    """A run stopped at `cap_s` seconds: what its last checkpoint holds, or None for its batches
    where it keeps none (the fleet's: its events and faults are kept all the same)."""
    import torch

    done = None
    if design != "fleet":
        for _ in range(20):  # a checkpoint being written is read again a moment later
            try:
                done = torch.load(out / "ckpt" / "checkpoint.pt", weights_only=False)["counters"]["iterations"]
                break
            except Exception:  # noqa: BLE001 - half-written, or none yet
                time.sleep(0.1)
        else:
            raise RuntimeError(f"{design}: stopped at {cap_s:g} s with no checkpoint to read its progress from: {_logs(out)}")
    return {"design": design, "faults": faults, "seconds": cap_s, "capped": True, "iterations_done": done, "events": events, "finished": 0}


SERVE_S = 60.0  # the most a hub's server takes to answer: a fresh interpreter importing torch, which took over 10 s in the suite's `quick` on a slow day


def _serve(made: Machines, port: int, code: str) -> subprocess.Popen[bytes]:
    """A server that Python `code` starts in the hub, once it answers at `port` (SERVE_S at most;
    one that exits fails at once)."""
    server = subprocess.Popen([*made.inside(made.hub), sys.executable, "-c", f"import time\n{code}\ntime.sleep(1e9)"], env={**os.environ, "RUST_LOG": "warn"})
    deadline = time.monotonic() + SERVE_S
    while time.monotonic() < deadline and server.poll() is None:
        probe = subprocess.run([*made.inside(made.hub), sys.executable, "-c", f"import socket; socket.create_connection(('{made.hub_address}', {port}), 1)"],
                               capture_output=True)  # fmt: skip
        if probe.returncode == 0:
            return server
        time.sleep(0.1)
    waited = "" if server.poll() is not None else f" in {SERVE_S:g} s"  # read before the kill, which would end it either way
    server.kill()
    raise RuntimeError(f"the hub's server at {made.hub_address}:{port} did not start{waited}: {code.splitlines()[-1]}")


_RAISED = re.compile(r"^[\w.]*(Error|Exception|Missing)\w*: .*$", re.MULTILINE)  # a Python exception's last line, as a traceback ends


def _logs(out: Path) -> str:
    """Each machine's log: the last exception its process raised (torchrun's report of its child's
    failure, which follows it, left out), then the log's end."""

    def said(text: str) -> str:
        raised = [m.group(0) for m in _RAISED.finditer(text) if "ChildFailedError" not in m.group(0)]
        return (f"{raised[-1]}\n..." if raised else "") + text[-1500:]

    return "\n".join(f"--- {p.name}\n{said(p.read_text(errors='replace'))}" for p in sorted(out.glob("machine*.log")))


def row(design: str, clean: dict[str, Any], faulted: dict[str, Any], batches: int) -> list[Any]:
    """The table's row of a design: its two runs' seconds, the machines lost, the share of
    samples/s kept (of a stopped run, the batches its checkpoint holds), the test loss."""
    if faulted.get("capped"):  # unfinished at the cap: its kept is below the fault-free run's seconds over the cap's
        done = faulted["iterations_done"]
        kept = f"< {clean['seconds'] / faulted['seconds']:.3f}" if done is None else f"{done / faulted['seconds'] / (batches / clean['seconds']):.3f}"
        return [design, clean["seconds"], f"stopped at {faulted['seconds']:g}", len(faulted["faults"]), kept, "-", "-"]
    kept = clean["seconds"] / faulted["seconds"]
    loss = faulted["test_loss"] / clean["test_loss"] - 1
    if abs(loss) > 0.01:  # a goal (issue 54), not a check: two fault-free runs of first-come claims differ too
        print(f"fleet_soak: {design}: the faulted run's test loss is {loss:+.2%} of the fault-free one's (the goal: within 1%)")
    return [design, clean["seconds"], faulted["seconds"], len(faulted["faults"]), f"{kept:.3f}", f"{loss:+.2%}", faulted["restarts"]]


# The settings a fault-free run depends on: an earlier run is the same job's where they agree.
_SAME_JOB = ("machines", "epochs", "width", "schedule", "rate", "store", "loopback", "payload")
_BEFORE = {"payload": "float32"}  # what a result from before a setting was added ran with


def fault_free_runs(path: str, settings: dict[str, Any], designs: list[str]) -> dict[str, dict[str, Any]]:
    """Each of `designs`' first fault-free run (no machine lost, not stopped) in the earlier
    result at `path`, whose job must be this one's (_SAME_JOB); SystemExit where it is not, or
    where a design has none."""
    earlier = json.loads(Path(path).read_text())
    ran = {k: earlier["settings"].get(k, _BEFORE.get(k)) for k in _SAME_JOB}
    differ = [f"{k} {ran[k]!r} against {settings[k]!r}" for k in _SAME_JOB if ran[k] != settings[k]]
    if differ:
        raise SystemExit(f"fleet_soak: --fault-free {path} ran another job ({'; '.join(differ)}): run without --fault-free, or give a result of this job")
    runs: dict[str, dict[str, Any]] = {}
    for run in earlier["runs"]:
        if not run["faults"] and not run.get("capped"):
            runs.setdefault(run["design"], run)
    if missing := [d for d in designs if d not in runs]:
        raise SystemExit(f"fleet_soak: --fault-free {path} has no fault-free run of {', '.join(missing)}: run without --fault-free, or drop it from --designs")
    return runs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks fleet_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between two machines lost")
    parser.add_argument("--back", type=float, default=10.0, help="seconds until a lost machine comes back")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden units (784-W-W-10)")
    parser.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                        help="the learning rate: 0.05 throughout, or falling to 0 on a cosine by the epoch (an end whose test loss the batches' order moves less)")  # fmt: skip
    parser.add_argument("--rescale", choices=("on", "off"), default="on",
                        help="the fleet's rounds short of a machine move the model their share of the way to the average (on), or all the way (off)")  # fmt: skip
    parser.add_argument("--rate", default="1gbit", help="each machine's link, both ways (tc tbf)")
    parser.add_argument("--designs", default=",".join(DESIGNS))
    parser.add_argument("--payload", default="float32", help="the fleet's and restart's payload_dtype (torchft's: float32)")
    parser.add_argument("--store", choices=("tcp", "etcd"), default="etcd",
                        help="the fleet's store: etcd's members on the first three machines (etcd 3.4, python-etcd), or a TCPStore in the hub")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=1800.0, help="the most seconds one run may take")
    parser.add_argument("--cap", type=float, default=None,
                        help="a faulted run still going this many times its fault-free run's seconds is stopped, its progress read from its checkpoint")  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/fleet_soak.json")
    parser.add_argument("--logs", default=None, help="a directory to copy every run's machine logs into")
    parser.add_argument("--fault-free", default=None, metavar="FILE",
                        help="each design's fault-free run from this earlier result of the same job, instead of running it again")  # fmt: skip
    parser.add_argument("--loopback", action="store_true", help="machines as sessions of processes on loopback, unshaped: no root needed")
    parser.add_argument("--loss", choices=("kill", "power"), default="kill",
                        help="a machine lost: its processes killed (their sockets close), or its link down first (a machine without power: nothing closes)")  # fmt: skip
    parser.add_argument("--strike", choices=("turn", "spare-rank-0"), default="turn",
                        help="which machine is lost: each in turn (most often the one that holds the group's rank 0, whose claims go with it, "
                             "so its peers see the loss at their next claim), or in turn but the one whose process started first, rank 0's "
                             "(its peers see the loss at the round's end, as in a fleet of many machines)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.loss == "power" and args.loopback:
        raise SystemExit("fleet_soak: --loss power takes a machine's link down: it needs the emulated machines, not --loopback")
    why = None if args.loopback else check_privileges()
    if why:
        raise SystemExit(f"fleet_soak: {why} (or --loopback)")
    designs = [d for d in args.designs.split(",") if d]
    if not designs or set(designs) - set(DESIGNS):
        raise SystemExit(f"fleet_soak: --designs takes some of {','.join(DESIGNS)}, got {args.designs!r}")
    if "fleet" in designs and args.store == "etcd" and (args.machines < ETCD_MEMBERS or not shutil.which("etcd")):
        raise SystemExit(f"fleet_soak: --store etcd needs {ETCD_MEMBERS} machines or more and etcd 3.4 (apt-get install etcd-server; pip install python-etcd); "
                         "or --store tcp")  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "logs")}
    if "torchft" in designs:
        from benchmarks.torchft_lenet import version

        settings["torchft"] = version()
    earlier = {} if args.fault_free is None else fault_free_runs(args.fault_free, settings, designs)
    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    rows: list[list[Any]] = []
    with loopback(args.machines) if args.loopback else emulated(args.machines, args.rate) as made:
        for design in designs:
            for every in (None, args.every):
                if every is None and design in earlier:
                    runs.append(earlier[design])
                    print(f"{design}, no faults: {earlier[design]['seconds']} s, from {args.fault_free}", flush=True)
                    continue
                cap = None if every is None or args.cap is None else args.cap * runs[-1]["seconds"]
                logs = None if args.logs is None else Path(args.logs)
                result = soak(design, made, (args.epochs, args.width, args.schedule, args.rescale, args.payload), every, args.back, args.timeout, logs, cap, args.store, args.loss == "power",
                              args.strike == "spare-rank-0")  # fmt: skip
                result["left"] = {ns: left_in(ns) for ns in made.names}  # once its machines and store are put down
                runs.append(result)
                faults = f"a machine lost every {every:g} s" if every else "no faults"
                if result.get("capped"):
                    trained = "an unknown number of" if result["iterations_done"] is None else result["iterations_done"]
                    done = f"stopped at {cap:g} s with {trained} batches trained"
                else:
                    done = f"test loss {result['test_loss']:.4f}"
                print(f"{design}, {faults}: {result['seconds']} s, {len(result['faults'])} machines lost, {done}", flush=True)
                if not result.get("capped") and design != "torchft" and result["iterations"] != [args.epochs * BATCHES]:
                    problems.append(f"{design}: a finished process trained {result['iterations']} batches, not {args.epochs * BATCHES}")
                if any(result["left"].values()):
                    problems.append(f"{design}: processes left behind: {result['left']}")
                if every is not None:
                    rows.append(row(design, runs[-2], result, args.epochs * BATCHES))
                write_results(args.out, {"settings": settings, "machine": machine(), "runs": runs, "table": rows, "problems": problems})
    print(table(["design", "fault-free s", "faulted s", "machines lost", "kept", "test loss vs fault-free", "agent restarts"], rows))
    if problems:
        raise SystemExit("fleet_soak: " + "; ".join(problems))


if __name__ == "__main__":
    main()
