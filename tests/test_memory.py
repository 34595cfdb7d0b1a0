"""What a fit holds in memory (benchmarks/memory.py measures how much): a worker trains one model
and no copy of the one it was built from, nor of the state its fit started from; the main process
lets go of the state it sent, and of the job's pickle once every worker has it, and that pickle
holds the model's structure, not its weights."""

from __future__ import annotations

import gc
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from parallelwrapper import ParallelWrapper, shared_state
from parallelwrapper.hosts.inprocess import group_of_one
from parallelwrapper.hosts.process import _unpickle_job
from parallelwrapper.hosts.runtime import Worker
from parallelwrapper.hosts.spawned import WorkerPool, _shared_pickle
from parallelwrapper.processes import keep_heap

pytestmark = pytest.mark.timeout(120)

SHAPE = (13, 7)  # the first layer's weight: no other tensor of the job has this shape


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(SHAPE[1], SHAPE[0]), nn.ReLU(), nn.Linear(SHAPE[0], 3))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, SHAPE[1], generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def others(*mine: torch.Tensor | None) -> int:
    """Live tensors of SHAPE in this process whose memory is none of `mine`'s (garbage that an
    earlier test left in cycles is collected first: it is not live)."""
    gc.collect()
    ours = {t.untyped_storage().data_ptr() for t in mine if t is not None}
    # type(o), not isinstance: isinstance reads __class__, which torch's deprecated module aliases warn on
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.shape == SHAPE and o.untyped_storage().data_ptr() not in ours)


class FirstStepHoldsOneModel:
    """`.before_step`, in a worker: at its first step it holds its weight and gradient of SHAPE,
    and nothing else of that shape (no copy of the unpickled model, no state it started from)."""

    def __init__(self) -> None:
        self.checked = False

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not self.checked:
            self.checked = True
            assert isinstance(model, nn.Sequential)
            weight = model[0].weight
            assert others(weight, weight.grad) == 0, f"{others(weight, weight.grad)} more tensors of the first layer's shape"


@pytest.mark.fast
def test_a_worker_copies_the_users_model_unless_the_model_is_its_own() -> None:
    with ParallelWrapper.builder(mlp()).workers(1).threads_per_worker(1).build() as w:
        config, job, placement = w.config, w._job, w.placement
    group = group_of_one(config)
    copied = Worker(job, config, placement, 0, 0, group=group).replica.model
    assert copied is not job.model
    theirs = {p.untyped_storage().data_ptr() for p in job.model.parameters()}
    assert not theirs & {p.untyped_storage().data_ptr() for p in copied.parameters()}
    # A spawned worker's job was unpickled in its own process: its model is nobody else's.
    assert Worker(job, config, placement, 0, 0, group=group, own_model=True).replica.model is job.model


class MainHoldsItsOwn:
    """A listener in the main process: at each fit's first score (the workers are training), the
    tensors of SHAPE it holds are its model's weight and, once a fit has made it, the optimizer's
    momentum for it, the same objects as before the fit, in shared memory: what the workers were
    sent (Parts.shipped), not copies of it."""

    optimizer: torch.optim.Optimizer  # the wrapper's, set once it is built

    def __init__(self, model: nn.Sequential) -> None:
        self.weight, self.checks, self.first = model[0].weight, 0, True
        self.momentum: torch.Tensor | None = None

    def on_fit_start(self, config: Any, epochs: int) -> None:
        self.first = True
        self.momentum = self.optimizer.state.get(self.weight, {}).get("momentum_buffer")

    def __call__(self, score: Any) -> None:
        if self.first:
            self.first = False
            assert others(self.weight, self.momentum) == 0, f"{others(self.weight, self.momentum)} more tensors of the first layer's shape"
            held = [t for t in (self.weight, self.momentum) if t is not None]
            assert all(t.untyped_storage().is_shared() for t in held)
            assert self.optimizer.state.get(self.weight, {}).get("momentum_buffer") is self.momentum
            self.checks += 1


def test_spawned_workers_and_the_main_process_hold_no_spare_copy() -> None:
    user = mlp()
    in_main = MainHoldsItsOwn(user)
    w = (
        ParallelWrapper.builder(user)
        .optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        .before_step(FirstStepHoldsOneModel())
        .workers(2)
        .threads_per_worker(1)
        .averaging_frequency(2)
        .listeners(in_main)
        .build()
    )
    in_main.optimizer = w._parts.optimizer
    with w:
        w.fit(batches(8))
        assert isinstance(w._pool, WorkerPool) and w._pool._job is None  # every worker unpickled it
        momentum = [s["momentum_buffer"] for s in w._parts.optimizer.state.values()]
        assert len({m.untyped_storage().data_ptr() for m in momentum}) == 1  # worker 0's came back in one shared buffer, kept
        w.fit(batches(8))  # a second fit starts from the optimizer's state too
        assert in_main.momentum is not None
    assert in_main.checks == 2


