"""Pipelines inside workers (`.pipeline(...)`, issue 24): the split and its errors, the placement,
a fit's state cut into stages and joined again (fast tier); and with real processes over gloo,
parity with unsplit workers (spawned, and under two torchrun agents), the memory a stage's
process holds, and a stage that dies."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import torchrun_pipeline
from parallelwrapper import ParallelWrapper, TrainingMode, WorkerError
from parallelwrapper.app.models import LeNet
from parallelwrapper.checkpoint import FILENAME
from parallelwrapper.config import Config, Pipeline
from parallelwrapper.features import placement
from parallelwrapper.job import Job, OuterSpec
from parallelwrapper.pipeline import joined_state, stage_module
from parallelwrapper.pipeline.split import Names, boundaries, held, pieces_in, pieces_of, scorer, stage_state
from parallelwrapper.pipeline.stage import microbatches
from parallelwrapper.types import TrainingState
from parallelwrapper.wrapper import Builder
from test_torchrun import two_agents
from tiny import weights_and_outer_momenta


def eight_layers(width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(8)))


def lenet_batches(n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


@pytest.mark.fast
@pytest.mark.parametrize(("stages", "starts"), [(2, [0, 4]), (4, [0, 2, 4, 6]), (8, list(range(8)))])
def test_no_split_cuts_equal_parameter_counts(stages: int, starts: list[int]) -> None:
    assert boundaries(eight_layers(), stages, None) == starts


@pytest.mark.fast
def test_a_split_begins_stages_at_the_named_layers() -> None:
    model = LeNet()
    assert boundaries(model, 3, ("conv2", "fc2")) == [0, 2, 7]
    stage = stage_module(model, Pipeline(2), 1)
    assert list(stage.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # fc1 is most of LeNet: the nearest cut is before it


@pytest.mark.fast
def test_lenets_layers_are_its_forward() -> None:
    model, x = LeNet(), torch.randn(3, 1, 28, 28)
    cut = [stage_module(model, Pipeline(2, ("fc1",)), s) for s in range(2)]
    assert torch.equal(cut[1](cut[0](x)), model(x))


@pytest.mark.fast
def test_with_zbv_a_stage_holds_two_pieces_in_a_v() -> None:
    """Stage s of S holds pieces s and 2S - 1 - s: going down the stages and back up, the
    pieces are the model's forward, and the first stage holds the last piece (the loss)."""
    model, x = eight_layers(), torch.randn(3, 16)
    spec = Pipeline(2, schedule="zbv")
    assert (pieces_of(spec), held(spec, 0), held(spec, 1), scorer(spec)) == (4, (0, 3), (1, 2), 0)
    first, second = (stage_module(model, spec, s) for s in range(2))
    assert list(first.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "6.weight", "6.bias", "7.weight", "7.bias"]
    with pytest.raises(NotImplementedError):
        first(x)  # no forward of its own: the schedule runs each piece
    a, d = first.pieces()
    b, c = second.pieces()
    assert torch.equal(d(c(b(a(x)))), model(x))
    own = {id(p) for p in first.parameters()}
    assert {id(p) for piece in (a, d) for p in piece.parameters()} == own  # the pieces are the stage's own layers


class _Shortcut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x))


