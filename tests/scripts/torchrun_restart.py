"""A torchrun run that loses a rank, for tests/test_torchrun_restart.py:
`torchrun ... torchrun_restart.py MODE OUT_DIR`.

Deterministic SGD with momentum on a small model, checkpoints in OUT_DIR/ckpt every 2 rounds,
a short sleep in every step so a fault lands mid-run. Each rank that finishes saves its model and
optimizer to OUT_DIR/rank{r}.pt and what its fit() trained to OUT_DIR/history{r}.json.

kill: rank 1 SIGKILLs itself at its 12th step, once (OUT_DIR/killed marks it and holds the time);
      a restarted group resumes from the checkpoint.
stop: rank 1 SIGSTOPs itself at its 12th step (its sockets stay open), after writing its pid and
      the time to OUT_DIR/stopped; .peer_timeout(3).
machine: rank 0 SIGKILLs its torchrun agent and then itself at its 12th step, once (OUT_DIR/killed):
      its machine lost at once; the other agent forms the group anew without it (--nnodes 1:2).
none: no fault; with --max-restarts a cut link restarts it.
Every rank writes the time of its first step to OUT_DIR/first{r}.txt (each incarnation overwrites).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from parallelwrapper import ParallelWrapper
from parallelwrapper.wrapper import Builder

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny import make_batches, mlp, write_whole

FAULT_STEP = 12
PEER_TIMEOUT_S = 3.0


def builder(net: nn.Module, mode: str, out: Path) -> Builder:
    return (
        ParallelWrapper.builder(net).optimizer(torch.optim.SGD, lr=0.1, momentum=0.9).averaging_frequency(2)
        .deterministic(True).seed(3).threads_per_worker(1).checkpoint(out / "ckpt", every=2)
        .peer_timeout(PEER_TIMEOUT_S).training_step(Step(mode, out))
    )  # fmt: skip


class Step:
    """The training step, with the fault of MODE on rank 1 at its FAULT_STEP-th step."""

    def __init__(self, mode: str, out: Path) -> None:
        self.mode, self.out, self.steps = mode, out, 0

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", "-1"))  # -1: spawned workers of the tests' reference

    def __call__(self, net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.steps += 1
        if self.steps == 1:
            (self.out / f"first{self.rank}.txt").write_text(repr(time.time()))
        if self.mode == "machine" and self.rank == 0 and self.steps == FAULT_STEP and not (self.out / "killed").exists():
            (self.out / "killed").write_text(repr(time.time()))
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: torchrun starts a script's worker as its child
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 1 and self.steps == FAULT_STEP:
            if self.mode == "kill" and not (self.out / "killed").exists():
                (self.out / "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "stop":
                write_whole(self.out / "stopped", f"{os.getpid()} {time.time()!r}")  # the test reads it as its name appears
                os.kill(os.getpid(), signal.SIGSTOP)
        # Slow until the fault: then the test has time to strike mid-run. The machine's loss comes at a
        # step, not a time, and a restarted group has nothing left to wait for.
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        time.sleep(0.01 if self.mode == "machine" or restarted else 0.05)
        return nn.functional.cross_entropy(net(batch[0]), batch[1])


def main(mode: str, out: Path) -> None:
    net = mlp()
    rank = int(os.environ["RANK"])
    with builder(net, mode, out).build() as wrapper:
        history = wrapper.fit(make_batches(40), epochs=2)
        torch.save({"model": net.state_dict(), "optimizer": wrapper.optimizer.state_dict()}, out / f"rank{rank}.pt")
        (out / f"history{rank}.json").write_text(json.dumps({"scores": len(history.scores), "rounds": wrapper.rounds, "workers": wrapper.world_size}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
