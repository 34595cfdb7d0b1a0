"""Two machines on a slow link: time to a test accuracy (or, `--arena gpt`, a validation loss) for
DDP (plain and with PowerSGD), PeriodicModelAverager, torchft's DiLoCo and LocalSGD, and this
project (plain, with an outer optimizer, with a 16-bit or quantized payload).

    sudo python -m benchmarks slow_link --repeats 3          # the default contenders, 100 Mbit/s, 98%
    sudo python -m benchmarks slow_link --contenders ddp,wrapper:16 --target 0.90 --max-epochs 1

The two "machines" are two network namespaces joined by a veth pair whose ends are both shaped
with `tc ... tbf` to `--rate`; each runs one torchrun agent (`--nnodes 2`, `--procs-per-node`
processes each, default 1), as two real machines would, so every byte between the nodes crosses
the shaped link (with 2 per node, a node's two ranks talk within their namespace, unshaped). For each
contender (see slow_link_worker.py) rank 0 scores the model every few steps off the clock; the
table gives, per contender, the training seconds until the first score >= `--target` (median
of `--repeats`, every contender run once per repeat, in a rotated order) and each repeat's, the
steps per rank it took, the pace in ms/step, the speed-up over the best peer (DDP, PowerSGD,
PeriodicModelAverager, torchft) and the ratio to the no-communication limit: the same steps at the pace
of `none`, which trains with no collective at all. The namespaces are removed at the end, on
error and on Ctrl-C. Needs root and `ip netns` (iproute2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import torchft_lenet
from benchmarks.common import DEFAULT_DATA_DIR, table, write_results
from benchmarks.race import Runs, at_equal_time, best, doubling_costs, modelled_seconds, race, race_by_turns, regret, scored
from benchmarks.slow_link_worker import AUTOS, SEED, WRAPPERS

ROOT = Path(__file__).resolve().parents[1]  # the torchrun workers import benchmarks.slow_link_worker from it
ADDRESSES = ("10.213.37.1", "10.213.37.2")  # a private /30 that exists only inside the two namespaces


@dataclass(frozen=True)
class Link:
    """Two namespaces, one veth end in each: `names[r]`, `devices[r]`, `addresses[r]` for rank r;
    names "" for this machine's own network (`loopback`)."""

    names: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def check_privileges() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if os.geteuid() != 0:
        return "it must run as root (network namespaces and tc need CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: install iproute2 (apt-get install iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns list` fails here: this ip has no network-namespace support"
    return None


@contextmanager
def slow_link(rate: str) -> Iterator[Link]:
    """Two fresh namespaces joined by a veth pair shaped to `rate` in both directions; removed on exit."""
    tag = f"pwbench-{os.getpid()}"
    # Interface names have at most 15 characters.
    link = Link((f"{tag}-0", f"{tag}-1"), (f"pwb{os.getpid()}a", f"pwb{os.getpid()}b"), ADDRESSES)
    try:
        for ns in link.names:
            _run("ip", "netns", "add", ns)
        # Created straight inside the namespaces: the host's own network is never touched.
        _run("ip", "link", "add", link.devices[0], "netns", link.names[0], "type", "veth", "peer", "name", link.devices[1], "netns", link.names[1])
        for r, (ns, dev) in enumerate(zip(link.names, link.devices)):
            _run("ip", "-n", ns, "addr", "add", f"{link.addresses[r]}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", dev, "up")
            # A token bucket on each egress shapes both directions; the 64 KB burst holds one
            # GSO super-packet, small against the megabytes of an averaging.
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", *_shape(rate))
        yield link
    finally:
        for ns in link.names:
            _remove_namespace(ns)


def _shape(rate: str) -> tuple[str, ...]:
    return ("rate", rate, "burst", "64kb", "latency", "100ms")


def reshape(link: Link, rate: str) -> None:
    """The link's rate, both directions, changed in place (a link that drops or comes back)."""
    for ns, dev in zip(link.names, link.devices):
        _run("tc", "-n", ns, "qdisc", "change", "dev", dev, "root", "tbf", *_shape(rate))


