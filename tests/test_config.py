"""The builder and the config: documented defaults, and every bad value refused at build() with a
ValueError that names the option and the fix. Nothing here spawns a process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelwrapper import Config, NanPolicy, ParallelWrapper, TrainingMode
from parallelwrapper.env import resolve

pytestmark = pytest.mark.fast


def model() -> nn.Module:
    return nn.Linear(4, 2)


def test_defaults_are_documented_values() -> None:
    c = Config()
    assert (c.workers, c.prefetch_buffer, c.averaging_frequency) == (2, 24, 1)
    assert c.report_score_after_averaging and c.average_updaters and not c.deterministic
    assert not c.overlap_averaging
    assert c.training_mode is TrainingMode.AVERAGING and c.nan_policy is NanPolicy.RAISE
    assert c.seed == 0 and c.devices is None and c.backend == "auto"
    placement = resolve(c)  # what the defaults mean on this machine (no GPU) is the resolver's to say
    assert placement.devices == ("cpu", "cpu") and placement.backend == "gloo"


@pytest.mark.filterwarnings("ignore:3 workers on:UserWarning")  # on a machine of fewer cores: the builder's own advice
def test_fluent_builder_sets_every_option() -> None:
    w = (
        ParallelWrapper.builder(model())
        .optimizer(torch.optim.SGD, lr=0.01, momentum=0.9, nesterov=True)
        .loss_fn(nn.functional.mse_loss)
        .workers(3)
        .prefetch_buffer(7)
        .averaging_frequency(5)
        .report_score_after_averaging(False)
        .average_updaters(False)
        .training_mode("shared-gradients")
        .deterministic(True)
        .seed(9)
        .devices(["cpu", "cpu", "cpu"])
        .nan_policy("skip")
        .stall_timeout(30)
        .checkpoint("ckpt", every=7)
        .build()
    )
    c = w.config
    assert (c.workers, c.prefetch_buffer, c.averaging_frequency, c.seed) == (3, 7, 5, 9)
    assert not c.report_score_after_averaging and not c.average_updaters and c.deterministic
    assert c.training_mode is TrainingMode.SHARED_GRADIENTS and c.nan_policy is NanPolicy.SKIP
    assert c.devices == ("cpu",) * 3 and c.stall_timeout == 30.0
    assert (c.checkpoint_dir, c.checkpoint_every) == ("ckpt", 7)
    assert isinstance(w.optimizer, torch.optim.SGD) and w.optimizer.defaults["nesterov"]
    w.close()


@pytest.mark.parametrize(
    ("setter", "value", "match"),
    [
        ("workers", 0, r"workers must be an int >= 1, got 0; e.g. .workers\(1\)"),
        ("workers", 1.5, r"workers must be an int"),
        ("averaging_frequency", 0, r"averaging_frequency must be an int >= 1"),
        ("prefetch_buffer", -1, r"prefetch_buffer must be an int >= 1"),
        ("training_mode", "sometimes", r"training_mode must be one of \['averaging', 'shared-gradients'\]"),
        ("nan_policy", "ignore", r"nan_policy must be one of"),
        ("backend", "mpi", r"backend must be one of"),
        ("seed", "x", r"seed must be an int"),
        ("devices", ["cpu"], r"devices names 1 devices for 2 workers"),
        ("devices", "cpu", r"one device per worker"),
        ("devices", ["cpu", "tpu:9"], r"not a torch device"),
        ("stall_timeout", 0, r"stall_timeout must be a positive number, got 0.0; e.g. .stall_timeout\(60.0\)"),
        ("on_worker_failure", "retry", r"on_worker_failure must be one of \['raise', 'replace'\], got 'retry'"),
        ("peer_timeout", 0, r"peer_timeout must be a positive number"),
    ],
)
def test_bad_values_are_refused_with_the_fix(setter: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        getattr(ParallelWrapper.builder(model()), setter)(value).build()


def test_replacing_workers_has_a_bounded_count_and_needs_rounds_that_land() -> None:
    b = ParallelWrapper.builder(model())
    assert (Config().on_worker_failure, Config().max_replacements, Config().auto_resume) == ("raise", 3, True)
    with b.on_worker_failure("replace", max_replacements=5).build() as w:
        assert (w.config.on_worker_failure, w.config.max_replacements) == ("replace", 5)
    with pytest.raises(ValueError, match=r"max_replacements must be an int >= 0, got -1"):
        b.on_worker_failure("replace", max_replacements=-1).build()
    with b.on_worker_failure("replace").overlap_averaging(True).build() as w:  # composes (test_composition.py)
        assert w.config.overlap_averaging


def test_overlap_averaging_is_for_averaging_only() -> None:
    b = ParallelWrapper.builder(model()).overlap_averaging(True)
    with b.build() as w:
        assert w.config.overlap_averaging
    with pytest.raises(ValueError, match=r"overlap_averaging applies to TrainingMode.AVERAGING only.*drop"):
        b.training_mode("shared-gradients").build()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs NCCL needs")
def test_nccl_without_enough_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match=r"backend 'nccl' needs one CUDA device per worker.*\.backend\('gloo'\)"):
        ParallelWrapper.builder(model()).backend("nccl").build()


def test_objects_that_cannot_reach_a_worker_are_refused() -> None:
    with pytest.raises(ValueError, match=r"loss_fn cannot be sent to a spawned worker process.*module level"):
        ParallelWrapper.builder(model()).loss_fn(lambda out, y: out.sum()).build()

    def local_step(m: nn.Module, batch: object) -> torch.Tensor:
        return torch.zeros(())

    with pytest.raises(ValueError, match=r"training_step cannot be sent"):
        ParallelWrapper.builder(model()).training_step(local_step).build()

    class Local(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    with pytest.raises(ValueError, match=r"model cannot be sent"):
        ParallelWrapper.builder(Local()).build()


def test_bad_optimizer_and_model_and_listener() -> None:
    with pytest.raises(ValueError, match=r"optimizer takes an optimizer class"):
        ParallelWrapper.builder(model()).optimizer(torch.optim.SGD(model().parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"torch.optim.sgd.SGD\(\{'lr': -1\}\) failed"):
        ParallelWrapper.builder(model()).optimizer(torch.optim.SGD, lr=-1).build()
    with pytest.raises(ValueError, match=r"takes a torch.nn.Module"):
        ParallelWrapper.builder("not a model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"listeners\[0\]"):
        ParallelWrapper.builder(model()).listeners(42).build()


def test_fit_rejects_bad_data_before_spawning() -> None:
    w = ParallelWrapper.builder(model()).build()
    with pytest.raises(ValueError, match="empty iterable"):
        w.fit([])
    with pytest.raises(ValueError, match="iterator, which is used up after one epoch"):
        w.fit(iter([(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))]), epochs=2)
    with pytest.raises(ValueError, match="epochs must be an int >= 1"):
        w.fit([(torch.zeros(2, 4), torch.zeros(2))], epochs=0)
    with pytest.raises(ValueError, match="takes an iterable of batches"):
        w.fit(42)  # type: ignore[arg-type]
    assert w._pool is None  # nothing was spawned
    w.close()


def test_under_torchrun_workers_and_devices_are_ignored_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun decides the workers and their devices: options written for spawned workers (here
    three workers on two devices, which build() refuses outside torchrun) still build there."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.warns(UserWarning) as warned:
        w = ParallelWrapper.builder(model()).workers(3).devices(["cpu", "cpu"]).build()
    assert len(warned) == 1 and ".workers() and .devices() are ignored" in str(warned[0].message)
    assert w.world_size == 4 and not w.is_main and w.placement.devices == ("cpu", "cpu")
    w.close()
