"""A gradient round's payload threshold-encoded (`.gradient_encoding`), behind the same calls as a FlatAverager's.

The maths is threshold.py's; exchange.SyncExchange runs it as it runs the dense gradients, and the
engine does not know which one runs.

    send    a worker that trained adds lr × its gradients (each parameter at its group's lr) to
            its residual and encodes it; then one float64 all-reduce of [the round's header |
            senders, entries sent | each rank's message length (its own slot)] starts, beside
            the buffers' dense all-reduce (BatchNorm statistics) when the model has any
    wait    the header's sums; the lengths known, each message goes to every other rank by
            sends and receives of exactly its length (an empty message: none)
    apply   every rank decodes the messages in rank order and divides the sum by the senders:
            the same average update Δ, in parameter units, on every worker; the gradients become
            Δ / lr, so that the optimizer's step (SGD: −lr · Δ / lr) applies Δ. Sparse messages go
            straight into the zeroed gradients, entry by entry; a bitmap among them, through one
            flat sum. τ then moves by the measured density, the same on every worker, and the
            residual is clipped when due

The update is lr × gradient, not the optimizer's own update: the optimizer then steps on the
same averaged gradients on every worker, so its state (momentum, Adam's moments) stays equal
across replicas and in one checkpoint, and clipping, `before_step` and schedules see gradients
as they do without encoding. τ is in parameter units, as DL4J's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..averaging import FlatAverager
from ..config import GradientEncoding
from ..threshold import Residual, decode_add_, encode_, is_bitmap, scratch, sparse_entries
from ..types import EncodingStats
from ..wire import Sending, point_to_point, send_trailer, size_and_rank, wait_trailer
from .state import gradient_tensors, trained_parameters

_META = 2  # after the header: senders, entries sent; then one message length per rank


@dataclass
class _Flight:
    meta: tuple[dist.Work, torch.Tensor]
    message: torch.Tensor  # this rank's, int32
    group: dist.ProcessGroup | None
    works: list[Sending] | None = None  # the messages' sends and receives, once the lengths are in
    received: list[torch.Tensor] | None = None  # every rank's message, in rank order
    sums: list[float] | None = None


class EncodedGradients:
    """One worker's gradients, sent threshold-encoded with its residual; the buffers go dense."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, residual: Residual, settings: GradientEncoding, device: torch.device, trailer: int) -> None:
        self.params = trained_parameters(model, optimizer)
        tensors = gradient_tensors(model, optimizer)  # allocates the gradients that are None
        self.grads, buffers = tensors[: len(self.params)], tensors[len(self.params) :]
        self._buffers = FlatAverager(buffers, device) if buffers else None
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self._groups = [group_of[id(p)] for p in self.params]
        self.residual, self.settings, self.device, self._trailer = residual, settings, device, trailer
        self._slices = _slices(self.params)
        self._starts = torch.tensor([lo for lo, _ in self._slices] + [self.numel], device=device)  # (params + 1,)
        self._scratch = scratch(self.numel, device)
        self._update: torch.Tensor | None = None  # for bitmaps: the decoded sum, flat
        self._flight: _Flight | None = None
        self.last: EncodingStats | None = None  # the last round applied

    @property
    def numel(self) -> int:
        return self.residual.values.numel()

    def _lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self._groups]

    @torch.no_grad()
    def send(self, scale: float, trailer: Sequence[float] | None = None, group: dist.ProcessGroup | None = None) -> None:
        """A worker that trained (scale > 0) adds lr × its gradients to its residual and encodes it;
        the meta all-reduce (the header and the messages' lengths) starts."""
        assert self._flight is None, "wait() for the previous round first"
        sender, self.last = scale > 0, None
        message, count = torch.empty(0, dtype=torch.int32, device=self.device), 0
        if sender:
            values = self.residual.values
            for grad, lr, (lo, hi) in zip(self.grads, self._lrs(), self._slices):
                values[lo:hi].add_(grad.reshape(-1), alpha=lr)
            message, count = encode_(values, self.residual.threshold, self._scratch)
        size, rank = size_and_rank(group)
        lengths = [0.0] * size
        lengths[rank] = float(message.numel())
        meta = [*(trailer or [0.0] * self._trailer), float(sender), float(count), *lengths]
        self._flight = _Flight(send_trailer(meta, len(meta), self.device, group), message, group)
        if self._buffers is not None:
            self._buffers.send(scale, group=group)

    def wait(self) -> list[float]:
        """The header's sums; the messages go to every rank, each exactly its length."""
        flight = self._flight
        assert flight is not None
        flight.sums = wait_trailer(flight.meta)
        group = flight.group
        size, rank = size_and_rank(group)
        lengths = [round(x) for x in flight.sums[self._trailer + _META :]]
        flight.received = [flight.message if r == rank else torch.empty(lengths[r], dtype=torch.int32, device=self.device) for r in range(size)]
        ops = []
        for r in range(size):
            if r == rank:
                continue  # (a group made apart from the default one knows no global rank: a worker alone's)
            peer = r if group is None else dist.get_global_rank(group, r)
            if flight.message.numel():
                ops.append((True, flight.message, peer, 0))
            if lengths[r]:
                ops.append((False, flight.received[r], peer, 0))
        flight.works = point_to_point(ops, group)
        if self._buffers is not None:
            self._buffers.wait()
        return flight.sums[: self._trailer]

    def _landed(self) -> _Flight:
        flight, self._flight = self._flight, None
        assert flight is not None and flight.works is not None and flight.sums is not None, "wait() first"
        for work in flight.works:
            work.wait()
        return flight

    @torch.no_grad()
    def apply(self, scale: float) -> None:
        """Every rank's message decoded in rank order and averaged over the senders, as the
        gradients Δ / lr; τ moves and the residual is clipped when due. `scale` goes to the
        buffers (the sample-weighted average); the update is the senders' plain mean."""
        flight = self._landed()
        assert flight.received is not None and flight.sums is not None
        senders, entries = flight.sums[self._trailer : self._trailer + _META]
        alpha = self.residual.threshold / senders if senders > 0 else 0.0
        if all(g.is_contiguous() for g in self.grads) and not any(is_bitmap(m, self.numel) for m in flight.received):
            self._scatter(flight.received, alpha)
        else:
            self._decode_dense(flight.received, alpha)
        if self._buffers is not None:
            self._buffers.apply(scale)
        density = entries / (senders * self.numel) if senders > 0 and self.numel else float("nan")
        self.residual.stepped(density, self.settings)
        self.last = EncodingStats(self.residual.threshold, density, self._bytes_sent(flight), 1)

    def _scatter(self, messages: list[torch.Tensor], alpha: float) -> None:
        """Sparse messages: each entry adds ±alpha / lr to its parameter's zeroed gradient, message
        after message in rank order (one pass over the gradients, to zero them)."""
        lrs = self._lrs()
        for grad in self.grads:
            grad.zero_()
        for message in messages:
            index, sign = sparse_entries(message)  # ascending
            cuts = torch.searchsorted(index, self._starts).tolist()  # where each parameter's entries start
            for grad, lr, a, b, (lo, _) in zip(self.grads, lrs, cuts, cuts[1:], self._slices):
                if a < b and lr > 0:
                    grad.view(-1).index_add_(0, index[a:b] - lo, sign[a:b], alpha=alpha / lr)

    def _decode_dense(self, messages: list[torch.Tensor], alpha: float) -> None:
        """A bitmap among the messages: all decoded into one flat sum, then the gradients are it / lr."""
        if self._update is None:
            self._update = torch.empty(self.numel, device=self.device)
        update = self._update.zero_()
        for message in messages:
            decode_add_(message, update, alpha, self._scratch[0])  # the magnitudes' buffer is free after encode_
        for grad, lr, (lo, hi) in zip(self.grads, self._lrs(), self._slices):
            torch.mul(update[lo:hi].view_as(grad), 1 / lr if lr > 0 else 0.0, out=grad)

    def discard(self) -> None:
        """Nobody trained: the (empty) messages are dropped."""
        self._landed()
        if self._buffers is not None:
            self._buffers.discard()

    def release(self) -> None:
        if self._buffers is not None:
            self._buffers.release()

    def _bytes_sent(self, flight: _Flight) -> float:
        """What each worker sent in this round, on average: its message to each of the N − 1
        others, and its share of the ring all-reduces (2(N − 1)/N of each buffer): the meta in
        float64 and the buffers."""
        assert flight.received is not None and flight.sums is not None
        n = len(flight.received)
        messages = sum(m.numel() * 4 for m in flight.received) * (n - 1) / n
        reduced = len(flight.sums) * 8 + (0 if self._buffers is None else self._buffers.nbytes)
        return messages + 2 * (n - 1) / n * reduced


def _slices(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each parameter's [lo, hi) in the flat residual, end to end in the model's order."""
    out, offset = [], 0
    for p in params:
        out.append((offset, offset + p.numel()))
        offset += p.numel()
    return out


__all__ = ["EncodedGradients"]
