"""A worker's clock of its rounds' exchanges: the seconds that the exchange measures, for the Score and the policy.

The exchange fills it as it goes (exchange.py, streaming.py): the seconds a step waited for the last
round's state, the workers' meeting before a round's payload, and, as a round lands, whether its
seconds measure its payload (rung) and its codec's part. The loop times its launches and landings
into it (`timed`) and reads it once a round has settled (`measured`); the policy reads the measure
(policy.py). A measure of an exchange is its link's and codec's seconds, not a wait for a slower
worker, nor a buffer built or a state averaged anew in full precision for another payload."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

A = ParamSpec("A")  # a timed function's arguments
R = TypeVar("R")  # and what it returns


@dataclass
class Measure:
    """An exchange's seconds, a worker's own (zeros: no fair measure)."""

    exchange_s: float = 0.0  # its seconds, the wait before it aside
    codec_s: float = 0.0  # of those, its codec's (encoding, decoding)
    wait_s: float = 0.0  # the wait for the others before it


class Clock:
    """One worker's timers of its exchanges, kept across fits."""

    def __init__(self) -> None:
        self.unscored = 0.0  # seconds in exchanges since the last round settled: the next Score's (its local work's are its Work's)
        self.in_step = 0.0  # seconds a step waited for the last round's state to land: the exchange's (exchange.py's step hook)
        self.waited = 0.0  # of the round in flight's exchange, the seconds its workers took to meet before it
        # Of the last round landed, as the exchange saw it land:
        self.whole = False  # all its seconds measure its rung: its header rode with the payload, or (overlapped) it landed late as every later round will
        self.alone = 0.0  # else its payload's seconds alone, where they measure its rung (0: none do)
        self.codec = 0.0  # its codec's seconds
        self.last = Measure()  # the last fair measure, until the next round's header carries it

    def timed(self, fn: Callable[A, R], *args: A.args, **kwargs: A.kwargs) -> R:
        """fn(*args), its seconds counted as exchange for the next Score."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.unscored += time.perf_counter() - start

    def landed(self, whole: bool, alone: float = 0.0, codec: float = 0.0) -> None:
        """The exchange has landed a round: see `whole`, `alone`, `codec` above."""
        self.whole, self.alone, self.codec = whole, alone, codec

    def settled_in_step(self) -> float:
        """The seconds this round's first step waited for the last round's state to land are that
        round's exchange's, not local work: for the Score, and for the measure of the exchange
        (when it has one), which the next header carries. Returns them."""
        moved, self.in_step = self.in_step, 0.0
        self.unscored += moved
        if self.last.exchange_s > 0:
            self.last.exchange_s += moved
        return moved

    def measured(self) -> bool:
        """After a round has landed and before its Score takes `unscored`: its measure becomes
        `last` (zeros when it is none). Whether it was fair."""
        fair = self.whole or self.alone > 0
        exchange_s = self.unscored - self.waited if self.whole else self.alone
        self.last = Measure(exchange_s, self.codec, self.waited) if fair else Measure()
        self.waited = 0.0
        return fair

    def take(self) -> Measure:
        """`last`, which the next header will then not carry (the policy summed it at once)."""
        last, self.last = self.last, Measure()
        return last


__all__ = ["Clock", "Measure"]