@pytest.mark.fast
@pytest.mark.parametrize(
    ("model", "stages", "split", "message"),
    [
        (eight_layers(), 2, ("9",), r"split names \['9'\], which are not layers of Sequential"),
        (eight_layers(), 3, ("4", "2"), "leaves stage 1 of 3 with no trained layer"),
        (eight_layers(), 3, ("4",), "split names the layers where stages 1..2 begin, 2 names, got 1"),
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 2, None, "leaves stage 1 of 2 with no trained layer"),
        (_Shortcut(), 2, None, "_Shortcut cannot be cut into stages"),
    ],
)
def test_a_split_that_does_not_fit_the_model_is_refused_at_build(model: nn.Module, stages: int, split: tuple[str, ...] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelWrapper.builder(model).pipeline(stages=stages, split=split).build()


@pytest.mark.fast
def test_options_a_pipeline_does_not_run_with_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"pipeline\(stages=2\) does not go with hierarchy"):
        ParallelWrapper.builder(LeNet()).pipeline(stages=2).hierarchy("node").build()
    with pytest.raises(ValueError, match=r"does not go with validation\(step=fn\): fn\(model, batch\) takes the whole model"):
        ParallelWrapper.builder(LeNet()).pipeline(stages=2).validation(lenet_batches(1), step=lambda model, batch: {}).build()
    with pytest.raises(ValueError, match=r"^pipeline: schedule must be one of \['1f1b', 'gpipe', 'zbv'\], got 'interleaved'"):
        Pipeline(2, schedule="interleaved")
    with pytest.raises(ValueError, match=r"split names the layers where pieces 1..3 begin, 3 names, got 1: \['4'\] \(with schedule='zbv' each of the 2 stages holds two pieces\)"):
        ParallelWrapper.builder(eight_layers()).pipeline(stages=2, split=("4",), schedule="zbv").build()


@pytest.mark.fast
def test_a_batch_is_cut_into_the_most_equal_microbatches_up_to_m() -> None:
    assert [microbatches(n, 4) for n in (8, 10, 3, 1, 113)] == [4, 2, 3, 1, 1]
    assert microbatches(12, 8) == 6 and microbatches(3, 2) == 1


@pytest.mark.fast
def test_stages_are_placed_worker_by_worker() -> None:
    spec = Pipeline(2)
    gpus = placement(Config(workers=2, pipeline=spec), gpus=4, cores=16)
    assert (gpus.devices, gpus.backend, gpus.processes) == (("cuda:0", "cuda:1", "cuda:2", "cuda:3"), "nccl", 4)
    assert str(gpus) == "2 workers x 2 stages on cuda:0..3 with nccl, 4 threads each"
    cpu = placement(Config(workers=1, pipeline=spec), gpus=0, cores=2)
    assert not cpu.in_process and str(cpu) == "1 worker x 2 stages on cpu with gloo, 1 thread each"
    shared = placement(Config(workers=2, pipeline=spec), gpus=0, cores=2)
    assert shared.notes == ("4 processes (2 workers x 2 stages) on 2 CPU cores: they take turns on the cores and every step waits for the slowest stage; use .workers(n) with n x 2 <= 2",)
    with pytest.raises(ValueError, match=r"devices names 2 devices for 4 processes \(2 workers x 2 stages\); give one device per stage"):
        placement(Config(workers=2, pipeline=spec, devices=("cpu", "cpu")), gpus=0, cores=2)
    # Stages that would share a GPU go over gloo, whose sends fail on GPU tensors (seen on an H200:
    # "writev: Bad address"): refused with what to do, as is a GPU stage beside a CPU one.
    for workers, gpus_here, devices in ((1, 1, None), (2, 2, None), (1, 2, ("cuda:0", "cpu"))):
        with pytest.raises(ValueError, match=r"^pipeline\(stages=2\): stages on cuda:0, .* would pass activations over gloo, .*give each stage a GPU of its own .*\.devices\(\['cpu', 'cpu'"):
            placement(Config(workers=workers, pipeline=spec, devices=devices), gpus=gpus_here, cores=16)


