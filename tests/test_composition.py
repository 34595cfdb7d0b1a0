"""Every pair of the communication and topology options either trains or is refused by
config.CONFLICTS (issues 21 and 36). For each pair that builds, two spawned workers train a few
rounds; each saves its state at the epoch's end (from a validation step, which every worker
runs on the landed average), and the replicas must agree bitwise and have trained. A pipeline
cannot run that step (no stage holds the whole model): its pairs must end as the unsplit workers
with the other option do, to float rounding, both dealing batch i to worker i mod 2. A pair that does not build must be refused with a
row of the table's message.

`hierarchy("node")` needs torchrun with several processes per node; its pairs run in
test_hierarchy_composes_with_every_other_option below."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallelwrapper import ParallelWrapper
from parallelwrapper.config import CONFLICTS
from tiny import make_batches, mlp

pytestmark = pytest.mark.timeout(180)

OPTIONS: dict[str, Any] = {
    "overlap": lambda b: b.overlap_averaging(True),
    "outer": lambda b: b.outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
    "bfloat16": lambda b: b.payload_dtype(torch.bfloat16),
    "warmup": lambda b: b.warmup_sync_steps(2),
    "replace": lambda b: b.on_worker_failure("replace"),
    "fragments": lambda b: b.overlap_averaging(True).fragments(2),
    "encoding": lambda b: b.training_mode("shared-gradients").gradient_encoding(),
    "pipeline": lambda b: b.pipeline(stages=2),
}
PAIRS = list(itertools.combinations(OPTIONS, 2))


class SaveState:
    """A validation step that saves the model this worker holds, once per validation (not in
    the main process, which tries the step on a batch before training)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        if dist.is_initialized():
            torch.save(model.state_dict(), self.directory / f"{dist.get_rank()}.pt")
        return {"val_loss": float(nn.functional.cross_entropy(model(batch[0]), batch[1]))}


def builder(options: tuple[str, ...], saved: Path | None, dealt: bool = False) -> Any:
    b = ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9).workers(2).threads_per_worker(1).averaging_frequency(2)
    b = b.deterministic(dealt)
    if saved is not None:
        b = b.validation(make_batches(2), every=None, step=SaveState(saved))
    for option in options:
        b = OPTIONS[option](b)
    return b


def fit(options: tuple[str, ...], saved: Path | None, dealt: bool = False) -> dict[str, torch.Tensor]:
    """The model after one epoch with `options` (rounds of 4 batches and an uneven end); with
    `saved`, each worker's replica is there and must equal it; `dealt`, batch i to worker i mod 2."""
    start = {k: v.clone() for k, v in mlp().state_dict().items()}
    with builder(options, saved, dealt).build() as w:
        history = w.fit(make_batches(13), epochs=1)
        final = w.model.state_dict()
    assert history.epochs and all(s.score == s.score for s in history.scores)  # scores are not NaN
    assert any(not torch.equal(final[k], start[k]) for k in start), "nothing trained"
    if saved is not None:
        replicas = [torch.load(saved / f"{rank}.pt") for rank in (0, 1)]
        for key, value in final.items():
            assert torch.equal(replicas[0][key], replicas[1][key]), f"{key}: the replicas differ"
            assert torch.equal(replicas[0][key], value), f"{key}: the returned model is not the replicas'"
    return final


@pytest.mark.filterwarnings("ignore:4 processes")
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_every_pair_of_options_trains_and_ends_with_equal_replicas_or_is_refused_by_the_table(tmp_path: Path, pair: tuple[str, str]) -> None:
    try:
        builder(pair, None).build().close()
    except ValueError as e:
        assert any(str(e).startswith(c.message.split("{")[0]) for c in CONFLICTS), f"refused, but not by config.CONFLICTS: {e}"
        return
    if "pipeline" not in pair:
        fit(pair, tmp_path)
        return
    other = tuple(option for option in pair if option != "pipeline")
    unsplit = fit(other, tmp_path, dealt=True)  # as a pipeline deals its batches
    staged = fit(pair, None, dealt=True)
    worst = max(float((unsplit[k] - staged[k]).abs().max()) for k in unsplit)
    assert worst < 1e-5, f"{pair}: the stages end {worst:.2e} from the unsplit workers"


def test_hierarchy_composes_with_every_other_option(tmp_path: Path) -> None:
    """Two torchrun agents as two nodes of two processes: hierarchy("node") with each option in
    turn; all four ranks end bitwise equal, having trained every batch once."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from test_torchrun import two_agents
    from torchrun_composition import OPTIONS

    torch.manual_seed(0)  # as the script builds its model
    start = {k: v.clone() for k, v in nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3)).state_dict().items()}
    two_agents(Path(__file__).parent / "scripts" / "torchrun_composition.py", tmp_path, 2)
    for option in OPTIONS:
        ranks = [torch.load(tmp_path / f"{option}-rank{r}.pt") for r in range(4)]
        assert [r["iterations"] for r in ranks] == [22] * 4, option
        assert all(score == score for score in ranks[0]["scores"]), option
        for key, value in ranks[0]["model"].items():
            for r in range(1, 4):
                assert torch.equal(ranks[r]["model"][key], value), (option, key, r)
        assert any(not torch.equal(ranks[0]["model"][k], start[k]) for k in start), option
