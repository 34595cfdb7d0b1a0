"""torchrun: this process is one worker of a group that torchrun started, on this machine or on
many. torchrun's variables say the rank and the node's share of processes (env.resolve); the
worker reads its own shard of the data (feed.ShardSource), and runs the shared runtime.

The signals torchrun sends its workers when it stops them (SIGTERM; SIGINT from a terminal)
finish the round in flight and save it when checkpoints are on, as Ctrl-C does for spawned
workers; then the signal takes effect.
"""

from __future__ import annotations

import signal

import torch.distributed as dist

from ..checkpoint import make_checkpointer
from ..config import Config, Job
from ..env import Placement, collective_timeout
from ..feed import Batches, ShardSource
from ..rounds import Node
from ..types import FitCommand, Reporter, TrainingState
from .runtime import SignalHooks, Worker, claim_device, stop_on_signals


def _hierarchy(config: Config, rank: int, world: int, per_node: int) -> tuple[dist.ProcessGroup | None, Node | None]:
    """With hierarchy('node') and several processes per node: this rank's group across nodes (the
    ranks of every node with its local rank) and its node. torchrun numbers ranks node by node.
    Every rank creates every group, in the same order, as new_group requires."""
    if config.hierarchy != "node" or per_node == 1:
        return None, None  # one process per node: the same as flat averaging
    if world % per_node:
        raise ValueError(f"hierarchy('node') needs the same processes on every node: {world} ranks, {per_node} on this one")
    nodes = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(world // per_node)]
    across = [dist.new_group(list(range(j, world, per_node))) for j in range(per_node)]
    return across[rank % per_node], Node(nodes[rank // per_node], per_node, rank % per_node)


class TorchrunWorker:
    """The host interface (`fit`, `close`, `kill`) for this process in a torchrun group."""

    def __init__(self, config: Config, job: Job, placement: Placement) -> None:
        env = placement.torchrun
        assert env is not None, "TorchrunWorker outside torchrun"
        self._rank, self._world = env.rank, env.world_size
        claim_device(placement, env.local_rank)
        # The caller may have joined the group itself (to use it beside the wrapper): then it is theirs.
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(placement.backend, timeout=collective_timeout(config))
        self._hooks = SignalHooks(make_checkpointer(config, job, env.world_size))
        group, node = _hierarchy(config, env.rank, env.world_size, env.local_world_size)
        self._worker = Worker(job, config, placement, env.rank, env.local_rank, group=group, hooks=self._hooks, node=node)

    def fit(self, command: FitCommand, data: Batches, on_report: Reporter) -> TrainingState:
        """Train this rank's shard; return the final state (model, optimizer, schedule), the same on every rank."""
        counters = command.counters
        source = ShardSource(data, self._rank, self._world, counters.epoch, counters.position)
        with stop_on_signals(self._hooks, (signal.SIGINT, signal.SIGTERM)):
            self._worker.fit(command, source, on_report)
        return self._worker.replica.state_dicts()

    def close(self) -> None:
        """Leave the group, if this host joined it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    kill = close  # after a failure the group may be broken: the next fit() joins a new one
