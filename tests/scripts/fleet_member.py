"""One process of a fleet, for tests/test_fleet.py: `MACHINE=m fleet_member.py STORE PROCESSES OUT_DIR [LOSE]`,
launched by a torchrun of its own on each emulated machine m; with COME_AFTER=PATH, it enters the
fleet once that file exists (a machine that comes later). One that comes after the fleet has
finished ends at once, saving nothing, as a machine's script should (FleetEnded).

Every member trains the same small model on one list of batches, which they claim first-come,
with a short sleep in every step so that a machine is lost mid-run. With LOSE = r, the process of
rank r in the fleet's group SIGKILLs its torchrun agent and then itself at its 8th step, once:
its machine lost at once; with STOP=1 as well, it SIGSTOPs itself instead, closing nothing (a hung
host), and its agent waits on it; with CUT=1, it writes its machine's number to OUT_DIR/cut.txt and
trains on, for tests/scripts/fleet_cut.py to cut its machine's link; with GROWS=1, it writes
OUT_DIR/begun.txt there instead (a newcomer's COME_AFTER), and loses its machine as the group
starts to take the newcomer in, before it has written anything of the group to come (with SENDS=1
as well: once that group has formed, as it starts to send its state).
Each process that finishes saves its model to OUT_DIR/model{m}.pt, and its History, its pid, its
agent's restart count and the steps it took to OUT_DIR/history{m}.json; each writes its pid to
OUT_DIR/pid{m}.txt when it starts. It runs with the features a fleet composes with: the autopilot
(k from 1 to 4; with K=k, that k instead), an outer optimizer (DiLoCo's Nesterov SGD), a per-step
OneCycleLR sized for the run as the fleet planned (which raises if stepped past its end) and a
checkpoint in OUT_DIR/ckpt every 2 rounds; with PAYLOAD=p, that payload_dtype.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallelwrapper import FleetEnded, ParallelWrapper
from parallelwrapper.replacement.fleet import Survivor

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny import make_batches, mlp, write_whole

BATCHES, EPOCHS, LOSS_STEP = 48, 2, 8
MACHINE = int(os.environ.get("MACHINE", "-1"))  # -1: imported by the test


class Step:
    """The training step: a short sleep, and member `lose`'s machine lost at its LOSS_STEP-th step."""

    def __init__(self, lose: int | None, out: Path) -> None:
        self.lose, self.out, self.steps = lose, out, 0

    def __call__(self, net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.steps += 1
        if self.steps == LOSS_STEP and dist.get_rank() == self.lose and os.environ.get("CUT") and not (self.out / "cut.txt").exists():
            write_whole(self.out / "cut.txt", str(MACHINE))  # fleet_cut reads it as its name appears
        elif self.steps == LOSS_STEP and dist.get_rank() == self.lose and os.environ.get("GROWS"):
            (self.out / "begun.txt").write_text("")
        elif self.steps == LOSS_STEP and dist.get_rank() == self.lose and not os.environ.get("CUT") and not (self.out / "lost.txt").exists():
            self.lost()
        time.sleep(0.02)
        return nn.functional.cross_entropy(net(batch[0]), batch[1])

    def lost(self) -> None:
        """This machine lost: its process stopped (STOP) or killed with its agent."""
        (self.out / "lost.txt").write_text(repr(time.time()))
        if os.environ.get("STOP"):
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: torchrun starts a script's worker as its child
            os.kill(os.getpid(), signal.SIGKILL)

    def lost_before(self, method: str, also: Callable[[Survivor], bool] = lambda survivor: True) -> None:
        """The machine of rank `lose` lost, once, as it enters Survivor.`method` (where `also`)."""
        original = getattr(Survivor, method)

        def lost_first(survivor: Survivor, *args: Any) -> Any:
            if survivor.rank == self.lose and also(survivor) and not (self.out / "lost.txt").exists():
                self.lost()
            return original(survivor, *args)

        setattr(Survivor, method, lost_first)


def main(store: str, processes: int, out: Path, lose: int | None) -> None:
    net, step = mlp(), Step(lose, out)
    if os.environ.get("GROWS") and os.environ.get("SENDS"):  # the group that took the newcomer in, as it starts to send its state
        step.lost_before("receive", lambda survivor: survivor.generation >= 1 and not survivor.newcomer)
    elif os.environ.get("GROWS"):  # the group as it first starts to take a newcomer in
        step.lost_before("grow")
    builder = (
        ParallelWrapper.builder(net).optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        .averaging_frequency(int(os.environ["K"]) if "K" in os.environ else "auto", k_min=1, k_max=4)
        .outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True).checkpoint(out / "ckpt", every=2).seed(3).threads_per_worker(1)
        .fleet(store, processes=processes).on_worker_failure("replace").peer_timeout(2.0)
        .training_step(step)
    )  # fmt: skip
    if "PAYLOAD" in os.environ:
        builder.payload_dtype(os.environ["PAYLOAD"])
    builder.lr_scheduler(torch.optim.lr_scheduler.OneCycleLR, interval="step", max_lr=0.1, total_steps=EPOCHS * builder.steps_per_epoch(BATCHES))
    (out / f"pid{MACHINE}.txt").write_text(str(os.getpid()))
    with builder.build() as wrapper:  # which makes the optimizer once, and so imports torch._dynamo (some 2 s)
        while "COME_AFTER" in os.environ and not Path(os.environ["COME_AFTER"]).exists():  # a machine that comes later, its imports done
            time.sleep(0.01)
        try:
            history = wrapper.fit(make_batches(BATCHES), epochs=EPOCHS)
        except FleetEnded as e:  # it came after the run: nothing to save
            print(e, file=sys.stderr)
            return
    torch.save(net.state_dict(), out / f"model{MACHINE}.pt")
    (out / f"history{MACHINE}.json").write_text(json.dumps({
        "pid": os.getpid(), "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "steps": step.steps,
        "epochs": [[e.epoch, e.iteration, e.samples] for e in history.epochs],
        "replacements": [[r.rank, r.lost_round] for r in history.replacements],
    }))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
