"""Faults under torchrun, for tests/test_torchrun.py: `torchrun ... torchrun_faults.py MODE OUT_DIR`.

fail:      rank 1's training step raises on batch 9; each rank writes what fit() raised and
           whether its model kept its state to OUT_DIR/rank{r}.json.
interrupt: slow training with checkpoints in OUT_DIR/ckpt; rank 0 prints "SCORE n" after each
           averaging, so the test can send SIGTERM mid-fit. With a third argument "resume" it
           resumes from the checkpoint and writes OUT_DIR/resumed.json instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelwrapper import ParallelWrapper, Score, WorkerError

BAD = 9  # rank 1 trains batch 9 as its 5th (local step 4): dealt (deterministic), batch i on rank i mod 2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def failing_step(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    if float(x[0, 0]) == 99.0:
        raise RuntimeError("boom on a marked batch")
    return nn.functional.cross_entropy(net(x), y)


STEP_S = [0.03]  # a step's sleep: slow enough to be stopped mid-fit; none in the resumed run


def slow_step(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    time.sleep(STEP_S[0])
    return nn.functional.cross_entropy(net(batch[0]), batch[1])


def announce(score: Score) -> None:
    print(f"SCORE {score.round}", flush=True)


def fail(out: Path) -> None:
    rank = int(os.environ["RANK"])
    batches = data(20)
    batches[BAD][0][0, 0] = 99.0
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    # Dealt, so that batch 9 is rank 1's (first-come claims would give it to whichever rank came first).
    builder = ParallelWrapper.builder(net).training_step(failing_step).averaging_frequency(2).threads_per_worker(1).deterministic(True)
    record: dict[str, Any] = {}
    with builder.build() as wrapper:
        try:
            wrapper.fit(batches)
        except Exception as e:  # noqa: BLE001 - the test checks which type it is
            fields = ("rank", "epoch", "batch", "local_step")
            record = {"type": type(e).__name__, "first_line": str(e).splitlines()[0], "traceback": "Traceback" in str(e)}
            record.update({f: getattr(e, f, None) for f in fields} if isinstance(e, WorkerError) else {})
    record["untouched"] = all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def interrupt(out: Path, resume: bool) -> None:
    STEP_S[0] = 0.0 if resume else STEP_S[0]
    builder = (
        ParallelWrapper.builder(model()).training_step(slow_step).threads_per_worker(1)
        .checkpoint(out / "ckpt", every=10_000).listeners(announce)
    )  # fmt: skip
    with builder.build() as wrapper:
        history = wrapper.fit(data(400), epochs=1, resume=out / "ckpt" if resume else None)
        if resume and wrapper.is_main:
            (out / "resumed.json").write_text(json.dumps({"samples": history.epochs[-1].samples}))


if __name__ == "__main__":
    mode, directory = sys.argv[1], Path(sys.argv[2])
    if mode == "fail":
        fail(directory)
    else:
        interrupt(directory, resume=sys.argv[3:] == ["resume"])
