"""The torchrun path: every process is one worker, reads its own shard, and runs the same round
protocol, fails with the same WorkerError and stops the same way as spawned workers. Real
`torchrun` launches: one node with two processes, and two agents as two nodes on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
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


# -- faults under torchrun: the same WorkerError as spawned workers, the same stop ------------------

FAULTS = Path(__file__).parent / "scripts" / "torchrun_faults.py"


def standalone(*args: str) -> list[str]:
    return torchrun("--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(FAULTS), *args)


def test_a_failing_rank_raises_worker_error_and_leaves_every_model_untouched(tmp_path: Path) -> None:
    result = subprocess.run(standalone("fail", str(tmp_path)), capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env())
    check(result)  # each rank caught what fit() raised
    failed, peer = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 0))
    assert failed["type"] == "WorkerError" and failed["traceback"] and failed["untouched"]
    assert (failed["rank"], failed["epoch"], failed["batch"], failed["local_step"]) == (1, 0, 9, 4)
    assert failed["first_line"].startswith("worker 1 failed while training on batch 9 of epoch 0")
    assert "RuntimeError: boom on a marked batch" in failed["first_line"]
    # The peer lost its collective: its own WorkerError, one line of cause, its model untouched too.
    assert peer["type"] == "WorkerError" and peer["rank"] == 0 and peer["untouched"]


def test_sigterm_finishes_the_round_saves_it_and_the_run_resumes(tmp_path: Path) -> None:
    agent = subprocess.Popen(standalone("interrupt", str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        assert agent.stdout is not None
        for line in agent.stdout:
            if line.startswith("SCORE 3"):
                break
        start = time.monotonic()
        agent.send_signal(signal.SIGTERM)  # as a scheduler stops a job: torchrun passes it to every worker
        _, stderr = agent.communicate(timeout=60)
        assert time.monotonic() - start < 30  # before torchrun's own 30 s grace runs out
    finally:
        agent.kill()
    assert agent.returncode != 0, stderr
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)["counters"]
    assert saved["rounds"] >= 3 and saved["epoch"] == 0 and saved["position"] == saved["iterations"] < 400, saved
    resumed = subprocess.run(standalone("interrupt", str(tmp_path), "resume"), capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env())
    check(resumed)
    assert json.loads((tmp_path / "resumed.json").read_text()) == {"samples": 400 * 16}