def shaper_counts(link: Link) -> dict[str, dict[str, int]]:
    """What each namespace's shaper and TCP saw over the race: packets sent and dropped by the
    token bucket, segments TCP sent again and its retransmission timeouts (/proc/net/snmp and
    netstat, read inside the namespace). An exchange that takes ten times its link's time is TCP
    waiting out a timeout only where these say so."""
    counts = {}
    for ns, dev in zip(link.names, link.devices):
        stats = json.loads(subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True).stdout)[0]
        tcp = _counters(subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp", "/proc/net/netstat"], capture_output=True, text=True, check=True).stdout)
        counts[ns] = {"packets": stats["packets"], "dropped": stats["drops"], "retransmitted_segments": tcp["Tcp:RetransSegs"], "timeouts": tcp["TcpExt:TCPTimeouts"]}
    return counts


def _counters(text: str) -> dict[str, int]:
    """/proc/net/snmp's and netstat's counters by "Group:Name": each group is a line of names and a
    line of values."""
    counts, lines = {}, text.splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        group, *keys = names.split()
        counts.update({group + key: int(value) for key, value in zip(keys, values.split()[1:])})
    return counts


def parse_changes(text: str | None) -> list[tuple[float, str]]:
    """--changes "60:10mbit,120:200mbit": (seconds after a contender's ranks start, the rate from then on)."""
    if not text:
        return []
    try:
        changes = [(float(at), rate) for at, _, rate in (item.partition(":") for item in text.split(","))]
    except ValueError:
        raise SystemExit(f"slow_link: --changes {text!r} is not SECONDS:RATE,...; e.g. 60:10mbit,120:200mbit") from None
    if any(not rate for _, rate in changes) or [at for at, _ in changes] != sorted(at for at, _ in changes):
        raise SystemExit(f"slow_link: --changes {text!r}: each item SECONDS:RATE, the seconds rising; e.g. 60:10mbit,120:200mbit")
    return changes


@contextmanager
def loopback() -> Iterator[Link]:
    """Both "machines" on this machine's loopback, unshaped: no root needed (`--loopback`, `--smoke`)."""
    yield Link(("", ""), ("lo", "lo"), ("127.0.0.1", "127.0.0.1"))


def _remove_namespace(ns: str) -> None:
    """Kill what is left in it (only our torchrun processes can be there), then delete it; the
    veth pair goes with it."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass
class Ranks:
    """One contender's torchrun agents, one a namespace, and their logs."""

    name: str
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    @property
    def alive(self) -> bool:
        """Some agent still runs and none has failed."""
        codes = [p.poll() for p in self.procs]
        return None in codes and all(code in (None, 0) for code in codes)

    def stop(self) -> None:
        for p in self.procs:
            _stop(p)

    def check(self, timeout: float) -> None:
        """A RuntimeError with the logs' tails unless every agent ended well."""
        if any(p.returncode != 0 for p in self.procs):
            tails = "\n".join(f"--- rank {r}:\n" + _tail(log) for r, log in enumerate(self.logs))
            raise RuntimeError(f"{self.name}: the ranks failed or ran past {timeout:.0f} s (exit codes {[p.returncode for p in self.procs]})\n{tails}")


def start_ranks(link: Link, port: int, worker_args: Sequence[str], log_dir: Path, name: str, per_node: int = 1) -> Ranks:
    """One torchrun agent per namespace, as on two machines, each starting `per_node` ranks."""
    ranks = Ranks(name, [], [log_dir / f"{name}.rank{r}.log" for r in range(2)])
    try:
        for r in range(2):
            command = [
                *(("ip", "netns", "exec", link.names[r]) if link.names[r] else ()),
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", str(per_node),
                "--master-addr", link.addresses[0], "--master-port", str(port),
                "-m", "benchmarks.slow_link_worker", *worker_args,
            ]  # fmt: skip
            # Gloo would otherwise pick the address of the host name, which the namespace lacks.
            # BENCH_ADDRESS: where the other namespace reaches this one (torchft's store and manager).
            path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link.devices[r], "OMP_NUM_THREADS": "1", "BENCH_ADDRESS": link.addresses[r], "PYTHONPATH": path}
            with ranks.logs[r].open("wb") as log:
                # A session of its own: a Ctrl-C here reaches the driver, which stops them in order.
                ranks.procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    except BaseException:
        ranks.stop()
        raise
    return ranks


