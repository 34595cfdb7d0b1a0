"""Two-level averaging under torchrun (`.hierarchy("node")`): a node's ranks step together on gradients averaged over the node.

Nodes average every k steps, as workers do without a hierarchy. The node's replicas stay equal, and
only the nodes average, once a round, across the slow link: each node is one worker of the round
protocol (its ranks a rounds.Lockstep group, node.py), its ranks splitting the state's exchange
across nodes (averaging.Shards), so every byte crosses between nodes once and no rank idles.

The rest of the package asks this package's `Nodes` (feature.Feature, which `of` makes) and names
none of its classes: under torchrun, a rank's seat is its group across nodes and its node, made by
every rank alike; elsewhere it changes nothing but the feed (its ranks do not step alone).
"""

from __future__ import annotations

import torch.distributed as dist

from ..config import Config
from ..env import Placement
from ..feature import Feature, Over, Seat
from ..job import Job
from .node import Node


class Nodes(Over):
    """The hierarchy as a feature: under torchrun, each node's ranks one worker of the round protocol."""

    @property
    def alone(self) -> bool:
        return False  # a node's ranks step together

    def notes(self, torchrun: bool) -> tuple[str, ...]:
        here = () if torchrun else ("hierarchy('node') applies under torchrun with several processes per node; these workers average as one group",)
        return here + self.rest.notes(torchrun)

    def seat(self, job: Job, config: Config, placement: Placement, process: int, group: dist.ProcessGroup | None) -> Seat:
        """Under torchrun with several processes per node: the rank's group across nodes and its
        node; else the seat of the feature below."""
        env = placement.torchrun
        joined = None if env is None else join(env.rank, env.world_size, env.local_world_size)
        if joined is None:
            return self.rest.seat(job, config, placement, process, group)
        across, node = joined
        return Seat(job, process, group=across, lockstep=node, together=node.group)  # a node's ranks choose alike


def join(rank: int, world: int, per_node: int) -> tuple[dist.ProcessGroup, Node] | None:
    """With several processes per node: this rank's group across nodes (the ranks of every node
    with its local rank) and its node. torchrun numbers ranks node by node. Every rank creates
    every group, in the same order, as new_group requires."""
    if per_node == 1:
        return None  # one process per node: the same as flat averaging
    if world % per_node:
        raise ValueError(f"hierarchy('node') needs the same processes on every node: {world} ranks, {per_node} on this one")
    nodes = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(world // per_node)]
    across = [dist.new_group(list(range(j, world, per_node))) for j in range(per_node)]
    return across[rank % per_node], Node(nodes[rank // per_node], per_node, rank % per_node)


def of(config: Config, rest: Feature) -> Feature:
    """The hierarchy over `rest`, when `config` asks for one."""
    return rest if config.hierarchy == "none" else Nodes(rest)


__all__ = ["Nodes", "of"]
