"""One process of benchmarks/fleet_soak.py's emulated machines: `torchrun ... fleet_soak_worker.py MODE STORE PROCESSES OUT EPOCHS [WIDTH [SCHEDULE [RESCALE [PAYLOAD]]]]`.

MODE fleet: a member of a fleet (`.fleet(STORE, processes=PROCESSES).on_worker_failure("replace")`),
under a torchrun of its own machine; RESCALE off: `.fleet(..., rescale=False)`, each round moved
to its average, however few processes are live. MODE restart: a rank of one torchrun job across the machines,
which its agents restart at every change of machines, resuming from the checkpoint in OUT/ckpt.
MODE torchft: machine $MACHINE's replica group of one process, at $ADDRESS, with torchft 0.2.0's
LocalSGD, meeting the others at the lighthouse $LIGHTHOUSE and going on with any one of them
(min_replica_size 1; a collective waits 5 s for a peer, as in torchft's LocalSGD example); a
replica that comes back heals from a peer. torchft has no shared claims: replica m trains batches
m, m + PROCESSES, ... of an endless round of the epoch, and each committed sync adds its replica's
samples to a counter in STORE (a TCPStore); every replica stops once it holds EPOCHS epochs of
samples, so that every design trains as many samples (torchft's not each exactly once).
All train the same MLP on MNIST (784-WIDTH-WIDTH-10, WIDTH 1024 unless given, batches of
benchmarks.common.BATCH, k = 16, SGD with Nesterov momentum, sent as PAYLOAD: float32 unless
given, torchft's always), EPOCHS epochs, at a learning rate of 0.05 throughout (SCHEDULE
constant, the default) or falling from it to 0 on a cosine by the epoch (SCHEDULE cosine: torch's CosineAnnealingLR over EPOCHS; torchft's replicas set it from the
epochs their committed samples hold, at each sync).
The first process to train writes the time to OUT/first.txt; a machine back after the fleet has
finished ends at once, writing nothing (FleetEnded); each process that finishes writes
OUT/result-{pid}.json: its History's epochs (none for torchft), its test loss and accuracy on the
10,000 test images, its loss on the 60,000 training images, and the time it finished.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import DEFAULT_DATA_DIR, mnist_batches
from parallelwrapper import FleetEnded, ParallelWrapper
from parallelwrapper.config import fleet_address
from parallelwrapper.evaluation import classification_metrics, metric_sums

K, LR, PEER_TIMEOUT_S, CHECKPOINT_EVERY = 16, 0.05, 3.0, 4


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class Step:
    """Cross-entropy; the first step of the run writes its time."""

    def __init__(self, out: Path) -> None:
        self.first = out / "first.txt"
        self.seen = False

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if not self.seen:
            self.seen = True
            if not self.first.exists():  # written whole, then linked in: the soak never reads a half-written one, and the first link wins
                mine = self.first.with_name(f"first-{os.getpid()}.txt")
                mine.write_text(repr(time.time()))
                with contextlib.suppress(FileExistsError):
                    os.link(mine, self.first)
                mine.unlink()
        return nn.functional.cross_entropy(model(batch[0]), batch[1])


def cosine(epoch: float, epochs: int) -> float:
    """SCHEDULE cosine's learning rate at `epoch` (CosineAnnealingLR's, T_max `epochs`, eta_min 0)."""
    return LR * (1 + math.cos(math.pi * epoch / epochs)) / 2


def main(mode: str, store: str, processes: int, out: Path, epochs: int, width: int = 1024, schedule: str = "constant", rescale: str = "on", payload: str = "float32") -> None:
    if mode == "torchft":
        return torchft(store, processes, out, epochs, width, schedule)
    net = mlp(width)
    builder = (
        ParallelWrapper.builder(net).optimizer(torch.optim.SGD, lr=LR, momentum=0.9, nesterov=True).averaging_frequency(K)
        .seed(0).threads_per_worker(1).peer_timeout(PEER_TIMEOUT_S).training_step(Step(out)).payload_dtype(payload)
    )  # fmt: skip
    if schedule == "cosine":
        builder = builder.lr_scheduler(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=epochs)
    if mode == "fleet":
        builder = builder.fleet(store, processes=processes, rescale=rescale == "on").on_worker_failure("replace")
    else:
        builder = builder.checkpoint(out / "ckpt", every=CHECKPOINT_EVERY)
    with builder.build() as wrapper:
        try:
            history = wrapper.fit(mnist_batches(DEFAULT_DATA_DIR), epochs=epochs)
        except FleetEnded as e:  # a machine back after the run: it ends as the others do, with nothing to report
            print(e, file=sys.stderr)
            return
    finish(out, net, epochs=[[e.epoch, e.iteration, e.samples] for e in history.epochs], replacements=len(history.replacements),
           restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), rounds=wrapper.rounds,
           lr=None if wrapper.lr_scheduler is None else wrapper.lr_scheduler.get_last_lr())  # fmt: skip


def torchft(store: str, processes: int, out: Path, epochs: int, width: int, schedule: str) -> None:
    """MODE torchft (the module's docstring): until the replicas' committed samples reach EPOCHS epochs."""
    from torch.distributed import TCPStore

    from benchmarks.torchft_lenet import OUTER, torchft_sync

    _, ((host, port),), name = fleet_address(store)
    counter, key, target = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60)), f"{name}/samples", epochs * 60_000
    machine, net, step = int(os.environ["MACHINE"]), mlp(width), Step(out)
    inner = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9, nesterov=True)
    batches = mnist_batches(DEFAULT_DATA_DIR)
    with torchft_sync("torchft-localsgd", net, inner, K, lighthouse=os.environ["LIGHTHOUSE"], replica_id=f"machine{machine}", replicas=processes,
                      outer=OUTER, host=os.environ["ADDRESS"], timeout=30.0, pg_timeout=5.0, min_replicas=1) as manager:  # fmt: skip
        steps, pending, synced = 0, 0, manager.current_step()
        while steps % K or int(counter.add(key, 0)) < target:
            x, y = batches[(machine + steps * processes) % len(batches)]
            inner.zero_grad()
            step(net, (x, y)).backward()
            inner.step()  # LocalSGD syncs in this step's hook every K steps
            steps, pending = steps + 1, pending + len(y)
            if steps % K == 0:
                if manager.current_step() != synced:  # committed (a heal moves the step too: its sync commits with it)
                    counter.add(key, pending)
                pending, synced = 0, manager.current_step()
                if schedule == "cosine":
                    for group in inner.param_groups:
                        group["lr"] = cosine(int(counter.add(key, 0)) // 60_000, epochs)
        rounds = manager.current_step()
    finish(out, net, epochs=[], replacements=0, restarts=0, rounds=rounds, samples=int(counter.add(key, 0)))


def finish(out: Path, net: nn.Module, **result: object) -> None:
    """OUT/result-{pid}.json: the end's time, `net`'s test loss and accuracy on the 10,000 test
    images, its loss on the 60,000 training images (how far it fitted what it trained on, apart
    from how it generalizes), and `result`."""
    metrics = functools.partial(classification_metrics, loss_fn=nn.functional.cross_entropy)  # as ParallelWrapper.evaluate scores
    test, n = metric_sums(net, mnist_batches(DEFAULT_DATA_DIR, "test", 1000), metrics, torch.device("cpu"))
    finished = time.time()  # the training set's loss below is not the run's time
    train, m = metric_sums(net, mnist_batches(DEFAULT_DATA_DIR, "train", 1000), metrics, torch.device("cpu"))
    (out / f"result-{os.getpid()}.json").write_text(json.dumps({"finished": finished, "test_loss": test["loss"] / n, "test_accuracy": test["accuracy"] / n, "train_loss": train["loss"] / m, **result}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]), *map(int, sys.argv[6:7]), *sys.argv[7:10])
