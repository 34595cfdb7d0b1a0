"""A coded payload's exchange over a process group: each rank's pieces sent to every other rank, decoded once all are in.

codec.py encodes and decodes. The pieces go by sends and receives (on gloo, twice as fast as an
all_gather of the same bytes); the few numbers of a round's trailer go beside them, summed exactly
in float64. Knows nothing of the protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .codec import DeltaCoder


@dataclass
class Flight:
    """A group's collectives in flight: an all-reduce of `buffer`, or (None) a coded round's, per piece."""

    works: list[list[dist.Work]]
    buffer: torch.Tensor | None


def send_coded(coder: DeltaCoder, scale: float, group: dist.ProcessGroup | None) -> list[list[dist.Work]]:
    """Encode the coder's change times `scale` and send each piece to every other rank of the
    group, receiving theirs into its inbox: per piece, the sends and receives in flight."""
    peers = [(r, r if group is None else dist.get_global_rank(group, r)) for r in range(coder.ranks) if r != coder.rank]
    payloads = list(coder.encode(scale))  # all, then sent: sending while encoding slowed both on 2 cores
    ops = [[dist.P2POp(op, t, peer, group, i) for r, peer in peers for op, t in ((dist.isend, p), (dist.irecv, coder.inbox[i][r]))] for i, p in enumerate(payloads)]
    return [dist.batch_isend_irecv(o) if o else [] for o in ops]


def decode_coded(coder: DeltaCoder, works: list[list[dist.Work]], alpha: float) -> None:
    """Each piece, once every rank's payload of it is in: start + alpha · Σ decoded."""
    for piece, piece_works in enumerate(works):
        for work in piece_works:
            work.wait()
        coder.decode(piece, alpha)


def drop_coded(works: list[list[dist.Work]]) -> None:
    """Wait for a coded round's sends and receives, and decode nothing (nobody trained)."""
    for piece_works in works:
        for work in piece_works:
            work.wait()


def send_trailer(trailer: Sequence[float] | None, length: int, device: torch.device, group: dist.ProcessGroup | None) -> tuple[dist.Work, torch.Tensor]:
    """A coded round's trailer, summed exactly in float64 beside the payload (zeros when None)."""
    values = torch.tensor(list(trailer or [0.0] * length), dtype=torch.float64, device=device)
    work = dist.all_reduce(values, group=group, async_op=True)
    assert work is not None
    return work, values


def wait_trailer(sent: tuple[dist.Work, torch.Tensor]) -> list[float]:
    sent[0].wait()
    return sent[1].tolist()


__all__ = ["Flight", "decode_coded", "drop_coded", "send_coded", "send_trailer", "wait_trailer"]