def run_ranks(link: Link, port: int, worker_args: Sequence[str], log_dir: Path, name: str, timeout: float, per_node: int = 1,
              changes: Sequence[tuple[float, str]] = ()) -> None:  # fmt: skip
    """`start_ranks` and wait for them; raises with the logs' tails on failure. `changes`: the
    link's rate from so many seconds after the ranks start (the caller sets it back after)."""
    pending = list(changes)
    ranks = start_ranks(link, port, worker_args, log_dir, name, per_node)
    try:
        start = time.monotonic()
        deadline = start + timeout
        while ranks.alive and time.monotonic() < deadline:
            while pending and time.monotonic() - start >= pending[0][0]:
                reshape(link, pending.pop(0)[1])
            time.sleep(0.1 if pending else 0.5)
    finally:
        ranks.stop()
    ranks.check(timeout)


def rate_at(seconds: float, rate: str, changes: Sequence[tuple[float, str]]) -> str:
    """The link's rate `seconds` into a contender's run under --changes."""
    return next((r for at, r in reversed(changes) if seconds >= at), rate)


def interleaved(link: Link, runs: dict[str, tuple[int, list[str]]], work: Path, timeout: float, per_node: int, rate: str,
                changes: Sequence[tuple[float, str]]) -> dict[str, RuntimeError | None]:  # fmt: skip
    """--interleave: every contender of `runs` (name: its master port and worker arguments, in the
    order of their turns) starts at once, and they train by turns, one chunk (a score) each, in
    that order, until each has ended (slow_link_worker.Turns). The set-up of all of them is done
    before the first turn; a drift of the machine's pace over minutes then falls on each alike,
    where contenders run one after the other lets it fall on whichever ran then. Under `changes`
    the link follows each contender's own training clock as it takes its turn. Returns each
    one's failure, None where it ended well."""
    started: dict[str, Ranks] = {}
    folders = {name: Path(tempfile.mkdtemp(prefix="turns-", dir=work)) for name in runs}  # one a contender, fresh each repeat
    outcome: dict[str, RuntimeError | None] = {}
    try:
        for name, (port, worker_args) in runs.items():
            started[name] = start_ranks(link, port, [*worker_args, "--turns", str(folders[name])], work, name, per_node)
        deadline = time.monotonic() + timeout * len(runs)
        while not all((folders[n] / "ready").exists() or not started[n].alive for n in runs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        clocks, turn, shaped = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0), rate
        playing = [n for n in runs if started[n].alive]
        while playing and time.monotonic() < deadline:
            for name in list(playing):
                ranks, folder = started[name], folders[name]
                pending = [(at, r) for at, r in changes if at > clocks[name]]
                if (now := rate_at(clocks[name], rate, changes)) != shaped:
                    reshape(link, now)
                    shaped = now
                handed = time.monotonic()
                (folder / "go").write_text(str(turn[name]))
                said: dict[str, Any] = {}
                while ranks.alive and time.monotonic() < deadline:
                    if (folder / "done").exists() and (said := json.loads((folder / "done").read_text()))["chunk"] == turn[name]:
                        break
                    while pending and time.monotonic() - handed >= pending[0][0] - clocks[name]:  # on its clock, within its turn
                        shaped = pending.pop(0)[1]
                        reshape(link, shaped)
                    time.sleep(0.005)
                if said.get("chunk") == turn[name] and not said["last"]:
                    clocks[name], turn[name] = said["seconds"], turn[name] + 1
                    continue
                playing.remove(name)  # its last chunk, or it ended or failed: it leaves the turns before the next one takes its own
                end = time.monotonic() + 60
                while ranks.alive and time.monotonic() < end:
                    time.sleep(0.05)
    finally:
        for ranks in started.values():
            ranks.stop()
        if changes:
            reshape(link, rate)
    for name, ranks in started.items():
        try:
            ranks.check(timeout)
            outcome[name] = None
        except RuntimeError as e:
            outcome[name] = e
    return outcome