def _trained(model: nn.Module) -> TrainingState:
    """The model's state after a step of Adam, and of an outer SGD with momentum (outer.OuterStep
    numbers its state by the trained parameters, in the model's order)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    outer = torch.optim.SGD([p.detach().clone().requires_grad_() for p in model.parameters()], lr=0.7, momentum=0.9)
    for p in outer.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    outer.step()
    return TrainingState(model.state_dict(), optimizer.state_dict(), None, outer.state_dict())


@pytest.mark.fast
def test_a_state_cut_into_stages_joins_back_whole() -> None:
    model = eight_layers()
    whole = _trained(model)
    job = Job(model, torch.optim.Adam, {"lr": 0.1}, None, None, outer_optimizer=OuterSpec(torch.optim.SGD, {"lr": 0.7, "momentum": 0.9}))
    names = Names.of(model, job.make_optimizer(model))
    parts = []
    for s in range(2):
        stage = stage_module(model, Pipeline(2), s)
        parts.append(stage_state(whole, names, stage, job.make_optimizer(stage)))
        assert len(parts[s].optimizer["state"]) == len(parts[s].outer_optimizer["state"]) == 8  # four layers' weights and biases
    joined = joined_state(parts, job, Pipeline(2))
    assert joined.model.keys() == whole.model.keys()
    for mine, theirs, keys in ((joined.optimizer, whole.optimizer, ("exp_avg", "exp_avg_sq")), (joined.outer_optimizer, whole.outer_optimizer, ("momentum_buffer",))):
        assert mine["param_groups"] == theirs["param_groups"]
        for i, state in theirs["state"].items():
            assert all(torch.equal(state[k], mine["state"][i][k]) for k in keys)


@pytest.mark.fast
def test_each_stage_holds_its_share_of_parameters_and_optimizer_state() -> None:
    """What a stage's process keeps (its layers, its Adam state after a step) is 1/S of the
    whole's, within 10%."""
    model = eight_layers(64)

    def held(module: nn.Module, *pieces: nn.Module) -> int:
        optimizer = torch.optim.Adam(module.parameters())
        sum(piece(torch.randn(2, 64)).sum() for piece in pieces or [module]).backward()
        optimizer.step()
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *state])

    whole = held(model)
    for stages, schedule in ((2, "1f1b"), (4, "1f1b"), (2, "zbv"), (4, "zbv")):
        for s in range(stages):
            stage = stage_module(model, Pipeline(stages, schedule=schedule), s)
            assert abs(held(stage, *pieces_in(stage)) / (whole / stages) - 1) < 0.1


def _lenet_fit(microbatches: int | None, fits: int = 1, options: Callable[[Builder], Builder] = lambda b: b, schedule: str = "1f1b") -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """LeNet trained by 2 workers, unsplit (None) or of 2 stages, as tests/scripts/torchrun_pipeline.py
    does (validated after every round), with `options`, in `fits` calls of fit(): the final state
    and the validations' metrics."""
    torch.manual_seed(0)
    model = LeNet()
    builder = options(torchrun_pipeline.builder(model).workers(2))
    if microbatches is not None:
        builder = builder.pipeline(stages=2, microbatches=microbatches, schedule=schedule)
    with builder.build() as wrapper:
        histories = [wrapper.fit(torchrun_pipeline.data(), epochs=1) for _ in range(fits)]
    return model.state_dict(), [v.metrics for history in histories for v in history.validations]


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.filterwarnings("ignore:4 processes")
@pytest.mark.timeout(90)
def test_two_workers_of_two_stages_train_lenet_as_two_unsplit_workers() -> None:
    """Parity (issue 24): with M microbatches a step is gradient accumulation over them, so the
    weights match to float rounding. M = 1 runs GPipe (1F1B with fewer microbatches than
    stages is GPipe), M = 4 runs 1F1B, and zero bubble's V (LeNet's four layers a piece each,
    the first stage computing the loss). Validation runs forward through the stages and scores
    as the unsplit workers do."""
    reference, validations = _lenet_fit(None)
    assert len(validations) == 2 and validations[0].keys() == {"val_loss", "val_accuracy"}
    for m, schedule in ((1, "1f1b"), (4, "1f1b"), (4, "zbv")):
        state, scored = _lenet_fit(m, schedule=schedule)
        assert _worst(reference, state) < 1e-5, (m, schedule)
        for mine, theirs in zip(scored, validations, strict=True):  # the stages score as one model does
            assert mine == pytest.approx(theirs, abs=1e-5), (m, schedule)


