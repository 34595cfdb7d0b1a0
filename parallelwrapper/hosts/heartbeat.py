"""A rank's watch over its peers: under torchrun a lost peer ends this process within `peer_timeout`; in a fleet it tells its host who is silent.

A rank killed with SIGKILL closes its sockets, and gloo fails its peers' collective at once. A rank
that is stopped (SIGSTOP, a hung host) or whose link is cut closes nothing: without this watch its
peers would wait out the collective timeout (stall_timeout + 30 s) before torchrun could restart
the group. So every rank runs a daemon thread that bumps its own counter in the group's store every
`peer_timeout / 6` seconds (at most every 2 s) and reads its peers', and a second one that judges.
A peer whose counter has not moved for `peer_timeout`, or a store that has not answered for that
long, is lost: the main thread may be blocked in a collective, so the judge prints one line naming
the lost ranks to stderr and ends the process with `os._exit(1)`; torchrun's agent then restarts the
group (--max-restarts) or stops. A fleet's member is not to end: its judge is its host's
(`on_lost`), which closes the group's connections so that every survivor regroups (fleet.py). The threads go on while the main thread works (a validation, a
checkpoint, the time between two fits), and a rank that leaves (close()) adds 2^40 to its count, so
its peers stop watching it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable

from torch.distributed import Store  # type: ignore[attr-defined]

_MOST_S = 2.0  # the longest pause between two beats
_LEFT = 1 << 40  # added to a rank's count when it leaves: past any count of beats


class Heartbeat:
    """This rank's beat and watch in the group's store, under `prefix` (this group's keys).

    Two daemon threads: one beats and reads the peers' counts; the other judges, since a store
    call on a cut link can block for ever whatever the client's timeout. Where the process is not
    to end (a fleet's member, whose peers go on without a lost one), the judge is `on_lost`, and
    its host asks how long each peer has been silent (`silent`) and forgets the lost (`watch`)."""

    def __init__(self, connect: Callable[[], Store], where: str, prefix: str, rank: int, world: int, timeout_s: float, *,
                 on_lost: Callable[[list[int], str], None] | None = None) -> None:  # fmt: skip
        """`connect()`: a client of the group's store (its own: the beats' thread calls it), which
        is at `where` (for the messages). `on_lost(ranks, why)`: called from the judge's thread, at
        every look while peers are silent for `timeout_s` (or the store has not answered for so
        long: every peer); by default this process says so and ends."""
        self._connect, self._where, self._prefix, self._rank, self._timeout_s = connect, where, prefix, rank, timeout_s
        self._interval = min(timeout_s / 6, _MOST_S)
        self._stop = threading.Event()
        self._answered = time.monotonic()  # when the store last answered a whole beat
        self._heard = {r: (-1, self._answered) for r in range(world) if r != rank}  # peer: (its last count, when it changed)
        self._beat = threading.Thread(target=self._beats, name="parallelwrapper-heartbeat", daemon=True)
        self._beat.start()
        self._on_lost = on_lost or self._lost
        threading.Thread(target=self._watch, name="parallelwrapper-peer-watch", daemon=True).start()

    def silent(self, rank: int) -> float:
        """Seconds since peer `rank`'s count last moved, by the clock, whether or not the store
        answered meanwhile (a store that does not answer holds every count still: the caller
        tells the live from the lost another way, as a fleet's lifeline); for one that left (it
        finished its fits) or is not watched, for ever."""
        heard = self._heard.get(rank)
        return math.inf if heard is None else time.monotonic() - heard[1]

    def watch(self, ranks: tuple[int, ...]) -> None:
        """Watch `ranks` (a fleet's group as it is now) and no other: the lost go, those that
        joined come, silent from now until their first beat."""
        now = time.monotonic()
        for r in set(self._heard) - set(ranks):
            self._heard.pop(r, None)
        for r in ranks:
            if r != self._rank and r not in self._heard:
                self._heard[r] = (-1, now)

    def close(self) -> None:
        """Say this rank leaves (its peers stop watching it) and end the threads."""
        self._stop.set()
        self._beat.join(timeout=self._timeout_s / 2)  # a blocked store call is given up on

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def _beats(self) -> None:
        # Its own client: the main thread's may be blocked in a call of its own.
        store: Store | None = None
        known: set[int] = set()  # the peers whose key this client has made sure of
        while True:
            try:
                if store is None:
                    store = self._connect()
                if self._stop.is_set():
                    store.add(self._key(self._rank), _LEFT)
                    return
                store.add(self._key(self._rank), 1)
                peers = list(self._heard)  # a copy: `watch` may change them meanwhile
                for r in set(peers) - known:
                    store.add(self._key(r), 0)  # a peer yet to beat reads as silent, not as a store that hangs
                    known.add(r)
                # One round trip for every peer's count: the store's load grows with the ranks, not their square.
                for r, count in zip(peers, map(int, store.multi_get([self._key(r) for r in peers]) if peers else [])):
                    heard = self._heard.get(r)
                    if heard is None:
                        continue  # no longer watched
                    if count >= _LEFT:
                        self._heard.pop(r, None)  # it finished: no longer a peer to watch
                    elif count != heard[0]:
                        self._heard[r] = (count, time.monotonic())
                self._answered = time.monotonic()
            except RuntimeError:  # DistStoreError, a refused connection: the watch judges by `_answered`
                if self._stop.is_set():
                    return
            self._stop.wait(self._interval)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            silent = [r for r, (_, changed) in list(self._heard.items()) if now - changed >= self._timeout_s]
            if now - self._answered >= self._timeout_s and self._heard:
                self._on_lost(list(self._heard), f"the group's store at {self._where} has not answered")
            elif silent:
                self._on_lost(silent, "no heartbeat")

    def _lost(self, ranks: list[int], why: str) -> None:
        if self._stop.is_set() or not threading.main_thread().is_alive():
            return  # leaving anyway
        names = ", ".join(map(str, ranks))
        print(
            f"parallelwrapper: rank {self._rank} lost rank{'s' if len(ranks) > 1 else ''} {names}: {why} for "
            f"{self._timeout_s:g} s (killed, stopped, or its link is cut); ending this process so that torchrun "
            "restarts the group: with --max-restarts N and .checkpoint(dir) it resumes from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
