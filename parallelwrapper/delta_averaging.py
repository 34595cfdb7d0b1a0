"""Averaging in the background (`.overlap_averaging(True)`): a snapshot summed while the worker trains on, landed a round later.

The snapshot's tensors are summed over the process group, and the average lands with the steps taken
since kept on top of it. Flat buffers per dtype and an opaque trailer, as in averaging.py; knows no
queue and no protocol flag."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .averaging import ProcessGroup, by_dtype, flat_buffer, put_trailer, views
from .codec import DeltaCoder, uncoded_or
from .wire import Flight, decode_coded, drop_coded, send_coded, send_trailer, size_and_rank, trailer_sums, wait_sums


@dataclass
class _Snapshots:
    """The tensors of one dtype in a DeltaAverager."""

    snapshot: torch.Tensor  # (Σ numel,): the tensors at the launch
    total: torch.Tensor  # (Σ numel [+ trailer],): the weighted sum, then the average [and the trailer]
    members: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (tensor, its snapshot, its part of total)
    coder: DeltaCoder | None = None  # with a wire codec, from the first landing: the last average and the error
    exact: bool = False  # never coded: it travels in full precision whatever the wire

    @property
    def coded(self) -> bool:
        """Whether it travels coded under a wire codec: floating-point, and not exact."""
        return self.data.is_floating_point() and not self.exact

    @property
    def data(self) -> torch.Tensor:
        return self.total[: self.snapshot.numel()]


class DeltaAverager:
    """Averaging in the background, for `Builder.overlap_averaging(True)`.

    `launch(w, trailer)` snapshots the tensors and starts an all-reduce of w · snapshot, with the
    trailer after it, without waiting; the worker trains on; `wait()` returns the trailer's sums and
    `land(Σw)` moves every tensor by (average − snapshot), so the steps taken since the snapshot
    are kept on top of the average. A worker that took no step since the snapshot therefore lands
    exactly on the average.

    With a `wire` codec, as in FlatAverager, the floating-point snapshots travel as their change since
    the last landed average, encoded, once a first round (in full precision) has landed, or from
    the first launch after `start_coding()`; those given as `exact` too (an optimizer's second
    moments) go in full precision in buffers of their own.

    Every launch sends the tensors it was built with, whatever an optimizer has created since.

    `land(..., mixed=ids, keep=α)` lands the tensors named in `mixed` (those an outer step moves)
    short of that: at average + steps since + α · (snapshot − average), i.e. each moves (1 − α) of
    the way from its snapshot to the average (Streaming DiLoCo's mixing, rounds/streaming.py).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device, trailer: int = 0, wire: str | None = None, exact: Sequence[torch.Tensor] = ()) -> None:
        self._wire, self._trailer_len = uncoded_or(wire), trailer
        exactly = {id(t) for t in exact} if self._wire is not None else set()
        coded, full = [t for t in tensors if id(t) not in exactly], [t for t in tensors if id(t) in exactly]
        layout = [(d, m, False) for d, m in by_dtype(coded)] if coded or not full else []  # by_dtype([]): the trailer's group
        layout += [(d, m, True) for d, m in by_dtype(full)] if full else []
        self._groups: list[_Snapshots] = []
        for dtype, members, is_exact in layout:
            snapshot, total = flat_buffer(members, dtype, device), flat_buffer(members, dtype, device, 0 if self._groups else trailer)
            self._groups.append(_Snapshots(snapshot, total, list(zip(members, views(snapshot, members), views(total, members))), exact=is_exact))
        self._in_flight: list[Flight] = []
        self._coded_trailer: tuple[dist.Work, torch.Tensor] | None = None
        self._world: tuple[int, int] = (1, 0)  # the group's size and this rank, for the coders

    @property
    def _codes(self) -> bool:
        """Whether its rounds go coded: with a wire codec, and peers to send them to."""
        return self._wire is not None and self._world[0] > 1

    @property
    def steady(self) -> bool:
        """Whether the next launch goes as every later one will: coded, with a wire codec (not its
        first round in full precision)."""
        return not self._codes or all(s.coder is not None for s in self._groups if s.coded)

    @torch.no_grad()
    def start_coding(self, group: ProcessGroup = None) -> None:
        """With a wire codec: code from the first launch on, the deltas taken from the tensors as
        they are now, which must be bitwise equal on every rank of the group (an average every
        replica holds), instead of after a first round in full precision. A worker alone codes
        nothing: its average is its own state, exactly."""
        if self._wire is None:
            return
        self._world = size_and_rank(group)
        if not self._codes:
            return
        for s in self._groups:
            if s.coder is None and s.coded:
                for t, _, part in s.members:
                    part.copy_(t)
                s.coder = DeltaCoder(self._wire, s.data, *self._world)

    @torch.no_grad()
    def launch(self, weight: float, trailer: Sequence[float] | None = None, group: ProcessGroup = None) -> None:
        """Snapshot the tensors and start summing weight · snapshot, and the trailer, over the group."""
        assert not self._in_flight, "land() the previous averaging first"
        if self._wire is not None:
            self._world = size_and_rank(group)
        coded = any(s.coder is not None for s in self._groups)
        if coded:
            self._coded_trailer = send_trailer(trailer, self._trailer_len, self._groups[0].total.device, group)
        for s in self._groups:
            for t, snap, _ in s.members:
                snap.copy_(t)
            if s.coder is not None:
                s.data.copy_(s.snapshot)  # the coder's state: its change from the last average goes
                self._in_flight.append(Flight(send_coded(s.coder, weight, group), None))
                continue
            if weight == 0.0:
                s.data.zero_()  # whatever the snapshot holds (even NaN) contributes nothing
            else:
                torch.mul(s.snapshot, weight, out=s.data)
            put_trailer(s.total, s.snapshot.numel(), None if coded else trailer)
            work = dist.all_reduce(s.total, group=group, async_op=True)
            assert work is not None
            self._in_flight.append(Flight([[work]], s.total))

    def wait(self) -> list[float]:
        """Wait for the sums (a coded payload: its trailer's); the trailer's sums."""
        wait_sums(self._in_flight)
        coded, self._coded_trailer = self._coded_trailer, None
        return trailer_sums(self._in_flight, coded, self._groups[0].data.numel(), self._trailer_len)

    @torch.no_grad()
    def land(
        self,
        total_weight: float,
        adopt: bool = False,
        transform: Callable[[dict[int, torch.Tensor]], None] | None = None,
        at_average: Callable[[], None] | None = None,
        mixed: Collection[int] = (),
        keep: float = 0.0,
    ) -> None:
        """After wait(): move each tensor by (average − snapshot), or, with `adopt` (its own progress
        since is worthless or nil), replace it by the average. Σw = 0: no change. `transform` may
        first change the averages in place, by id(tensor) (an outer step from the average).
        `at_average` is called while the tensors hold the (transformed) average, their progress
        since the snapshot kept aside in the snapshots and added back after it. A tensor whose id
        is in `mixed` moves by (1 − keep) · (average − snapshot) instead, unless it adopts."""
        flights, self._in_flight = self._in_flight, []
        for s, flight in zip(self._groups, flights):
            if flight.buffer is None:
                assert s.coder is not None
                if total_weight == 0:
                    drop_coded(flight.works)
                else:
                    decode_coded(s.coder, flight.works, 1.0 / total_weight)  # the average, and the next start
            elif total_weight != 0:
                s.data.div_(total_weight)  # the average
                if self._wire is not None and self._codes and s.coded:
                    s.coder = DeltaCoder(self._wire, s.data, *self._world)  # landed in full precision: the start
        if total_weight == 0:
            return
        if transform is not None:
            transform({id(t): average for s in self._groups for t, _, average in s.members})
        aside = at_average is not None and not adopt  # the progress since goes in the snapshots
        for s in self._groups:
            if not adopt and not aside:
                s.data.sub_(s.snapshot)  # its difference from this worker's snapshot
            for t, snap, change in s.members:
                change = change if t.is_floating_point() else change.round()
                mix = keep if id(t) in mixed and not adopt else 0.0
                if aside and mix:  # t − snapshot + keep · (snapshot − average)
                    snap.mul_(mix - 1.0).add_(t).sub_(change, alpha=mix)
                elif aside:
                    torch.sub(t, snap, out=snap)
                if adopt or aside:
                    t.copy_(change)
                elif mix:
                    t.add_(change.to(t.dtype), alpha=1.0 - mix)
                else:
                    t.add_(change.to(t.dtype))
        if at_average is not None:
            at_average()
        for t, snap, _ in (m for s in self._groups for m in s.members) if aside else ():
            t.add_(snap.to(t.dtype))


__all__ = ["DeltaAverager"]