@pytest.mark.filterwarnings("ignore:4 processes")
@pytest.mark.timeout(90)
def test_overlap_an_outer_optimizer_and_clipping_per_stage_train_as_unsplit_workers() -> None:
    """Each stage's round lands during the next (Streaming DiLoCo's outer step), its outer
    optimizer steps its own parameters, and its gradients are clipped by the whole model's norm
    (0.5: every step clips): the stages end as the unsplit workers do, over two fit() calls (the
    outer optimizer's state is cut into stages and joined back in between), by 1F1B and by zero
    bubble's V (whose stages hold two pieces each)."""

    def streaming(b: Builder) -> Builder:
        return b.overlap_averaging(True).outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True).gradient_clipping(0.5)

    reference, validations = _lenet_fit(None, fits=2, options=streaming)
    for schedule in ("1f1b", "zbv"):
        state, scored = _lenet_fit(4, fits=2, options=streaming, schedule=schedule)
        assert _worst(reference, state) < 1e-5, schedule
        assert len(scored) == len(validations) >= 2  # an epoch end's, in each fit
        for mine, theirs in zip(scored, validations):
            assert mine == pytest.approx(theirs, abs=1e-5), schedule


@pytest.mark.filterwarnings("ignore:4 processes")
@pytest.mark.timeout(90)
def test_the_autopilot_steers_the_stages_of_a_pipeline_alike(tmp_path: Path) -> None:
    """auto with 2 stages: each stage's group rounds its own part (its own bytes, its own link),
    and every stage decides from the measures of all, summed over the worker's stages too: the
    checkpoint holds each process's autopilot, and all four made the same changes. (Each from its
    own stage's sums, they part: the stages' sizes and exchanges differ.) A validation after
    every round crosses the stages, as a checkpoint does."""
    torch.manual_seed(0)
    builder = torchrun_pipeline.builder(LeNet()).workers(2).deterministic(False).pipeline(stages=2).checkpoint(tmp_path)
    with builder.averaging_frequency("auto", k_min=1, k_max=4).build() as wrapper:
        history = wrapper.fit(torchrun_pipeline.data() * 4, epochs=1)
    assert history.scores[-1].iteration == 24 and history.scores[0].why and history.validations  # 12 steps a worker
    pilots = [own["autopilot"] for own in torch.load(tmp_path / FILENAME, weights_only=True)["rng"]]
    assert len(pilots) == 4 and all(p["changes"] == pilots[0]["changes"] and p["choice"] == pilots[0]["choice"] for p in pilots)


@pytest.mark.filterwarnings("ignore:4 processes")
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("microbatches", "options"),
    [
        (4, lambda b: b.training_mode(TrainingMode.SHARED_GRADIENTS).optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)),
        (1, lambda b: b.precision("bf16-mixed")),
    ],
    ids=["shared-gradients", "bf16-mixed"],
)
def test_shared_gradients_and_mixed_precision_per_stage_train_as_unsplit_workers(microbatches: int, options: Callable[[Builder], Builder]) -> None:
    """Stage s of every worker averages its gradients every step; and each stage runs its
    forward (the activations it sends too) under bfloat16 autocast, validation included. With
    microbatches, bfloat16 rounds otherwise than on whole batches, so that case runs M = 1;
    shared gradients run at lr 0.01, since at 0.05 this model's training is chaotic and float
    rounding grows, split or not."""
    reference, validations = _lenet_fit(None, options=options)
    state, scored = _lenet_fit(microbatches, options=options)
    assert _worst(reference, state) < 1e-5
    assert len(scored) == len(validations) >= 1
    for mine, theirs in zip(scored, validations):
        assert mine == pytest.approx(theirs, abs=1e-5)


