"""What the environment means to the library: torchrun's variables, the GPUs and cores, made into devices, backend, threads and timeouts.

An explicit option wins over what the environment suggests.

`resolve` reads nothing itself when it is given `gpus` and `cores`: tests fake a machine that way, and
it never warns, it returns `notes` for the caller to show once.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from .config import Config

# Past the stall watchdog's limit: the watchdog can name the stalled worker, a collective's timeout cannot.
_COLLECTIVE_MARGIN_S = 30.0


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a torchrun group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restarts: int = 0  # TORCHELASTIC_RESTART_COUNT: this node's agent restarted the group this often (--max-restarts)


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun identity of this process (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    TORCHELASTIC_RESTART_COUNT), or None outside torchrun (None when RANK or WORLD_SIZE is
    missing). environ defaults to os.environ."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None

    def number(name: str, default: str) -> int:
        value = env.get(name, default)
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer; torchrun sets it, launch with torchrun") from None

    # A single-node launcher that sets only RANK and WORLD_SIZE runs one process here: local rank 0 of 1.
    return TorchrunEnv(
        number("RANK", "0"), number("WORLD_SIZE", "1"), number("LOCAL_RANK", "0"), number("LOCAL_WORLD_SIZE", "1"),
        number("TORCHELASTIC_RESTART_COUNT", "0"),
    )  # fmt: skip


def gpu_count() -> int:
    return torch.cuda.device_count()


def core_count() -> int:
    # The affinity mask, not the machine: a container or taskset may give this process fewer cores.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_devices(workers: int, gpus: int) -> tuple[str, ...]:
    """cuda:i mod gpus for each of `workers` workers (they share GPUs when they outnumber them)."""
    if gpus < 1:
        raise ValueError(f"gpu_devices needs at least one GPU, got gpus={gpus}")
    return tuple(f"cuda:{i % gpus}" for i in range(workers))


@dataclass(frozen=True)
class Placement:
    """Where the workers of this machine run, resolved once from the config and the environment."""

    world_size: int  # workers in the whole group: config.workers, torchrun's WORLD_SIZE, or a fleet's processes (its first group)
    devices: tuple[str, ...]  # one per worker on this machine, by local rank (spawned: the rank)
    backend: str  # "gloo" or "nccl"
    threads: int  # torch intra-op threads for each worker process
    torchrun: TorchrunEnv | None
    notes: tuple[str, ...] = ()  # warnings for the caller to show once
    per_worker: int = 1  # processes per worker (feature.Feature.processes: a pipeline's stages); devices are then by process, worker by worker

    def device(self, local_rank: int) -> torch.device:
        return torch.device(self.devices[local_rank])

    @property
    def processes(self) -> int:
        """Processes in the whole group: `per_worker` of each worker (a pipeline's stages)."""
        return self.world_size * self.per_worker

    @property
    def in_process(self) -> bool:
        """One CPU worker trains in the caller's process: nothing to spawn, no batch to copy."""
        return self.torchrun is None and self.world_size == 1 and self.per_worker == 1 and self.device(0).type == "cpu"

    def __str__(self) -> str:
        on = self.devices[0] if len(set(self.devices)) == 1 else ", ".join(self.devices)
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        each = f"with {self.backend}, {threads} each"
        if self.torchrun is not None:
            workers = f"{self.world_size} workers" + (f" x {self.per_worker} stages" if self.per_worker > 1 else "")
            return f"{workers} under torchrun, {len(self.devices)} on this node on {on} {each}"
        if self.in_process:
            return f"1 worker in this process on cpu, {threads}"
        if self.per_worker > 1:
            return f"{self.world_size} worker{'s' if self.world_size != 1 else ''} x {self.per_worker} stages on {_span(self.devices)} {each}"
        return f"{self.world_size} workers on {on} {each}"


def _span(devices: tuple[str, ...]) -> str:
    """cuda:0..3 for consecutive GPUs, else the devices as they are."""
    first = torch.device(devices[0]).index or 0
    if len(devices) > 1 and list(devices) == [f"cuda:{i}" for i in range(first, first + len(devices))]:
        return f"cuda:{first}..{first + len(devices) - 1}"
    return devices[0] if len(set(devices)) == 1 else ", ".join(devices)


def _gpu_index(device: torch.device) -> int:
    return device.index or 0  # a bare "cuda" is the current device, cuda:0 in a fresh process


def _share_note(n: int, gpus: int, fix: str) -> str:
    return f"{n} workers share {gpus} GPUs: using gloo, which is slower than NCCL; use {fix} with n <= the number of GPUs for NCCL"


def resolve(
    config: Config,
    torchrun: TorchrunEnv | None = None,
    *,
    gpus: int | None = None,
    cores: int | None = None,
    explicit: Collection[str] = (),
    per_worker: int = 1,
    notes: tuple[str, ...] = (),
) -> Placement:
    """The placement of this machine's workers. torchrun None means spawned (or in-process) workers.
    gpus/cores default to gpu_count()/core_count(); tests pass them to fake a machine. `explicit` is the
    set of option names the user set on the builder (e.g. {"workers", "devices"}). `per_worker` and
    `notes`: what the config's features say (feature.Feature's `processes` and `notes`): the
    processes one worker is (a pipeline's stages), and what the caller is told of them."""
    gpus = gpu_count() if gpus is None else gpus
    cores = core_count() if cores is None else cores
    if config.fleet is not None and torchrun is None:
        torchrun = TorchrunEnv(0, 1, 0, 1)  # a fleet's process launched by hand (python script.py): the one of its machine
    if torchrun is not None:
        return _resolve_torchrun(config, torchrun, gpus, cores, explicit, per_worker, notes)

    workers, stages = config.workers, per_worker
    processes = workers * stages  # a pipeline's stages each have a device, worker by worker
    if config.devices is not None:
        if len(config.devices) != processes:
            who, per = (f"{workers} workers", "worker") if stages == 1 else (f"{processes} processes ({workers} workers x {stages} stages)", "stage")
            raise ValueError(f"devices names {len(config.devices)} devices for {who}; give one device per {per}, e.g. .devices({['cpu'] * processes})")
        devices = config.devices
    else:
        devices = gpu_devices(processes, gpus) if gpus > 0 else ("cpu",) * processes
    for name in devices:
        d = torch.device(name)
        if d.type == "cuda" and _gpu_index(d) >= gpus:
            raise ValueError(f"devices: {name} does not exist, this machine has {gpus} CUDA devices")
    refusal = (
        f"backend 'nccl' needs one CUDA device per worker: {workers} workers, devices {list(devices)}, "
        f"{gpus} GPUs here. Use .workers({max(gpus, 1)}) or .backend('gloo')"
    )
    backend, threads, told = _backend_and_threads(config, devices, cores, refusal, ".workers(n)", stages)
    return Placement(workers, devices, backend, threads, None, (*told, *notes), stages)


def _backend_and_threads(
    config: Config, devices: tuple[str, ...], cores: int, refusal: str, fix: str, stages: int = 1
) -> tuple[str, int, list[str]]:
    """For the workers of this machine, one per device: NCCL when each has a GPU of its own (asked
    for without, the `refusal`), else gloo; and the cores shared out among them, with a note when the
    workers outnumber them."""
    cuda = [_gpu_index(d) for d in map(torch.device, devices) if d.type == "cuda"]
    own_gpu = len(cuda) == len(devices) and len(set(cuda)) == len(devices)
    if config.backend == "nccl" and not own_gpu:
        raise ValueError(refusal)
    notes: list[str] = []
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if own_gpu else "gloo"
        if len(set(cuda)) < len(cuda) and stages == 1:  # gloo because workers share a GPU, not because some are on the CPU
            notes.append(_share_note(len(cuda), len(set(cuda)), fix))
    if stages > 1 and backend == "gloo" and cuda:
        # torch's pipeline schedules send activations between stages by sends and receives, which
        # gloo makes from host memory only: a CUDA tensor's fail ("writev: Bad address", measured).
        raise ValueError(
            f"pipeline(stages={stages}): stages on {', '.join(devices)} would pass activations over gloo, which sends "
            f"from host memory only (a GPU tensor's send fails); give each stage a GPU of its own ({len(devices)} GPUs, "
            f"NCCL) or put every stage on the CPU: .devices({['cpu'] * len(devices)})"
        )
    # Oversubscribed cores cost more than they give: each worker's threads would fight the others'.
    threads = config.threads_per_worker if config.threads_per_worker is not None else max(1, cores // len(devices))
    if len(devices) > cores:
        notes.append(_cores_note(len(devices), cores, fix, stages))
    return backend, threads, notes


def _cores_note(n: int, cores: int, fix: str, stages: int = 1) -> str:
    # Every round waits for its slowest worker, and a worker that shares its core is the slowest.
    if stages > 1:
        return (
            f"{n} processes ({n // stages} workers x {stages} stages) on {cores} CPU cores: they take turns on the cores "
            f"and every step waits for the slowest stage; use {fix} with n x {stages} <= {cores}"
        )
    return (
        f"{n} workers on {cores} CPU cores: they take turns on the cores and every averaging waits for the "
        f"slowest, so training is slower than with fewer workers; use {fix} with n <= {cores}"
    )


def _resolve_torchrun(config: Config, env: TorchrunEnv, gpus: int, cores: int, explicit: Collection[str], stages: int, told: tuple[str, ...]) -> Placement:
    """torchrun's --nnodes and --nproc-per-node decide the workers and LOCAL_RANK the GPU, so `workers` and
    `devices` are ignored rather than checked: a config written for spawned workers still runs here."""
    notes: list[str] = []
    ignored = [f".{name}()" for name in ("workers", "devices") if name in explicit]
    if ignored:
        verb = "are" if len(ignored) > 1 else "is"
        notes.append(
            f"under torchrun, {' and '.join(ignored)} {verb} ignored: torchrun's --nnodes and --nproc-per-node "
            f"decide how many workers run, and each uses GPU LOCAL_RANK when there are GPUs"
        )
    local = env.local_world_size
    if env.world_size % stages or local % stages:
        raise ValueError(
            f"pipeline(stages={stages}) under torchrun runs each pipeline's stages on one node, as consecutive ranks: "
            f"{env.world_size} ranks, {local} on this node, are not a multiple of {stages}; use --nproc-per-node a multiple of {stages}"
        )
    devices = gpu_devices(local, gpus) if gpus > 0 else ("cpu",) * local
    refusal = (
        f"backend 'nccl' needs one CUDA device per process: torchrun started {local} processes on this node "
        f"and it has {gpus} GPUs. Use --nproc-per-node {max(gpus, 1)} or .backend('gloo')"
    )
    notes += told
    backend, threads, more = _backend_and_threads(config, devices, cores, refusal, "--nproc-per-node n")
    # A fleet's group forms across the machines' torchruns, each of which knows its own processes only.
    return Placement(config.planned_workers(env.world_size // stages), devices, backend, threads, env, tuple(notes + more), stages)


def collective_timeout(config: Config) -> datetime.timedelta:
    """The collectives' own timeout: stall_timeout + 30 s, past the stall watchdog's, so that the watchdog,
    which can name the stalled worker, speaks first; it is the only guard under torchrun."""
    return datetime.timedelta(seconds=config.stall_timeout + _COLLECTIVE_MARGIN_S)



def claim_device(placement: Placement, local_rank: int, deterministic: bool = False) -> torch.device:
    """This process's device, made the current CUDA device when it is one: before the process
    group starts, so that NCCL's communicator and every later allocation use it. `deterministic`
    (`.deterministic(True)`) on a GPU asks for deterministic kernels too, before cuBLAS starts:
    cuDNN's convolutions and cuBLAS's reductions vary from run to run otherwise (a resumed run
    on an H200 ended apart from the uninterrupted one); torch warns of an op that has none."""
    device = placement.device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if deterministic:
            deterministic_kernels()
    return device


def deterministic_kernels() -> None:
    """Deterministic CUDA kernels in this process (a worker on a GPU under .deterministic(True)):
    cuBLAS's workspace as its reproducibility notes ask, before cuBLAS starts, and torch's
    deterministic algorithms, warning of an op that has none."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


__all__ = [
    "Placement",
    "TorchrunEnv",
    "claim_device",
    "collective_timeout",
    "deterministic_kernels",
    "core_count",
    "gpu_count",
    "gpu_devices",
    "resolve",
    "torchrun_env",
]
