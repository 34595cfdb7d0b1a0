"""Two-level averaging under torchrun (`.hierarchy("node")`): a node's ranks step together on gradients averaged over the node.

Nodes average every k steps, as workers do without a hierarchy. The node's replicas stay equal, and
only the nodes average, once a round, across the slow link: each node is one worker of the round
protocol (its ranks a rounds.Lockstep group, node.py), its ranks splitting the state's exchange
across nodes (averaging.Shards), so every byte crosses between nodes once and no rank idles.

The torchrun host asks this package one thing, and names none of its classes: `join`, this rank's
process group across nodes and its node, made by every rank alike.
"""

from __future__ import annotations

import torch.distributed as dist

from ..config import Config
from .node import Node


def join(config: Config, rank: int, world: int, per_node: int) -> tuple[dist.ProcessGroup | None, Node | None]:
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


__all__ = ["join"]
