"""A torchrun group that loses a rank: its peers name it within peer_timeout and exit, torchrun
restarts the group (--max-restarts), and the restarted group resumes from the last checkpoint and
ends bitwise equal to a run that never stopped. Real torchrun agents, on loopback and in two
network namespaces whose link is cut."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from benchmarks.slow_link import Link, check_privileges, slow_link
from parallelwrapper.config import Config
from parallelwrapper.env import TorchrunEnv
from parallelwrapper.hosts.heartbeat import Heartbeat
from parallelwrapper.hosts.torchrun import _join

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from test_torchrun import check, clean_env, free_port, torchrun
from tiny import make_batches, mlp
from torchrun_restart import PEER_TIMEOUT_S, builder

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_restart.py"
TIMEOUT_S = 90
pytestmark = pytest.mark.timeout(TIMEOUT_S + 30)
LOST = re.compile(r"parallelwrapper: rank (\d) lost rank (\d): ")


def tensors(model: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A model's tensors and its optimizer's momentum, by name."""
    return {**model, **{f"momentum{i}": s["momentum_buffer"] for i, s in optimizer["state"].items()}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same run with no fault, by two spawned workers (bitwise the torchrun run: the
    deterministic feed deals batch i to worker i mod 2, the torchrun shard)."""
    net = mlp()
    with builder(net, "none", tmp_path_factory.mktemp("reference")).workers(2).build() as wrapper:
        wrapper.fit(make_batches(40), epochs=2)
        return tensors(net.state_dict(), wrapper.optimizer.state_dict())


def test_a_restarted_group_joins_under_keys_of_its_own_and_agrees_to_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two incarnations of a group of two on one store, as torchrun's agent keeps it; the second
    finds the first's keys there, its rank 1 arrives first, and only rank 1's agent counted the
    restart. Both ranks take the second generation, and both resume."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    config = Config(checkpoint_dir=str(tmp_path))
    (tmp_path / "checkpoint.pt").write_bytes(b"")  # only its existence is asked here

    def incarnation(restarts: tuple[int, int]) -> list[tuple[str, bool]]:
        joined: list[tuple[str, bool]] = [("", False)] * 2

        def join(rank: int) -> None:
            _, prefix, resume = _join(config, TorchrunEnv(rank, 2, 0, 1, restarts[rank]))
            joined[rank] = (prefix, resume)

        threads = [threading.Thread(target=join, args=(rank,)) for rank in (1, 0)]
        for t in threads:
            t.start()
            time.sleep(0.2)  # rank 1 first, with the first incarnation's keys in the store
        for t in threads:
            t.join(timeout=30)
        return joined

    assert incarnation((0, 0)) == [("parallelwrapper/1", False)] * 2
    assert incarnation((0, 1)) == [("parallelwrapper/2", True)] * 2


def test_the_heartbeat_names_a_silent_peer_and_lets_a_leaving_one_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 0 and 1 of 3 beat, rank 2 never does; then rank 1 leaves. (The real `_lost` ends the process.)"""
    lost: list[tuple[int, tuple[int, ...], str]] = []
    monkeypatch.setattr(Heartbeat, "_lost", lambda self, ranks, why: lost.append((self._rank, tuple(ranks), why)))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    beats = [Heartbeat(lambda: TCPStore("127.0.0.1", store.port, is_master=False), f"127.0.0.1:{store.port}", "test", rank, 3, 1.0) for rank in (0, 1)]
    time.sleep(1.8)
    assert {(rank, ranks, why) for rank, ranks, why in lost} == {(0, (2,), "no heartbeat"), (1, (2,), "no heartbeat")}
    beats[1].close()
    lost.clear()
    time.sleep(1.8)
    beats[0].close()
    assert {ranks for _, ranks, _ in lost} == {(2,)}  # rank 1 left: never named


def assert_resumed_to(reference: dict[str, torch.Tensor], out: Path) -> None:
    """Both ranks end bitwise on the reference, and their last fit() resumed (fewer scores than rounds)."""
    for rank in (0, 1):
        saved = torch.load(out / f"rank{rank}.pt")
        for key, value in tensors(saved["model"], saved["optimizer"]).items():
            assert torch.equal(value, reference[key]), (rank, key)
        history = json.loads((out / f"history{rank}.json").read_text())
        assert history["scores"] < history["rounds"] == 20, history


def agent(args: Sequence[str], log: Path, env: dict[str, str], prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen([*prefix, *args], stdout=f, stderr=subprocess.STDOUT, env=env)


def finish(agents: Sequence[subprocess.Popen[bytes]], logs: Sequence[Path], timeout: float = TIMEOUT_S) -> None:
    for a, log in zip(agents, logs):
        a.wait(timeout=timeout)
        check(subprocess.CompletedProcess(a.args, a.returncode, log.read_text(), ""))


def test_a_killed_rank_is_restarted_and_the_run_resumes_to_the_uninterrupted_model(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    port = free_port()
    logs = [tmp_path / f"agent{n}.log" for n in (0, 1)]
    command = torchrun(
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--max-restarts", "1", str(SCRIPT), "kill", str(tmp_path),
    )  # fmt: skip
    agents = [agent(command, log, clean_env()) for log in logs]
    try:
        finish(agents, logs)
    finally:
        for a in agents:
            a.kill()
    killed = float((tmp_path / "killed").read_text())
    print(f"kill to training again: {float((tmp_path / 'first1.txt').read_text()) - killed:.1f} s")
    assert_resumed_to(reference, tmp_path)


def test_a_stopped_rank_is_named_by_its_peer_within_the_peer_timeout(tmp_path: Path) -> None:
    """SIGSTOP keeps rank 1's sockets open: gloo alone would wait out the collective timeout."""
    port = free_port()
    logs = [tmp_path / f"agent{n}.log" for n in (0, 1)]
    command = torchrun(
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        str(SCRIPT), "stop", str(tmp_path),
    )  # fmt: skip
    agents = [agent(command, log, clean_env()) for log in logs]
    stopped = tmp_path / "stopped"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not stopped.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        at = stopped.read_text().split()[1]
        lines: list[str] = []
        while not lines and time.monotonic() < deadline:
            lines = [line for log in logs for line in log.read_text().splitlines() if LOST.search(line)]
            time.sleep(0.05)
        elapsed = time.time() - float(at)
        print(f"SIGSTOP to the peer's line: {elapsed:.1f} s")
        assert lines and LOST.search(lines[0]).groups() == ("0", "1"), lines  # type: ignore[union-attr]
        assert "with --max-restarts N and .checkpoint(dir) it resumes" in lines[0]
        assert elapsed < PEER_TIMEOUT_S + 5
    finally:
        if stopped.exists():
            os.kill(int(stopped.read_text().split()[0]), signal.SIGKILL)
        for a in agents:
            a.kill()
            a.wait()


def test_the_machine_of_rank_0_lost_the_other_goes_on_alone_from_the_checkpoint(tmp_path: Path) -> None:
    """Rank 0's machine is lost at once (its torchrun agent and its process SIGKILLed), under a
    rendezvous whose store is a process of neither machine (this test's: a stand-in for etcd,
    docs/guides/many-machines.md). The other machine's agent forms the group anew with itself
    alone (--nnodes 1:2), and its worker resumes from the last checkpoint, written by two workers,
    and finishes the run."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    logs = [tmp_path / f"agent{n}.log" for n in (0, 1)]
    command = torchrun(
        "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
        "--rdzv-conf", "is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2", "--max-restarts", "1",
        str(SCRIPT), "machine", str(tmp_path),
    )  # fmt: skip
    agents = [agent(command, log, clean_env()) for log in logs]
    try:
        for a in agents:
            a.wait(timeout=TIMEOUT_S)
    finally:
        for a in agents:
            a.kill()
    killed = float((tmp_path / "killed").read_text())
    print(f"machine lost to training again: {float((tmp_path / 'first0.txt').read_text()) - killed:.1f} s")
    survivor = [log for a, log in zip(agents, logs) if a.returncode == 0]
    assert sorted(a.returncode for a in agents) == [-signal.SIGKILL, 0] and len(survivor) == 1, [log.read_text()[-2000:] for log in logs]
    assert "with 1 workers, where it was written with 2" in survivor[0].read_text()
    history = json.loads((tmp_path / "history0.json").read_text())
    assert history["workers"] == 1 and history["scores"] < history["rounds"], history  # resumed: fewer scores than its rounds
    saved = torch.load(tmp_path / "rank0.pt")
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


@pytest.fixture
def link() -> Iterator[Link]:
    why = check_privileges()
    if why:
        pytest.skip(f"two network namespaces are needed: {why}")
    with slow_link("1gbit") as made:
        yield made


def test_a_cut_link_ends_both_sides_and_the_restarted_group_resumes(tmp_path: Path, link: Link, reference: dict[str, torch.Tensor]) -> None:
    names, devices, addresses = link.names, link.devices, link.addresses
    port = free_port()
    logs = [tmp_path / f"agent{n}.log" for n in (0, 1)]
    agents = []
    for n in (0, 1):
        command = torchrun(
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addresses[0]}:{port}",
            "--local-addr", addresses[n], "--rdzv-conf", f"is_host={int(n == 0)}", "--max-restarts", "1",
            str(SCRIPT), "none", str(tmp_path),
        )  # fmt: skip
        # is_host: torchrun would look for the endpoint among the host name's addresses, not the namespace's.
        # Gloo would otherwise take the address of the host name, which the namespace lacks.
        env = {**clean_env(), "GLOO_SOCKET_IFNAME": devices[n]}
        agents.append(agent(command, logs[n], env, prefix=("ip", "netns", "exec", names[n])))
    try:
        checkpoint = tmp_path / "ckpt" / "checkpoint.pt"
        deadline = time.monotonic() + TIMEOUT_S
        while not checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        subprocess.run(["ip", "-n", names[0], "link", "set", devices[0], "down"], check=True)
        cut = time.monotonic()
        lost: dict[str, tuple[str, ...]] = {}
        while len(lost) < 2 and time.monotonic() - cut < 60:
            for log in logs:
                found = LOST.search(log.read_text())
                if found:
                    lost[log.name] = found.groups()
            time.sleep(0.1)
        print(f"link cut to both sides' lines: {time.monotonic() - cut:.1f} s")
        subprocess.run(["ip", "-n", names[0], "link", "set", devices[0], "up"], check=True)
        assert sorted(lost.values()) == [("0", "1"), ("1", "0")], lost  # each side names the other
        finish(agents, logs)
    finally:
        for a in agents:
            a.kill()
    assert_resumed_to(reference, tmp_path)
