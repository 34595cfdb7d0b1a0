"""The torchrun path: every process is one worker, reads its own shard, and runs the same round
protocol. Real `torchrun` launches: one node with two processes, and two agents as two nodes
on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from torchrun_train import data, model  # noqa: E402

from parallelwrapper import ParallelWrapper  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_train.py"
TIMEOUT_S = 120
pytestmark = pytest.mark.timeout(TIMEOUT_S + 30)


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def check(result: subprocess.CompletedProcess[str] | Any) -> None:
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"


def spawned_reference() -> dict[str, torch.Tensor]:
    """The same training with spawned workers: the deterministic feed deals batch i to worker
    i mod 2, exactly the torchrun shard, so the results must be bitwise equal."""
    net = model()
    builder = (
        ParallelWrapper.builder(net).optimizer(torch.optim.Adam, lr=0.01).workers(2).averaging_frequency(2)
        .deterministic(True).seed(3).threads_per_worker(1)
    )
    with builder.build() as w:
        w.fit(data(), epochs=2)
    return net.state_dict()


def assert_ranks_equal_reference(out: Path) -> None:
    states = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    reference = spawned_reference()
    for key, value in reference.items():
        assert torch.equal(states[0]["model"][key], states[1]["model"][key]), key
        assert torch.equal(states[0]["model"][key], value), key
    for i, st in states[0]["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, states[1]["optimizer"]["state"][i][k])
    samples = sum(len(y) for _, y in data())
    history = (out / "history.json").read_text()
    assert f'"samples": [{samples}, {2 * samples}]' in history


def test_one_node_two_processes(tmp_path: Path) -> None:
    result = subprocess.run(
        torchrun("--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(SCRIPT), str(tmp_path)),
        capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env(),
    )
    check(result)
    assert_ranks_equal_reference(tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_agents_as_two_nodes_on_loopback(tmp_path: Path) -> None:
    port = free_port()
    agents = [
        subprocess.Popen(
            torchrun(
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT), str(tmp_path),
            ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
        )
        for node in (0, 1)
    ]
    try:
        for agent in agents:
            stdout, stderr = agent.communicate(timeout=TIMEOUT_S)
            check(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr))
    finally:
        for agent in agents:
            agent.kill()
    assert_ranks_equal_reference(tmp_path)
