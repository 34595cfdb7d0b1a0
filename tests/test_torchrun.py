"""The torchrun path: every process is one worker, reads its own shard, and runs the same round
protocol, fails with the same WorkerError and stops the same way as spawned workers. Real
`torchrun` launches: one node with two processes, and two agents as two nodes on loopback."""

from __future__ import annotations

import copy
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
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from parallelwrapper import ParallelWrapper
from torchrun_train import data, model, sparse_builder

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


def spawned_reference(sparse: bool = False) -> dict[str, torch.Tensor]:
    """The same training with spawned workers: the deterministic feed deals batch i to worker
    i mod 2, exactly the torchrun shard, so the results must be bitwise equal."""
    net = model()
    builder = (
        ParallelWrapper.builder(net).optimizer(torch.optim.Adam, lr=0.01).workers(2).averaging_frequency(2)
        .deterministic(True).seed(3).threads_per_worker(1)
    )
    if sparse:
        builder = sparse_builder(builder)
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


@pytest.mark.parametrize("feed", ["list", "loader"])
def test_one_node_two_processes(tmp_path: Path, feed: str) -> None:
    """A list of batches, or the same batches from a DataLoader (dealt by index, feed/epochs.py)."""
    result = subprocess.run(
        torchrun("--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(SCRIPT), str(tmp_path), *(["loader"] if feed == "loader" else [])),
        capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env(),
    )
    check(result)
    assert_ranks_equal_reference(tmp_path)


def test_the_sparse_payload_under_torchrun_equals_spawned_workers(tmp_path: Path) -> None:
    """Sparse rounds between two torchrun ranks: each rank decodes both ranks' entries in rank
    order, so the ranks end bitwise equal, and equal to the same run on spawned workers."""
    result = subprocess.run(
        torchrun("--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(SCRIPT), str(tmp_path), "sparse"),
        capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env(),
    )  # fmt: skip
    check(result)
    states = [torch.load(tmp_path / f"rank{r}.pt")["model"] for r in (0, 1)]
    for key, value in spawned_reference(sparse=True).items():
        assert torch.equal(states[0][key], states[1][key]) and torch.equal(states[0][key], value), key


UNEQUAL = Path(__file__).parent / "scripts" / "torchrun_unequal.py"


def test_ranks_of_unequal_speed_claim_batches_and_train_each_sample_once(tmp_path: Path) -> None:
    """Rank 1 three times slower: the ranks claim batches from torchrun's store (feed/claims.py), so
    the faster rank trains more of each round, and every sample is trained once an epoch."""
    result = subprocess.run(
        torchrun("--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(UNEQUAL), str(tmp_path)),
        capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env(),
    )
    check(result)
    taken = [[int(i) for i in (tmp_path / f"ids{rank}.txt").read_text().split()] for rank in (0, 1)]
    assert sorted(taken[0] + taken[1]) == sorted(list(range(41 * 8)) * 2)
    assert len(taken[0]) > 1.5 * len(taken[1]) > 0, [len(t) for t in taken]
    assert json.loads((tmp_path / "history.json").read_text()) == {"iterations": [41, 82]}


SAME_START = Path(__file__).parent / "scripts" / "torchrun_same_start.py"


def test_every_rank_starts_from_rank_0s_state(tmp_path: Path) -> None:
    """Ranks that draw their own unseeded models train as one: at lr 0, every rank's model after
    fit() is rank 0's initial model, bitwise."""
    result = subprocess.run(
        torchrun("--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(SAME_START), str(tmp_path)),
        capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env(),
    )  # fmt: skip
    check(result)
    initial = [torch.load(tmp_path / f"initial{r}.pt") for r in (0, 1)]
    assert not torch.equal(initial[0]["0.weight"], initial[1]["0.weight"])  # the ranks really drew apart
    for r in (0, 1):
        final = torch.load(tmp_path / f"final{r}.pt")
        assert final.keys() == initial[0].keys()
        for key, value in initial[0].items():
            assert torch.equal(final[key], value), (r, key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_agents(script: Path, out: Path, per_node: int) -> None:
    """Two torchrun agents as two nodes on loopback, `per_node` processes each; both must succeed."""
    port = free_port()
    agents = [
        subprocess.Popen(
            torchrun(
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(per_node),
                "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(out),
            ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
        )  # fmt: skip
        for node in (0, 1)
    ]
    try:
        for agent in agents:
            stdout, stderr = agent.communicate(timeout=TIMEOUT_S)
            check(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr))
    finally:
        for agent in agents:
            agent.kill()


def test_two_agents_as_two_nodes_on_loopback(tmp_path: Path) -> None:
    two_agents(SCRIPT, tmp_path, 1)
    assert_ranks_equal_reference(tmp_path)


# -- hierarchy: two nodes of two processes ----------------------------------------------------------

HIERARCHY = Path(__file__).parent / "scripts" / "torchrun_hierarchy.py"


def hierarchy_reference() -> dict[str, torch.Tensor]:
    """One process: each node's two ranks step together on their gradients' sample-weighted mean
    (batch i on rank i mod 4; ranks 2n and 2n + 1 are node n), k = 2 steps a round, then the two
    nodes average their parameters and momentum, weighted by their samples."""
    from torchrun_hierarchy import data as batches
    from torchrun_hierarchy import model as make

    shards = {r: [b for i, b in enumerate(batches()) if i % 4 == r] for r in range(4)}
    start = make()
    optimizer = torch.optim.SGD(start.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):  # epochs
        for step in range(0, 4, 2):  # rounds of k = 2 steps: 4 batches on each rank
            nodes = []
            for n in range(2):
                net = make()
                net.load_state_dict(start.state_dict())
                opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
                opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # each node its own momentum
                for s in range(step, step + 2):
                    opt.zero_grad()
                    pair = [shards[2 * n + j][s] for j in range(2)]
                    total = sum(len(y) for _, y in pair)
                    sum(nn.functional.cross_entropy(net(x), y) * len(y) for x, y in pair).div(total).backward()
                    opt.step()
                nodes.append((net, opt))
            with torch.no_grad():
                for p, *copies in zip(start.parameters(), *(net.parameters() for net, _ in nodes)):
                    p.copy_(sum(copies) / 2)
            states = [opt.state_dict()["state"] for _, opt in nodes]
            merged = optimizer.state_dict()
            merged["state"] = {i: {"momentum_buffer": (states[0][i]["momentum_buffer"] + states[1][i]["momentum_buffer"]) / 2} for i in states[0]}
            optimizer.load_state_dict(merged)
    out = {f"model.{k}": v for k, v in start.state_dict().items()}
    out.update({f"momentum.{i}": st["momentum_buffer"] for i, st in optimizer.state_dict()["state"].items()})
    return out


def test_hierarchy_two_nodes_of_two_processes_equals_a_one_process_reference(tmp_path: Path) -> None:
    two_agents(HIERARCHY, tmp_path, 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert [r["iterations"] for r in ranks] == [32] * 4  # 16 batches an epoch, each once
    states = [
        {**{f"model.{k}": v for k, v in r["model"].items()}, **{f"momentum.{i}": st["momentum_buffer"] for i, st in r["optimizer"]["state"].items()}}
        for r in ranks
    ]
    for key, value in hierarchy_reference().items():
        for r in range(1, 4):  # every rank of every node holds the same state, bitwise
            assert torch.equal(states[r][key], states[0][key]), (key, r)
        torch.testing.assert_close(states[0][key], value, rtol=1e-5, atol=1e-6, msg=key)  # reduction order differs


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
    assert "a peer rank's process is gone" in peer["first_line"] and "--max-restarts" in peer["first_line"]


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
