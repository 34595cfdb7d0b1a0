"""A node's side of a round's local work (`.hierarchy("node")`): its ranks step in lockstep on gradients averaged over the node.

Each step every rank of the node sends its gradients (and buffers) scaled by its batch's sample
count, with a trailer of [samples, has a batch, loss·n, its feed ended]; a rank without a batch
sends zeros and still steps on the node's average. The round's local work ends after k steps, or
at the first step where no rank of the node had a batch: then the whole node has finished its
epoch. The work a node reports in the round's header is the node's, the same on each of its
ranks, so the across-nodes sums count every batch once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..averaging import FlatAverager, Shards
from ..rounds.lockstep import StepsTaken
from ..rounds.state import gradient_tensors
from ..rounds.trainer import Trainer
from ..types import Batch


@dataclass(frozen=True)
class Node:
    """This worker's node: its ranks' process group, how many they are, and this one's local
    rank; to the round engine, a rounds.Lockstep group."""

    group: dist.ProcessGroup
    size: int
    index: int

    @property
    def shards(self) -> Shards:
        """Each rank of the node all-reduces its part of the state across nodes."""
        return Shards(self.group, self.size, self.index)

    def steps(self, trainer: Trainer, device: torch.device) -> NodeSteps:
        return NodeSteps(self, trainer, device)


class NodeSteps:
    """One rank's side of its node's lockstep steps."""

    TRAILER = 4

    def __init__(self, node: Node, trainer: Trainer, device: torch.device) -> None:
        self.node, self.trainer, self.device = node, trainer, device
        self._payload: FlatAverager | None = None

    def _gradients(self) -> FlatAverager:
        if self._payload is None:
            self._payload = FlatAverager(gradient_tensors(self.trainer.model, self.trainer.optimizer), self.device, self.TRAILER)
        return self._payload

    def release(self) -> None:
        if self._payload is not None:
            self._payload.release()
            self._payload = None

    def run(self, steps: int, first_step: int, epoch: int, next_batch: Callable[[], tuple[int, Batch] | None], finished: Callable[[], bool]) -> StepsTaken:
        """Up to `steps` lockstep steps, global steps `first_step` on; the node's work."""
        work = StepsTaken()
        payload = self._gradients()
        for j in range(steps):
            item = next_batch()
            self.trainer.optimizer.zero_grad(set_to_none=False)  # zeros in the payload's buffer
            loss, n = self.trainer.accumulate(epoch, *item) if item is not None else (None, 0)
            trailer = [float(n), float(item is not None), 0.0 if loss is None else float(loss), float(finished())]
            payload.send(float(n), trailer, self.node.group)
            samples, batches, loss_sum, _ = payload.wait()
            if batches == 0:  # nobody in the node had a batch: its epoch is over
                payload.discard()
                work.finished = True
                break
            payload.apply(1.0 / samples)
            self.trainer.at_step(first_step + j)  # every rank of the node, with a batch or without
            self.trainer.step()
            work.samples, work.loss_sum, work.batches = work.samples + int(samples), work.loss_sum + loss_sum, work.batches + int(batches)
            work.steps += 1
        return work


__all__ = ["Node", "NodeSteps"]