@pytest.mark.timeout(150)
def test_under_torchrun_two_nodes_of_one_pipeline_each_train_as_two_unsplit_workers(tmp_path: Path) -> None:
    """Two torchrun agents as two nodes on loopback, two processes each: worker w's two stages
    are ranks 2w and 2w + 1, on node w. Every rank ends with the whole model, the unsplit one, and
reports the unsplit workers' validations."""
    two_agents(Path(torchrun_pipeline.__file__), tmp_path, 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert {r["placement"].split(" on ")[0] for r in ranks} == {"2 workers x 2 stages under torchrun, 2"}
    assert {r["world_size"] for r in ranks} == {2}
    reference, validations = _lenet_fit(None)
    for r in ranks:
        assert _worst(reference, r["model"]) < 1e-5
        for mine, theirs in zip(r["validations"], validations, strict=True):
            assert mine == pytest.approx(theirs, abs=1e-5)


class _DiesOnProcess(nn.Module):
    """Kills its process (as the OOM killer would), in the process of global rank `rank` only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return x


@pytest.mark.filterwarnings("ignore:4 processes")
@pytest.mark.timeout(60)
def test_a_stage_that_dies_names_its_worker_and_stage() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), nn.Linear(8, 3), _DiesOnProcess(3))  # worker 1's stage 1
    batches = [(torch.randn(4, 10), torch.randint(0, 3, (4,))) for _ in range(4)]
    with ParallelWrapper.builder(model).workers(2).pipeline(stages=2).stall_timeout(30).build() as wrapper:
        start = time.monotonic()
        with pytest.raises(WorkerError, match="^worker 1 stage 1 failed.*killed by SIGKILL"):
            wrapper.fit(batches)
        assert time.monotonic() - start < 15


WIDTH = 24  # the layers' weights are (WIDTH, WIDTH): no other tensor of a stage's has that shape


class _CountsHeld(nn.Module):
    """At its third forward (Adam has stepped twice), writes how many (WIDTH, WIDTH) tensors its
    process holds (distinct memory), to a file named for the process's global rank in `folder`."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder, self.calls = folder, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            gc.collect()
            # By address: the averaging's flat buffers hold the parameters and the optimizer's
            # state, and more than one view of a tensor may be alive.
            held = len({o.data_ptr() for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.shape == (WIDTH, WIDTH)})
            Path(self.folder, str(dist.get_rank())).write_text(str(held))
        return x


@pytest.mark.filterwarnings("ignore:2 processes")
@pytest.mark.timeout(60)
def test_a_stage_process_holds_its_layers_and_their_optimizer_state_only(tmp_path: Path) -> None:
    """Memory (issue 24): each stage's process holds its 4 weights and their 2 Adam moments, 12
    tensors of the weights' shape: half the whole's 24, and no copy of the model it unpickled
    nor of the state its fit started from."""
    torch.manual_seed(0)
    half = [nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    model = nn.Sequential(_CountsHeld(str(tmp_path)), *half, _CountsHeld(str(tmp_path)), *(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    batches = [(torch.randn(8, WIDTH), torch.randint(0, WIDTH, (8,))) for _ in range(4)]
    with ParallelWrapper.builder(model).workers(1).optimizer(torch.optim.Adam, lr=0.01).pipeline(stages=2, split=["5"]).build() as wrapper:
        wrapper.fit(batches)
    assert {p.name: int(p.read_text()) for p in tmp_path.iterdir()} == {"0": 12, "1": 12}


def _dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.filterwarnings("ignore:4 processes")
@pytest.mark.timeout(120)
def test_a_pipeline_checkpoints_the_whole_state_and_resumes_bitwise(tmp_path: Path) -> None:
    """2 workers x 2 stages with dropout in both stages and an outer optimizer: the checkpoint
    holds the whole model's state and every stage process's RNG, and a run resumed from it ends
    bitwise where an uninterrupted one does."""

    def builder(directory: Path) -> Builder:
        return (
            ParallelWrapper.builder(_dropout_mlp()).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9).workers(2)
            .threads_per_worker(1).averaging_frequency(2).deterministic(True).checkpoint(directory, every=100)
            .outer_optimizer(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True).pipeline(stages=2, microbatches=2)
        )  # fmt: skip

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(6)]
    with builder(tmp_path / "a").build() as w:
        w.fit(data, epochs=3)
        straight = weights_and_outer_momenta(w)
        assert len(straight) == 12  # 6 parameters, 6 momentum buffers of the outer step
    with builder(tmp_path / "b").build() as w:
        w.fit(data, epochs=2)
    saved = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert saved["model"].keys() == _dropout_mlp().state_dict().keys() and len(saved["rng"]) == 4  # by process
    assert len(saved["optimizer"]["state"]) == len(saved["outer_optimizer"]["state"]) == 6
    with builder(tmp_path / "b").build() as w:
        w.fit(data, epochs=3, resume=tmp_path / "b")
        assert all(torch.equal(a, b) for a, b in zip(straight, weights_and_outer_momenta(w), strict=True))
