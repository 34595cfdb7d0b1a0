"""A coded payload's exchange over a process group: each rank's pieces sent to every other rank, decoded once all are in.

codec.py encodes and decodes. The pieces go by sends and receives (on gloo, twice as fast as an
all_gather of the same bytes); the few numbers of a round's trailer go beside them, summed exactly
in float64. Knows nothing of the protocol.

The rounds' sends and receives (coded payloads, threshold-encoded gradients) go through
`point_to_point`: gloo's sends and receives read and write host memory only (a CUDA tensor's
address handed to its socket fails with "writev: Bad address"), where its all-reduce takes a CUDA
tensor. So on gloo, as when workers share a GPU, a GPU tensor goes through a copy on the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .codec import DeltaCoder


@dataclass
class Flight:
    """A group's collectives in flight: an all-reduce of `buffer`, or (None) a coded round's, per piece."""

    works: list[list[Sending]]
    buffer: torch.Tensor | None


def size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """The size of `group` (None: the default group) and this process's rank in it, as a
    DeltaCoder takes them. A group made apart from the default one (hosts/inprocess.py's group
    of one) answers itself: dist.get_rank(group) asks the default group, which may not exist."""
    return (dist.get_world_size(), dist.get_rank()) if group is None else (group.size(), group.rank())


class _ViaHost:
    """A send or receive of a device tensor through a copy on the host (`point_to_point`): its
    wait() lands a receive's copy in the device tensor."""

    def __init__(self, work: dist.Work, host: torch.Tensor, into: torch.Tensor | None) -> None:
        self.work, self.host, self.into = work, host, into  # host: kept alive until the work is done

    def wait(self) -> bool:
        self.work.wait()
        if self.into is not None:
            self.into.copy_(self.host)
        return True


Sending = dist.Work | _ViaHost  # a send or receive in flight: wait() for it


def via_host(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether a send or receive of `tensor` over `group` must go through a copy on the host."""
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


def point_to_point(ops: Sequence[tuple[bool, torch.Tensor, int, int]], group: dist.ProcessGroup | None) -> list[Sending]:
    """Start sends (True) and receives (False) of (tensor, global peer rank, tag) over `group`:
    those in flight, to wait() for. On gloo a tensor off the CPU goes through a host copy."""
    if not ops:
        return []
    hosted = via_host(ops[0][1], group)
    pinned = hosted and ops[0][1].is_cuda
    wired = [(t.to("cpu") if send else torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)) if hosted else t for send, t, _, _ in ops]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, w, peer, group, tag) for (send, _, peer, tag), w in zip(ops, wired, strict=True)])
    if not hosted:
        return list(works)
    assert len(works) == len(ops), "gloo answers each send and receive with its own work"
    return [_ViaHost(work, h, None if send else t) for work, h, (send, t, _, _) in zip(works, wired, ops, strict=True)]


def send_coded(coder: DeltaCoder, scale: float, group: dist.ProcessGroup | None) -> list[list[Sending]]:
    """Encode the coder's change times `scale` and send each piece to every other rank of the
    group, receiving theirs into its inbox: per piece, the sends and receives in flight."""
    peers = [(r, r if group is None else dist.get_global_rank(group, r)) for r in range(coder.ranks) if r != coder.rank]
    payloads = list(coder.encode(scale))  # all, then sent: sending while encoding slowed both on 2 cores
    return [point_to_point([op for r, peer in peers for op in ((True, p, peer, i), (False, coder.inbox[i][r], peer, i))], group) for i, p in enumerate(payloads)]


def decode_coded(coder: DeltaCoder, works: list[list[Sending]], alpha: float) -> None:
    """Each piece, once every rank's payload of it is in: start + alpha · Σ decoded."""
    for piece, piece_works in enumerate(works):
        for work in piece_works:
            work.wait()
        coder.decode(piece, alpha)


def drop_coded(works: list[list[Sending]]) -> None:
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


def wait_sums(flights: Sequence[Flight]) -> None:
    """Wait for the all-reduces in flight (a coded flight's pieces are waited for as each decodes)."""
    for flight in flights:
        if flight.buffer is not None:
            flight.works[0][0].wait()


def trailer_sums(flights: Sequence[Flight], coded: tuple[dist.Work, torch.Tensor] | None, data_numel: int, length: int) -> list[float]:
    """After wait_sums, the trailer's sums: a coded round's, sent beside its pieces (`coded`:
    send_trailer's), else the `length` numbers after the data in the first flight's buffer. The
    averagers' wait() (averaging.py, delta_averaging.py) is these two."""
    if coded is not None:
        return wait_trailer(coded)
    buffer = flights[0].buffer
    assert buffer is not None
    return buffer[data_numel : data_numel + length].tolist()  # (length,)


__all__ = ["Flight", "Sending", "decode_coded", "drop_coded", "point_to_point", "send_coded", "send_trailer", "size_and_rank", "trailer_sums", "wait_sums", "wait_trailer"]
