"""The environment policy: devices, backend, threads and notes from the config and a faked machine
(gpus=, cores=), spawned and under torchrun. Nothing here starts a process or needs a GPU."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import pytest
import torch

from parallelwrapper.config import Config, Pipeline
from parallelwrapper.env import (
    Placement,
    TorchrunEnv,
    collective_timeout,
    core_count,
    deterministic_kernels,
    gpu_count,
    gpu_devices,
    resolve,
    torchrun_env,
)
from parallelwrapper.features import placement

pytestmark = pytest.mark.fast

NCCL_PER_WORKER = r"backend 'nccl' needs one CUDA device per worker.*\.backend\('gloo'\)"
NCCL_PER_PROCESS = r"backend 'nccl' needs one CUDA device per process.*--nproc-per-node 1 or \.backend\('gloo'\)"


def node(local_world_size: int, world_size: int = 8, local_rank: int = 0) -> TorchrunEnv:
    """One node of a torchrun group; the ranks are arbitrary but consistent."""
    return TorchrunEnv(rank=local_rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size)


# -- torchrun's variables ------------------------------------------------------------------------


def test_torchrun_env_parses_the_four_variables() -> None:
    env = torchrun_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "PATH": "/bin"})
    assert env == TorchrunEnv(rank=5, world_size=8, local_rank=1, local_world_size=4)


def test_torchrun_env_counts_the_agents_restarts() -> None:
    assert torchrun_env({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2"}) == TorchrunEnv(0, 2, 0, 1, restarts=2)


@pytest.mark.parametrize("environ", [{}, {"RANK": "0"}, {"WORLD_SIZE": "2"}, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}])
def test_outside_torchrun_without_rank_and_world_size(environ: dict[str, str]) -> None:
    """Both RANK and WORLD_SIZE make a torchrun process; LOCAL_* alone do not."""
    assert torchrun_env(environ) is None


def test_local_variables_default_to_one_process_on_this_node() -> None:
    assert torchrun_env({"RANK": "0", "WORLD_SIZE": "1"}) == TorchrunEnv(0, 1, 0, 1)


def test_a_non_integer_variable_is_named() -> None:
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is not an integer"):
        torchrun_env({"RANK": "0", "WORLD_SIZE": "two"})


def test_torchrun_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert torchrun_env() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert torchrun_env() == TorchrunEnv(1, 2, 1, 2)


# -- this machine ----------------------------------------------------------------------------------


def test_machine_counts() -> None:
    assert gpu_count() == torch.cuda.device_count()
    assert 1 <= core_count() <= (os.cpu_count() or 1)


def test_resolve_reads_this_machine_by_default() -> None:
    """Without gpus=/cores= the resolver asks the machine, so callers need not."""
    p = resolve(Config(threads_per_worker=None))
    assert p.devices == (gpu_devices(2, gpu_count()) if gpu_count() else ("cpu", "cpu"))
    assert p.threads == max(1, core_count() // 2)


def test_gpu_devices_deal_gpus_round_robin() -> None:
    assert gpu_devices(4, 2) == ("cuda:0", "cuda:1", "cuda:0", "cuda:1")
    assert gpu_devices(2, 4) == ("cuda:0", "cuda:1")
    with pytest.raises(ValueError, match="at least one GPU"):
        gpu_devices(2, 0)


# -- spawned workers -------------------------------------------------------------------------------


# Two workers on this machine (spawned, or two torchrun processes on this node) with 0 to 4 GPUs.
TWO_WORKERS = [
    (0, ("cpu", "cpu"), "gloo", False),
    (1, ("cuda:0", "cuda:0"), "gloo", True),
    (2, ("cuda:0", "cuda:1"), "nccl", False),
    (4, ("cuda:0", "cuda:1"), "nccl", False),
]


@pytest.mark.parametrize(("gpus", "devices", "backend", "shared"), TWO_WORKERS)
def test_spawned_auto_placement(gpus: int, devices: tuple[str, ...], backend: str, shared: bool) -> None:
    """Default config (2 workers): a GPU each when there are enough, NCCL only then."""
    p = resolve(Config(), gpus=gpus, cores=8)
    assert (p.world_size, p.devices, p.backend, p.threads, p.torchrun) == (2, devices, backend, 4, None)
    assert not p.in_process
    share = "2 workers share 1 GPUs: using gloo, which is slower than NCCL; use .workers(n) with n <= the number of GPUs for NCCL"
    assert p.notes == ((share,) if shared else ())
    assert p.device(1) == torch.device(devices[1])


def test_four_workers_on_two_gpus_share_them_with_gloo() -> None:
    p = resolve(Config(workers=4), gpus=2, cores=8)
    assert p.devices == ("cuda:0", "cuda:1", "cuda:0", "cuda:1") and p.backend == "gloo"
    assert len(p.notes) == 1 and p.notes[0].startswith("4 workers share 2 GPUs: using gloo")


def test_explicit_gloo_on_shared_gpus_is_not_second_guessed() -> None:
    """The user chose gloo: no note telling them it is slower."""
    p = resolve(Config(workers=4, backend="gloo"), gpus=2, cores=8)
    assert p.backend == "gloo" and p.notes == ()


@pytest.mark.parametrize(
    ("workers", "cores", "threads_per_worker", "threads"),
    [(2, 8, None, 4), (4, 2, None, 1), (3, 16, None, 5), (1, 2, None, 2), (2, 8, 3, 3), (4, 2, 2, 2)],
)
def test_threads_share_the_cores_unless_set(workers: int, cores: int, threads_per_worker: int | None, threads: int) -> None:
    """Each worker gets its share of the cores (at least one); an explicit count wins even if it oversubscribes."""
    p = resolve(Config(workers=workers, threads_per_worker=threads_per_worker), gpus=0, cores=cores)
    assert p.threads == threads


@pytest.mark.parametrize(("workers", "cores", "noted"), [(3, 2, True), (2, 2, False), (1, 1, False), (16, 4, True)])
def test_workers_outnumbering_the_cores_are_noted(workers: int, cores: int, noted: bool) -> None:
    p = resolve(Config(workers=workers), gpus=0, cores=cores)
    note = f"{workers} workers on {cores} CPU cores: they take turns on the cores"
    assert [n for n in p.notes if n.startswith(note)] == ([p.notes[0]] if noted else [])
    assert not noted or p.notes[0].endswith(f"use .workers(n) with n <= {cores}")


def test_torchrun_processes_outnumbering_the_cores_are_noted() -> None:
    p = resolve(Config(), node(4), gpus=0, cores=2)
    assert p.notes == (
        "4 workers on 2 CPU cores: they take turns on the cores and every averaging waits for the slowest, "
        "so training is slower than with fewer workers; use --nproc-per-node n with n <= 2",
    )


def test_replacing_workers_is_noted_where_it_cannot_happen() -> None:
    replace = Config(on_worker_failure="replace", workers=1)  # the replacement feature's notes (features.placement)
    assert placement(replace, gpus=0, cores=2).notes == (
        'on_worker_failure("replace") restores a lost worker from a peer, and one worker has none: a failure raises',
    )
    assert placement(dataclasses.replace(replace, workers=2), gpus=0, cores=2).notes == ()
    (note,) = placement(replace, node(2), gpus=0, cores=2).notes
    assert note.startswith('under torchrun, on_worker_failure("replace") is ignored: torchrun restarts the group')


@pytest.mark.parametrize(
    ("options", "gpus", "in_process"),
    [
        ({"workers": 1}, 0, True),
        ({"workers": 1}, 1, False),  # the one worker goes to the GPU, in a process of its own
        ({"workers": 1, "devices": ("cpu",)}, 2, True),  # an explicit CPU beats the GPUs
        ({"workers": 2}, 0, False),
    ],
)
def test_in_process_is_one_cpu_worker(options: dict[str, Any], gpus: int, in_process: bool) -> None:
    assert resolve(Config(**options), gpus=gpus, cores=2).in_process is in_process


@pytest.mark.parametrize(
    ("options", "in_process"),
    [
        ({"workers": 1}, True),
        ({"workers": 1, "devices": ("cpu",)}, True),
        ({"workers": 2}, False),
        ({"workers": 1, "pipeline": Pipeline(2)}, False),  # one worker, two stage processes
        ({"workers": 1, "on_worker_failure": "replace"}, True),  # nothing to replace it from: it stays here, as with "raise"
    ],
)
def test_the_features_say_whether_a_worker_runs_in_process(options: dict[str, Any], in_process: bool) -> None:
    """What the wrapper's host follows: the placement with its features' answers (features.placement),
    not env.resolve's alone, which knows no pipeline's stages."""
    assert placement(Config(**options), gpus=0, cores=2).in_process is in_process


def test_explicit_devices_win_over_auto() -> None:
    cpu = resolve(Config(devices=("cpu", "cpu")), gpus=2, cores=4)
    assert (cpu.devices, cpu.backend, cpu.notes) == (("cpu", "cpu"), "gloo", ())
    swapped = resolve(Config(devices=("cuda:1", "cuda:0")), gpus=2, cores=4)
    assert (swapped.devices, swapped.backend) == (("cuda:1", "cuda:0"), "nccl")
    mixed = resolve(Config(devices=("cuda:0", "cpu")), gpus=2, cores=4)
    assert (mixed.backend, mixed.notes) == ("gloo", ())  # gloo for the CPU worker, nobody shares a GPU


@pytest.mark.parametrize(
    ("devices", "gpus", "match"),
    [
        (("cuda:0", "cuda:3"), 2, r"devices: cuda:3 does not exist, this machine has 2 CUDA devices"),
        (("cuda", "cpu"), 0, r"devices: cuda does not exist, this machine has 0 CUDA devices"),
    ],
)
def test_explicit_devices_beyond_the_gpus_are_refused(devices: tuple[str, ...], gpus: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve(Config(devices=devices), gpus=gpus, cores=2)


@pytest.mark.parametrize(
    ("options", "gpus"),
    [
        ({}, 0),
        ({}, 1),
        ({"workers": 4}, 2),
        ({"devices": ("cuda:0", "cuda:0")}, 2),
        ({"devices": ("cuda:0", "cpu")}, 2),
    ],
)
def test_nccl_without_a_gpu_per_worker_is_refused_with_the_fix(options: dict[str, Any], gpus: int) -> None:
    config = Config(backend="nccl", **options)
    with pytest.raises(ValueError, match=NCCL_PER_WORKER) as e:
        resolve(config, gpus=gpus, cores=2)
    assert f".workers({max(gpus, 1)})" in str(e.value)


def test_nccl_with_a_gpu_per_worker_resolves() -> None:
    p = resolve(Config(backend="nccl"), gpus=2, cores=2)
    assert (p.devices, p.backend) == (("cuda:0", "cuda:1"), "nccl")


# -- under torchrun --------------------------------------------------------------------------------


@pytest.mark.parametrize(("gpus", "devices", "backend", "shared"), TWO_WORKERS)
def test_torchrun_auto_placement(gpus: int, devices: tuple[str, ...], backend: str, shared: bool) -> None:
    """Two processes on this node of an 8-worker group: a device per local rank, threads per local process."""
    env = node(local_world_size=2)
    p = resolve(Config(), env, gpus=gpus, cores=8)
    assert (p.world_size, p.devices, p.backend, p.threads, p.torchrun) == (8, devices, backend, 4, env)
    assert not p.in_process
    assert len(p.notes) == int(shared)
    if shared:
        assert "--nproc-per-node n" in p.notes[0] and "using gloo" in p.notes[0]


def test_torchrun_identity_from_the_environment_picks_the_local_gpu() -> None:
    env = torchrun_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert env is not None
    p = resolve(Config(threads_per_worker=6), env, gpus=2, cores=2)
    assert p.device(env.local_rank) == torch.device("cuda:1")
    assert (p.world_size, p.threads, p.backend) == (4, 6, "nccl")


def test_torchrun_world_of_one_is_not_in_process() -> None:
    """torchrun already made this process the worker; there is nothing to run in-process."""
    assert not resolve(Config(workers=1), node(1, world_size=1), gpus=0, cores=2).in_process


@pytest.mark.parametrize(
    ("explicit", "named"),
    [
        ({"workers", "devices", "seed"}, ".workers() and .devices() are ignored"),
        ({"workers"}, ".workers() is ignored"),
        ({"devices"}, ".devices() is ignored"),
    ],
)
def test_workers_and_devices_are_ignored_under_torchrun_with_one_note(explicit: set[str], named: str) -> None:
    """torchrun decides how many workers run and where: the options neither fail nor count, they are named once."""
    config = Config(workers=3, devices=("cpu", "cpu", "cpu"))
    p = resolve(config, node(2), gpus=2, cores=4, explicit=explicit)
    assert (p.world_size, p.devices, p.backend) == (8, ("cuda:0", "cuda:1"), "nccl")
    assert len(p.notes) == 1 and p.notes[0].startswith(f"under torchrun, {named}")
    assert "--nnodes and --nproc-per-node" in p.notes[0]


def test_ignored_devices_are_not_checked_against_the_gpus() -> None:
    p = resolve(Config(devices=("cuda:5", "cuda:6")), node(1), gpus=1, cores=4, explicit={"devices"})
    assert p.devices == ("cuda:0",) and len(p.notes) == 1


def test_no_note_when_nothing_was_set_explicitly() -> None:
    assert resolve(Config(workers=3), node(2), gpus=2, cores=4).notes == ()


def test_nccl_under_torchrun_on_a_one_gpu_node() -> None:
    """Regression: `workers` defaults to 2, but one torchrun process per one-GPU node is enough for NCCL."""
    p = resolve(Config(backend="nccl"), node(1, world_size=4), gpus=1, cores=8)
    assert (p.devices, p.backend, p.threads, p.notes) == (("cuda:0",), "nccl", 8, ())


@pytest.mark.parametrize(("local_world_size", "gpus"), [(1, 0), (2, 0), (2, 1)])
def test_nccl_under_torchrun_without_a_gpu_per_process_is_refused(local_world_size: int, gpus: int) -> None:
    with pytest.raises(ValueError, match=NCCL_PER_PROCESS) as e:
        resolve(Config(backend="nccl"), node(local_world_size), gpus=gpus, cores=2)
    assert f"started {local_world_size} processes on this node and it has {gpus} GPUs" in str(e.value)


# -- the placement and the timeout -----------------------------------------------------------------


def test_placement_is_frozen_and_describes_itself() -> None:
    p = resolve(Config(), gpus=2, cores=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.backend = "gloo"  # type: ignore[misc]
    assert str(p) == "2 workers on cuda:0, cuda:1 with nccl, 8 threads each"
    assert str(resolve(Config(workers=1), gpus=0, cores=2)) == "1 worker in this process on cpu, 2 threads"
    assert str(resolve(Config(), node(2), gpus=0, cores=4)) == "8 workers under torchrun, 2 on this node on cpu with gloo, 2 threads each"


def test_placement_default_has_no_notes() -> None:
    assert Placement(1, ("cpu",), "gloo", 1, None).notes == ()


@pytest.mark.parametrize(("stall", "seconds"), [(300.0, 330.0), (10.0, 40.0), (0.5, 30.5)])
def test_collective_timeout_outlasts_the_stall_watchdog(stall: float, seconds: float) -> None:
    """The watchdog names the stalled worker, so it must speak before the collective gives up."""
    assert collective_timeout(Config(stall_timeout=stall)) == datetime.timedelta(seconds=seconds)


@pytest.mark.fast
def test_deterministic_kernels_ask_for_cublas_workspace_and_deterministic_algorithms(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker on a GPU asks for under .deterministic(True) (claim_device), before cuBLAS starts."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # so that monkeypatch puts back what was there
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark)
    try:
        deterministic_kernels()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]