def _stop(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the agent's process group (torchrun then stops its worker), SIGKILL if it lingers."""
    if p.poll() is not None:
        return
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=15)


def _tail(path: Path, lines: int = 40) -> str:
    """The end of the worker's own stderr (torch prefixes it with [rankN]), which holds the cause;
    torchrun's summary after it does not. The end of the whole log when the worker said nothing:
    40 lines, since torchrun's summary alone takes about 30, and a worker that aborted in C++
    ("terminate called without an active exception", exit code -6) said its one line before it."""
    text = path.read_text(errors="replace").splitlines()
    own = [line for line in text if line.startswith("[rank")]
    return "\n".join((own or text)[-lines:])


PEERS = ("ddp", "powersgd", "pma", *torchft_lenet.KINDS)  # the contenders that are not this project (nor the limit)


def choices(result: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The autopilot's choices (wrapper-auto), run-length coded over its Scores: from which round
    on, for how many rounds, k, payload, optimizer-state period, and its step and link seconds
    then; None for the other contenders."""
    if result.get("contender") not in AUTOS:
        return None
    runs: list[dict[str, Any]] = []
    for s in result.get("scores", []):
        key = (s["k"], s["payload"], s["updaters_every"], s.get("overlap", False))
        if runs and (runs[-1]["k"], runs[-1]["payload"], runs[-1]["updaters_every"], runs[-1]["overlap"]) == key:
            runs[-1]["rounds"] += 1
        else:
            runs.append({"from_round": s["round"], "rounds": 1, "k": s["k"], "payload": s["payload"], "updaters_every": s["updaters_every"], "overlap": key[3]})
    return runs


def choices_text(runs: list[dict[str, Any]] | None) -> str:
    """e.g. "k=1 float32 x4, k=64 float32/2 x2, k=32 int8/0 overlapped x9" (/2: the optimizer's
    state every 2 rounds)."""
    if not runs:
        return "-"
    return ", ".join(
        f"k={r['k']} {r['payload']}{'' if r['updaters_every'] == 1 else '/' + str(r['updaters_every'])}{' overlapped' if r.get('overlap') else ''} x{r['rounds']}"
        for r in runs
    )


def summarise(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender over the repeats: medians of the seconds to target (None unless every repeat
    reached it), of the steps and of the pace (over the repeats that ran)."""
    seconds = [r["seconds"] for r in repeats]
    reached = all(s is not None for s in seconds)
    paces = [r["ms_per_step"] for r in repeats if r["ms_per_step"] is not None]
    comms = [r.get("comm_fraction") for r in repeats if r.get("comm_fraction") is not None]
    return {
        "seconds": statistics.median(seconds) if reached else None,
        "seconds_each": seconds,
        "steps_each": [r["steps_per_rank"] for r in repeats],
        "steps_per_rank": statistics.median(r["steps_per_rank"] for r in repeats) if reached else None,
        "ms_per_step": statistics.median(paces) if paces else None,
        "ms_per_step_each": [r["ms_per_step"] for r in repeats],
        "comm_fraction": statistics.median(comms) if comms else None,
        "comm_fraction_each": [r.get("comm_fraction") for r in repeats],
        "choices_each": [r.get("choices") for r in repeats],
        "best_accuracy": [r["best_accuracy"] for r in repeats],
        "errors": [r["error"] for r in repeats if "error" in r],
    }


def compare_to_peers(runs: Runs, summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Within each repeat (this machine's pace drifts by half between repeats, and a repeat's
    contenders run minutes apart at most): each contender's speed-up over that repeat's best
    peer, and its ratio to that repeat's no-communication limit, its own steps at `none`'s pace.
    The summary keeps the medians over the repeats; None where a repeat did not reach the target."""
    repeats = min(len(rs) for rs in runs.values())
    best_peers = []
    for i in range(repeats):
        fastest = best(runs, i, PEERS)
        best_peers.append(fastest)
        none_pace = runs["none"][i]["ms_per_step"] if "none" in runs else None  # None too where it failed
        for r in (rs[i] for rs in runs.values()):
            r["vs_best_peer"] = runs[fastest][i]["seconds"] / r["seconds"] if fastest and r["seconds"] else None
            limit = r["steps_per_rank"] * none_pace / 1000 if none_pace and r["steps_per_rank"] else None
            r["limit_seconds"], r["vs_limit"] = limit, (r["seconds"] / limit if limit and r["seconds"] else None)
    for name, s in summary.items():
        for key in ("vs_best_peer", "vs_limit"):
            values = [r[key] for r in runs[name][:repeats]]
            s[f"{key}_each"] = values
            s[key] = statistics.median(values) if all(v is not None for v in values) else None
    return {"best_peer_each": best_peers}


def report(settings: dict[str, Any], runs: Runs) -> dict[str, Any]:
    """Print the table of `runs` (per contender, one record per repeat); the summary and verdict."""
    summary = {name: summarise(rs) for name, rs in runs.items()}
    verdict = compare_to_peers(runs, summary)
    rows = [
        (name, _or_dash(s["seconds"]), " / ".join(_fmt(x) for x in s["seconds_each"]), " / ".join(_fmt(x) for x in s["steps_each"]),
         _or_dash(s["ms_per_step"]), " / ".join(_fmt(x) for x in s["ms_per_step_each"]), _or_dash(s["vs_best_peer"]), _or_dash(s["vs_limit"]),
         _or_dash(s.get("comm_fraction")))
        for name, s in summary.items()
    ]  # fmt: skip
    target = settings["target"]
    ranks = 2 * settings.get("procs_per_node", 1)
    arena = "CharGPT on the stdlib corpus (target: validation loss)" if settings.get("arena") == "gpt" else "LeNet, MNIST"
    where = "on loopback, unshaped" if settings.get("loopback") else f"in 2 namespaces over a {settings['rate']} veth"
    print(f"\n{arena}, {ranks} ranks {where}, lr {settings['lr']}, "
          f"scored every {settings['eval_every']} steps per rank, {len(next(iter(runs.values())))} repeats (seeds {', '.join(map(str, settings.get('seeds') or [SEED]))}); "
          f"best peer per repeat: {', '.join(str(b) for b in verdict['best_peer_each'])}")  # fmt: skip
    print(table(["contender", (f"s to loss {target}" if settings.get("arena") == "gpt" else f"s to {target:.0%}") + " (median)", "each repeat", "steps/rank each", "ms/step (median)", "ms/step each",
                 "speed-up vs best peer (median)", "/ no-comm limit (median)", "communicating (median)"], rows))  # fmt: skip
    for name, s in summary.items():
        for i, chosen in enumerate(s.get("choices_each") or []):
            if chosen:
                print(f"{name}, repeat {i + 1}: {choices_text(chosen)}")
    fixed = [n for n in runs if n.partition(":")[0] in WRAPPERS and n.partition(":")[0] not in AUTOS and ":" in n]
    found, regrets = regret(runs, fixed)
    if any(found):
        targets = "; ".join(f"repeat {i + 1}: {f[0]}'s {', '.join(f'{t:.4g}' for t in f[1])}" for i, f in enumerate(found) if f)
        print(f"\nseconds to each target, read between scores, over the fastest fixed setting's (targets: the best fixed setting's score at a third, two thirds and the end; {targets})")
        print(table(["contender", "a third", "two thirds", "the end"],
                    [(n, *(" / ".join(_fmt(r[j]) for r in rs) for j in range(3))) for n, rs in regrets.items() if rs]))  # fmt: skip
    for i in range(len(next(iter(runs.values())))):
        if (equal := at_equal_time(runs, i)) is not None:
            end, scores = equal
            _, sign = scored(next(rs[i]["points"] for rs in runs.values() if rs[i].get("points")))
            top = min(scores.values(), key=lambda v: sign * v)  # the lowest loss, or the highest accuracy
            print(f"repeat {i + 1} at equal time ({end:.1f} s, the shortest run's end): "
                  + ", ".join(f"{n} {v:.4f} ({v / top - 1:+.2%} over the best)" for n, v in scores.items()))  # fmt: skip
    costs = doubling_costs(runs, fixed)
    for pair, each in costs.items():
        beta = statistics.median(each)
        print(f"{pair}: each doubling of k took {beta:.1%} more steps to the same validation loss (median of {len(each)}, "
              f"{min(each):.1%} to {max(each):.1%}): doubling k pays while exchanges take more than {2 * beta / (1 + beta):.1%} of the time")
    modelled = modelled_seconds(runs, fixed, costs)
    for kind, each_repeat in modelled.items():
        text = " / ".join("-" if m is None else ", ".join(f"k = {k} {t:.3g}" for k, t in m.items()) for m in each_repeat)
        lowest = " / ".join("-" if m is None else min(m, key=m.__getitem__) for m in each_repeat)
        print(f"{kind}: seconds to a loss over its shortest k's, modelled as (1 + β)^log2 k / (1 - s(k)) from its runs' shares s "
              f"and the doublings' β, each repeat: {text}; lowest at k = {lowest}")
    return {**verdict, "summary": summary, "regret": {"targets_each": found, "each": regrets}, "doubling_cost": costs, "modelled_seconds": modelled}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit", help="tc rate of the link, each direction")
    parser.add_argument("--target", type=float, default=0.98, help="test accuracy to reach")
    parser.add_argument(
        "--contenders",
        default="ddp,powersgd:2,powersgd:4,pma:16,wrapper:16,wrapper-params:16,wrapper-overlap:16,wrapper-outer:16,wrapper-outer:64,wrapper-bf16:16,none",
        help="ddp, powersgd:RANK, pma:K, torchft-diloco:K, torchft-localsgd:K, wrapper[-params|-overlap|-outer|-bf16|-node|-params-int8|-params-int4|-params-sparse|-params-sparse128]:K, "
             "wrapper-auto (the autopilot: no K; k is at most --eval-every, each score being a fit() of that many steps), "
             "wrapper-auto-sync (the same, never overlapped), wrapper-auto-sparse (sparse among its payloads), "
             "wrapper-auto-params (the optimizer's state never sent), wrapper-auto-outer (with wrapper-outer's outer step), none",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs of every contender, in a rotated order")
    parser.add_argument("--seed", type=int, default=SEED, help="model init and the batches' order, every contender alike")
    parser.add_argument("--seed-each", action="store_true",
                        help="repeat r (from 0) runs with --seed + r: the repeats sample how a run's loss depends on its trajectory, "
                             "which with one seed they share (each fixed setting's losses are then the same in every repeat)")
    parser.add_argument("--interleave", action="store_true",
                        help="a repeat's contenders start together and train by turns, a score's chunk each, so that a drift of the machine's pace "
                             "falls on every one alike (one after the other, a run falls on whatever the machine did then)")
    parser.add_argument("--changes", default=None, metavar="S:RATE,...",
                        help="the link's rate from S seconds after each contender's ranks start, e.g. 60:10mbit,120:200mbit (--rate again before the next)")
    parser.add_argument("--loopback", action="store_true", help="no namespaces, no shaping: both nodes on this machine's loopback (no root; --smoke)")
    parser.add_argument("--procs-per-node", type=int, default=1, help="ranks per namespace (2: a node's ranks share its loopback; for wrapper-node)")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--arena", choices=["lenet", "gpt"], default="lenet",
                        help="gpt: benchmarks/gpt_arena.py's character GPT (5.6M parameters) on the standard library's sources, "
                             "AdamW inner optimizer; --target is a validation loss in nats/byte")
    parser.add_argument("--batch", type=int, default=16, help="gpt arena: 128-byte windows per step per rank")
    parser.add_argument("--max-steps", type=int, default=2000, help="gpt arena: steps per rank at most")
    parser.add_argument("--layers", type=int, default=7, help="gpt arena: CharGPT's layers (4 with --width 192: 1.85M parameters)")
    parser.add_argument("--width", type=int, default=256, help="gpt arena: CharGPT's width")
    parser.add_argument("--eval-every", type=int, default=64, help="steps per rank between scores (a multiple of every k)")
    parser.add_argument("--lr", type=float, default=0.04, help="Nesterov SGD, every contender (pw-fit's default)")
    parser.add_argument("--exchange-share", type=float, default=0.05, help="the autopilot contenders' exchange_share (ρ; the library's default 0.05)")
    parser.add_argument("--outer-lr", type=float, default=1.0, help="wrapper-outer's outer SGD learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.3, help="wrapper-outer's outer Nesterov momentum")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per contender")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="training seconds after which a contender stops at its next score, reached or not (for DDP on a slow link)")
    parser.add_argument("--out", default="benchmarks/results/slow_link.json")
    parser.add_argument("--analyse", metavar="JSON", help="no runs: re-read a results file, print its table and rewrite its summary")
    args = parser.parse_args(argv)
    if args.arena == "gpt":  # AdamW at 1e-3 unless told otherwise
        args.lr = 1e-3 if args.lr == parser.get_default("lr") else args.lr
        args.target = 2.0 if args.target == parser.get_default("target") else args.target
    if args.analyse:
        saved = json.loads(Path(args.analyse).read_text())
        saved.update(report(saved, saved["runs"]))
        Path(args.analyse).write_text(json.dumps(saved, indent=2) + "\n")
        return
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    changes = parse_changes(args.changes)
    if changes and args.loopback:
        raise SystemExit("slow_link: --changes shapes the link between namespaces; drop --loopback")
    for c in contenders:
        kind, _, k = c.partition(":")
        periodic = ("pma", *(w for w in WRAPPERS if w not in AUTOS), *torchft_lenet.KINDS)
        bad_k = (k != "" and not k.isdigit()) if kind in AUTOS else (kind in (*periodic, "powersgd")) != k.isdigit()  # auto: K optional (k_min)
        if kind not in ("ddp", "none", *AUTOS, "powersgd", *periodic) or bad_k:
            parser.error(f"unknown contender {c!r}: use ddp, none, {'[:K_MIN], '.join(AUTOS)}[:K_MIN], powersgd:RANK, pma:K, or {', '.join(w + ':K' for w in periodic[1:])}")
        if kind in periodic and args.eval_every % int(k):
            parser.error(f"--eval-every {args.eval_every} is not a multiple of k = {k}: the model would be scored between averagings")
    torchft_version = torchft_lenet.version() if any(c.startswith("torchft") for c in contenders) else None
    problem = None if args.loopback else check_privileges()
    if problem is not None:
        sys.exit(f"slow_link: cannot set up the two namespaces: {problem}")
    # Ctrl-C and SIGTERM must run the finally blocks that remove the namespaces (SIGINT is
    # ignored by default in a process started in the background by a script: restore it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    shared = ["--data-dir", args.data_dir, "--max-epochs", str(args.max_epochs), "--target", str(args.target),
              "--eval-every", str(args.eval_every), "--lr", str(args.lr),
              "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum), "--exchange-share", str(args.exchange_share),
              "--arena", args.arena, "--batch", str(args.batch), "--max-steps", str(args.max_steps), "--budget", str(args.budget),
              "--layers", str(args.layers), "--width", str(args.width),
              "--optimizer", "adamw" if args.arena == "gpt" else "sgd"]  # fmt: skip
    seeds = [args.seed + r if args.seed_each else args.seed for r in range(args.repeats)]
    started = time.monotonic()
    port = 29401
    with tempfile.TemporaryDirectory(prefix="pwbench-") as tmp, (loopback() if args.loopback else slow_link(args.rate)) as link:
        work = Path(tmp)
        print(f"{link.names[0] or 'loopback'} ({link.addresses[0]}) and {link.names[1] or 'loopback'} ({link.addresses[1]}), "
              f"{'unshaped' if args.loopback else f'veth shaped to {args.rate}'}", flush=True)  # fmt: skip
        measured = None  # on loopback nothing is shaped: no link to measure
        if not args.loopback:
            run_ranks(link, 29400, ["link", "--out", str(work / "link.json")], work, "link", timeout=300)
            measured = json.loads((work / "link.json").read_text())
            print(
                f"link: 10 MB one way in {measured['one_way_s']:.2f} s = {measured['one_way_mbit_s']:.0f} Mbit/s; "
                f"all_reduce of 10 MB in {measured['all_reduce_s']:.2f} s",
                flush=True,
            )

        def worker_args(name: str, repeat: int) -> tuple[list[str], Path]:
            kind, _, k = name.partition(":")
            out = work / f"{kind}{k}.{repeat}.json"
            return [kind, *([k] if k else []), "--out", str(out), "--seed", str(seeds[repeat]), *shared], out

        def result(out: Path) -> dict[str, Any]:
            result = json.loads(out.read_text())
            points = result.pop("points")
            return {"points": points, "comm_fraction": result.get("comm_fraction"), "choices": choices(result), "result": result}

        def run(name: str, repeat: int) -> dict[str, Any]:
            nonlocal port
            argv, out = worker_args(name, repeat)
            port += 1  # a fresh port per run: the previous run's sockets may linger in TIME_WAIT
            try:
                run_ranks(link, port - 1, argv, work, name, args.timeout, args.procs_per_node, changes)
            finally:
                if changes:
                    reshape(link, args.rate)
            return result(out)

        def run_all(order: list[str], repeat: int) -> dict[str, dict[str, Any] | RuntimeError]:
            nonlocal port
            each = {name: (port + 10 * i, *worker_args(name, repeat)) for i, name in enumerate(order)}  # 10 apart: torchft's lighthouse is at +1000
            port += 10 * len(order)
            failed = interleaved(link, {n: (at, argv) for n, (at, argv, _) in each.items()}, work, args.timeout, args.procs_per_node, args.rate, changes)
            return {n: failed[n] or result(out) for n, (_, _, out) in each.items()}

        if args.interleave:  # each repeat's runs kept as they land: a repeat by turns takes all its contenders' time
            runs = race_by_turns(contenders, args.repeats, run_all, args.target, lambda runs: write_results(args.out + ".partial", {"runs": runs}))
        else:
            runs = race(contenders, args.repeats, run, args.target, keep_going=True)  # one contender's failure (a NaN loss) is its result
        shaper = None if args.loopback else shaper_counts(link)
        if shaper is not None:
            print("shaper: " + "; ".join(f"{ns}: {c['packets']:,} packets, {c['dropped']:,} dropped, {c['retransmitted_segments']:,} TCP segments sent again, "
                                         f"{c['timeouts']:,} retransmission timeouts" for ns, c in shaper.items()), flush=True)  # fmt: skip

    settings = {"rate": args.rate, "changes": args.changes, "interleave": args.interleave,
                "exchange_share": args.exchange_share, "loopback": args.loopback, "target": args.target, "lr": args.lr, "eval_every": args.eval_every,
                "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum, "repeats": args.repeats,
                "seeds": seeds,
                "procs_per_node": args.procs_per_node, "max_epochs": args.max_epochs, "arena": args.arena,
                "batch": args.batch, "max_steps": args.max_steps, "budget": args.budget, "layers": args.layers, "width": args.width, "python": sys.version.split()[0],
                "torchft": torchft_version}  # fmt: skip
    verdict = report(settings, runs)
    print(f"total wall time {time.monotonic() - started:.0f} s")
    write_results(args.out, {**settings, "link": measured, "shaper": shaper, **verdict, "runs": runs})


def _or_dash(value: float | int | None) -> float | int | str:
    return "-" if value is None else value


def _fmt(value: float | int | None) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