@pytest.mark.fast
def test_the_main_process_sends_its_own_state_moved_into_shared_memory_once() -> None:
    """Parts.shipped: the model's and the optimizer's tensors move into shared memory, one buffer
    per dtype and part, keeping their identity and values, and a second call moves nothing; what
    is sent is those buffers and where each tensor sits (shared_state._unpack rebuilds it as the
    worker does). A tensor whose storage something else holds too (another tensor, a detach()
    kept) stays, and goes as a copy: moving it would leave the other behind."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    model[2].register_buffer("row", model[2].weight.detach()[0])  # shares the weight's storage
    with ParallelWrapper.builder(model).optimizer(torch.optim.SGD, lr=0.1, momentum=0.9).workers(2).build() as w:
        parts = w._parts
    nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 0, 0, 1])).backward()
    parts.optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    momentum = [parts.optimizer.state[p]["momentum_buffer"] for p in params]
    aliased = model[2].weight.untyped_storage().data_ptr()
    kept = model[0].bias.detach()  # held by the caller: the bias stays where it is

    skeleton, storages, copies = parts.shipped().__dict__["_sent"]
    assert list(model.parameters()) == params and [parts.optimizer.state[p]["momentum_buffer"] for p in params] == momentum
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    moved = [params[0], *params[2:4], *momentum, model[1].running_mean, model[1].num_batches_tracked]
    assert all(t.untyped_storage().is_shared() for t in moved)
    assert model[2].weight.untyped_storage().data_ptr() == aliased and not model[2].weight.untyped_storage().is_shared()
    assert kept.data_ptr() == model[0].bias.data_ptr() and not kept.untyped_storage().is_shared()
    # The model's float32 and int64 buffers and the optimizer's float32 buffer; the aliased pair and the bias as copies.
    assert len(storages) == 3 and len(copies) == 3
    assert {s.data_ptr() for s in storages} == {t.untyped_storage().data_ptr() for t in moved}  # the tensors' own memory
    state = shared_state._unpack(skeleton, storages, copies)
    assert state.model.keys() == before.keys() and all(torch.equal(before[k], v) for k, v in state.model.items())
    assert all(torch.equal(m, state.optimizer["state"][i]["momentum_buffer"]) for i, m in enumerate(momentum))
    assert {t.untyped_storage().data_ptr() for t in state.model.values()} - {c.untyped_storage().data_ptr() for c in copies} <= {s.data_ptr() for s in storages}

    where = [t.data_ptr() for t in moved]
    parts.shipped()
    assert [t.data_ptr() for t in moved] == where  # moved once


@pytest.mark.fast
def test_the_jobs_pickle_is_the_models_structure_not_its_weights() -> None:
    """Every worker loads the fit's starting state into its model before training, so the job
    goes with blanks (uninitialised, never read before that load) where the state dict's tensors
    are: a few KiB for a 4 MiB model. What is not in the state dict (a plain tensor attribute)
    goes by value, and a Parameter keeps its class, requires_grad and attributes."""
    model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024))
    model[0].weight.no_decay = True  # type: ignore[assignment]
    model[0].bias.requires_grad_(False)
    model.scale = torch.full((3,), 2.0)  # type: ignore[assignment]
    with ParallelWrapper.builder(model).workers(2).build() as w:
        job = w._job
    payload = _shared_pickle(job)
    assert payload.numel() < 64 * 1024 < 4 * 2**20
    sent = _unpickle_job(payload).model
    assert isinstance(sent, nn.Sequential)
    weight, bias = sent[0].weight, sent[0].bias
    assert type(weight) is nn.Parameter and weight.shape == (1024, 1024) and weight.no_decay
    assert weight.requires_grad and not bias.requires_grad
    assert torch.equal(sent.scale, model.scale) and sent[1].running_var.shape == (1024,)
    sent.load_state_dict(model.state_dict())  # what a worker's start does
    assert all(torch.equal(a, b) for a, b in zip(sent.state_dict().values(), model.state_dict().values(), strict=True))


# A step's worth of tensor buffers, taken from malloc as torch's CPU allocator takes them, written
# and freed, 10 times: minor page faults per step, printed. Raw malloc rather than torch.ones: a
# tensor's own small allocations land between the buffers at places that change from run to run,
# and with them whether glibc trims (25.6 to 6,600 faults a step for the same torch.ones loop).
_STEPS = """
import ctypes, resource, sys
from parallelwrapper.processes import adopt_environment
if sys.argv[1] == "worker":
    adopt_environment({})
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
sizes = [1 << 18] * 100 + [1 << 20]  # 100 x 256 KiB, 1 MiB
def step():
    blocks = [libc.malloc(n) for n in sizes]
    for block, n in zip(blocks, sizes):
        libc.memset(block, 1, n)
    for block in blocks:
        libc.free(block)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def faults_a_step(process: str) -> float:
    done = subprocess.run([sys.executable, "-c", _STEPS, process], capture_output=True, text=True, timeout=60, check=True)
    return float(done.stdout)


def test_a_worker_process_keeps_its_heap_from_step_to_step() -> None:
    """glibc, left to itself, gives a step's freed tensors back to the kernel and faults them in
    again at the next step; a worker process (adopt_environment) keeps them mapped."""
    default, worker = faults_a_step("plain"), faults_a_step("worker")
    assert default > 1000, f"{default} faults a step without keep_heap: the pattern no longer sets glibc off"
    assert worker < default / 20, f"{worker} faults a step in a worker against {default} in a plain process"


@pytest.mark.fast
def test_the_environments_heap_settings_win() -> None:
    assert not keep_heap({"PW_KEEP_HEAP": "0"})
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        assert not keep_heap({name: "1"})
