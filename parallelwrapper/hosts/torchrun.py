"""torchrun: this process as one rank of a group that torchrun started, on this machine or on many.
torchrun's variables say the rank and the node's share of processes (env.resolve); the
worker reads its own batches of the data (feed.source: claimed first-come, or its dealt shard),
and runs the shared runtime. Its first fit() starts every rank from rank 0's state (`from_rank_0`).

Every incarnation of a group that torchrun restarts (--max-restarts) joins under keys of its own
in torchrun's store (`_join`), agrees whether to resume from the last checkpoint, and watches its
peers (heartbeat.py): a lost peer ends this process within peer_timeout.

The signals torchrun sends its workers when it stops them (SIGTERM; SIGINT from a terminal)
finish the round in flight and save it when checkpoints are on, as Ctrl-C does for spawned
workers; then the signal takes effect.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import re
import signal
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore, rendezvous  # type: ignore[attr-defined]

from .. import feed
from ..batches import map_leaves
from ..checkpoint import path_of
from ..config import Config
from ..env import Placement, TorchrunEnv, claim_device, collective_timeout
from ..errors import WorkerError
from ..feature import Feature, Plain
from ..feed.claims import StoreCounter, claimed
from ..feed.data import Batches
from ..job import Job
from ..messages import FitCommand
from ..types import Reporter, TrainingState
from .heartbeat import Heartbeat
from .runtime import SignalHooks, Worker, stop_on_signals

_KEYS = "parallelwrapper"
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe")  # gloo's words for a peer's closed sockets


def _join(config: Config, env: TorchrunEnv) -> tuple[TCPStore, str, bool]:
    """torchrun's store, this incarnation's key prefix in it, and whether to resume.

    torchrun hands every incarnation of a restarted group the same store, its agent's, at the same
    MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), and env:// keys are not prefixed
    by incarnation: a restarted group's gloo would read the previous incarnation's addresses there
    and fail in connectFullMesh with 'Connection refused'. So rank 0 takes a new generation number
    and tells it to each peer in answer to a token only that peer knows: no stale key can pass for a
    fresh one. The same exchange agrees on resuming, since the agents' restart counts may differ (an
    agent whose workers were healthy when a peer node rejoined restarts them without counting)."""
    timeout = collective_timeout(config)
    store, _, _ = next(rendezvous("env://", env.rank, env.world_size, timeout=timeout))  # MASTER_ADDR, MASTER_PORT
    if env.rank != 0:
        token = uuid.uuid4().hex
        store.set(f"{_KEYS}/hello/{env.rank}", token)
        generation = int(store.get(f"{_KEYS}/welcome/{token}"))
        store.set(f"{_KEYS}/{generation}/here/{env.rank}", str(env.restarts))
        return store, f"{_KEYS}/{generation}", store.get(f"{_KEYS}/{generation}/resume") == b"1"
    generation = store.add(f"{_KEYS}/generation", 1)
    restarted, pending, welcomed = env.restarts > 0, set(range(1, env.world_size)), dict[int, bytes]()
    deadline = time.monotonic() + timeout.total_seconds()
    while pending:
        for r in sorted(pending):
            here, hello = f"{_KEYS}/{generation}/here/{r}", f"{_KEYS}/hello/{r}"
            if store.check([here]):
                restarted |= int(store.get(here)) > 0
                pending.discard(r)
            elif store.check([hello]) and (said := store.get(hello)) != welcomed.get(r):
                store.set(f"{_KEYS}/welcome/{said.decode()}", str(generation))  # a stale token's answer is never read
                welcomed[r] = said
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 waited {timeout.total_seconds():g} s for ranks {sorted(pending)} to join: are their torchrun agents running?")
        time.sleep(0.01)
    resume = restarted and config.auto_resume and config.checkpoint_dir is not None and path_of(config.checkpoint_dir).is_file()
    store.set(f"{_KEYS}/{generation}/resume", "1" if resume else "0")
    return store, f"{_KEYS}/{generation}", resume


def from_rank_0(state: TrainingState) -> TrainingState:
    """Rank 0's state, on every rank of the default group. Each rank built its own model (drawn
    unseeded, or loaded differently), so the ranks would start apart: a first round averaging
    unrelated models (a NaN loss, at times), and params at lr 0, which no round averages, apart
    for good. So, as DDP does at construction, the first fit() starts every rank from rank 0's
    model, optimizer and schedule, unless every rank's digest of its state is rank 0's already
    (ranks seeded alike), which costs 32 bytes a rank instead of the state (22 MB is some 3.7 s at
    48 Mbit/s). The state is on the CPU (Parts.state), and pickling keeps its bits: a
    resumed run, which every rank loaded alike, is unchanged. Under NCCL,
    broadcast_object_list carries the bytes on the current CUDA device, which claim_device set."""
    digests: list[bytes | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _digest(state))
    if all(d == digests[0] for d in digests):
        return state  # every rank holds rank 0's state already (seeded alike): the broadcast would send it again
    box: list[TrainingState | None] = [state if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def _digest(state: TrainingState) -> bytes:
    """A SHA-256 of the state's structure and every tensor's bits (states equal bit for bit have
    equal digests), so that ranks compare 32 bytes instead of sending the state."""
    tensors: list[torch.Tensor] = []

    def meta(leaf: object) -> object:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf)
        return (str(leaf.dtype), tuple(leaf.shape))

    h = hashlib.sha256(repr(map_leaves(dataclasses.astuple(state), meta)).encode())
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


class TorchrunWorker:
    """The host interface (`fit`, `close`, `kill`) for this process in a torchrun group."""

    def __init__(self, config: Config, job: Job, placement: Placement, feature: Feature | None = None) -> None:
        """`feature`: the config's (features.of; None: Plain), which says what this rank trains in
        which groups (with .hierarchy("node"), its node; with a pipeline, this rank is stage
        rank % S of worker rank // S, whose ranks are on one node)."""
        feature = feature or Plain()
        env = placement.torchrun
        assert env is not None, "TorchrunWorker outside torchrun"
        self._rank, self._world = env.rank, env.world_size
        claim_device(placement, env.local_rank, config.deterministic)
        # The caller may have joined the group itself (to use it beside the wrapper): then it is
        # theirs, and neither the resume nor the heartbeat is ours to decide.
        self._owns_group = not dist.is_initialized()
        self._heartbeat: Heartbeat | None = None
        self.resume_point: str | None = None  # the checkpoint a restarted group's first fit() resumes from
        self._claims: PrefixStore | None = None  # where ranks claim their batches first-come (feed/claims.py)
        self._fits = 0
        if self._owns_group:
            store, prefix, resume = _join(config, env)
            if claimed(config, feature.alone):
                self._claims = PrefixStore(f"{prefix}/claims", store)
            dist.init_process_group(
                placement.backend, store=PrefixStore(prefix, store), rank=env.rank, world_size=env.world_size,
                timeout=collective_timeout(config),
            )  # fmt: skip
            self.resume_point = config.checkpoint_dir if resume else None
            if env.world_size > 1:  # alone, there is no peer to lose
                host, port, beat_timeout = store.host, store.port, datetime.timedelta(seconds=config.peer_timeout)
                self._heartbeat = Heartbeat(lambda: TCPStore(host, port, is_master=False, timeout=beat_timeout), f"{host}:{port}",
                                            f"{prefix}/heartbeat", env.rank, env.world_size, config.peer_timeout)  # fmt: skip
        self._hooks = SignalHooks()
        self._job, self._workers = job, placement.world_size
        self._worker = Worker(job, config, placement, env.rank, env.local_rank, hooks=self._hooks, feature=feature)
        self._started = False  # whether a fit() has made every rank's state rank 0's

    def fit(self, command: FitCommand, data: Batches, on_report: Reporter) -> TrainingState:
        """Train this rank's shard; return the final state (model, optimizer, schedule), the same on every rank."""
        if not self._started:
            command = dataclasses.replace(command, state=from_rank_0(command.state))
            self._started = True
        counters = command.counters
        self._fits += 1  # every rank counts its fits alike: the key of this fit's claims
        counter = None if self._claims is None else StoreCounter(self._claims, f"fit-{self._fits}")
        source = feed.source(data, self._worker.rank, self._workers, counters, command.until_epoch, counter, command.order)
        with stop_on_signals(self._hooks, (signal.SIGINT, signal.SIGTERM), on_report) as report:
            try:
                until_epoch = self._worker.start(command)
                del command  # loaded: the copy of the state goes now, not at the fit's end
                self._worker.train(until_epoch, source, report)
            except WorkerError as e:
                if not PEER_GONE.search(e.summary):
                    raise
                hint = (
                    "; a peer rank's process is gone (killed, or failed: its own error is in its log): torchrun's "
                    "--max-restarts with .checkpoint(dir) restarts the group and resumes from the last checkpoint"
                )
                raise WorkerError(e.rank, e.summary + hint, e.details, e.where, e.at, e.stage) from None  # the same error, with the hint: its traceback once
        return self._worker.replica.whole_state()

    def close(self) -> None:
        """Leave the group, if this host joined it."""
        if self._heartbeat is not None:
            self._heartbeat.close()
            self._heartbeat = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    kill = close  # after a failure the group may be broken: the next fit() joins a new one
