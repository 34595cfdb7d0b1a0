"""The autopilot (`.averaging_frequency("auto")`): k, the payload, the optimizer state's period and, as its last resort, overlap, chosen round by round.

It chooses from what the rounds measure.

What it measures, over every worker (each round's header carries each worker's numbers, summed):
    c   seconds per local step: a round's local work over its steps (each process's, summed:
        a pipeline's stage and a node's rank step once for each step of their worker)
    w   seconds a worker waits for the others before an exchange (they meet at a one-number
        all-reduce first), so that x is the link's and the codec's time alone
    x_r seconds per exchange while rung r is in force (a rung: a payload, and every how many rounds
        the optimizer's state travels), measured afresh whenever k or the rung changes (an
        exchange's wait for a slower worker grows with k); of a round that rebuilt its buffers
        only a float32 average's payload is a measure (a fit's first round), a coded one's not;
        while the choice in force has no measure, its exchange is summed over the workers at once
        (a four-number all-reduce) and decided on as it lands, else the next round's header
        carries it
    e   overlapped: seconds a round landed late still cost a worker (launched, then waited for)

What it chooses. The exchange and the wait before it cost x + w once per round of k steps, so
their share of a worker's time is (x + w) / (x + w + k·c). The wait has two parts: one a round
costs whatever its k (first-come batches: at most about a step), which a longer round hides, and
one that grows with k (a slower worker training its own batches, under torchrun), which no k
hides and which costs every step alike. It measures the wait at the steps each round ran and fits
w(k) = a + b·k (_Waits; with one k measured, half of each; a growth b within its standard error,
from the waits' spread, is noise, and the wait a round's), and counts a as the round's and
b as the step's. The autopilot keeps the round's share under ρ (`exchange_share`, default 5%):

    k = the smallest power of two from k_min with (x + a)·(1 − ρ) / (ρ·(c + b)) ≤ k, at most k_max

(the period that makes communication a fixed fraction of compute: the runtime model of
local-update SGD in Wang & Joshi, "Adaptive Communication Strategies to Achieve the Best
Error-Runtime Trade-off in Local-Update SGD", AdaComm, arXiv 1810.08313; measured rather than
predicted, since a 2026 measurement of DiLoCo over shaped links, diloco-measured, found compute
utilization 1.08-1.92x off the analytic model). k falls again only when 0.7 of its half would do, so that
the noise of a few rounds does not move it up and down.
Before any measure it runs the middle of its bounds (`Autopilot.k_start`, 16 for 1..128): the
exchange that comes before the first measure costs the same whatever k is. And it sends the fewest
bytes it may (`Autopilot.start`: int8, the parameters alone): on a slow link the rounds before the
first decision cost most, and on a fast one a codec's few milliseconds a round cost least.

The k comes first, then the bytes: it runs the shortest k any rung allows (the k the fastest rung's
exchange needs), and of the rungs that run at that k, the one that sends the most. It never
lengthens k to send more bytes: a longer round costs loss per step, more bytes buy little
(docs/guides/autopilot.md: on the GPT arena at 50 Mbit/s int8's parameters alone scored -0.3% to
+0.5% of float32 with Adam's state at the same k, and each 4x of k cost 0.2-1.4%; the first version,
which sent the most bytes that kept k at half of k_max, took 1.21x the best fixed setting's time
to the first target).
A rung is a payload (float32, bfloat16, int8) with every how many rounds the optimizer's state
travels (1, 2, 4: DES-LOC, arXiv 2505.22549, Adam's moments less often than the parameters at
equal loss; or never). Each rung's bytes follow from the model's sizes, and an exchange is measured
in two parts: the codec's seconds (encoding and decoding, compute) and the rest (the link's), so an
exchange measured at one rung estimates another's: the link's part times the bytes' ratio, plus the
codec's part times the ratio of the numbers it codes for a coded payload (none for float32; a
coded payload sends an optimizer's second moments in full precision, state.EXACT_STATE). A rung
measured on this link counts by its measure, the others by that estimate. It tries at once the
rung with the most bytes that runs at the shortest k (climbing no further than REACH = 16 times the
bytes measured, else to the nearest rung above); where the rung in force needs a longer k than
the fastest, the one with the most bytes among those that run at the fastest's k, else the one
that sends least. Where even the fastest needs more than k_max, a rung fits where its exchange
alone would keep the share at k_max (the wait is what does not), else only the fastest. A rung
tried with fewer bytes is kept only if its measured exchange is 10% faster than the rung before
it, one with more bytes only if its measure still runs at the shortest k or is 10% faster anyway;
else the autopilot goes back to that one and stays there while the measures hold (a measure JUMP = 2 times its mean or more, or half of it or less, replaces the mean
at once, drops what other rungs measured on the old link and starts the search again, deciding on
that one measure, where a rung whose state goes every m rounds would wait for m): fewer bits win
only where the link is slower than the codec (on
loopback an int8 round costs about what float32's does, benchmarks/results/averaging_cost.json).

Its last resort is overlap: where no rung is left to try and even k_max leaves the link's share
above twice ρ (x/(x + k_max·c) > 2ρ; the wait w is an imbalance, which overlap does not hide), it
lands each round after the next round's steps (overlap_averaging) from the next round on, at the
k whose steps hide the link's part with a margin (k·c ≥ 2(x − x_c)) and keep the codec's, which is
not hidden, under ρ. Only where that hides something: an epoch's last round lands at once (so
does a fit's), so where every worker knows the epoch's E steps, of its R = ⌈E/k⌉ rounds only R − 1
hide their link's part, and it overlaps only where the exposed rest, x − (x − x_c)(R − 1)/R a
round, is a smaller share of k·c than x is of k_max·c landed at once (a fit of one epoch of 128
steps, overlapped at k = 128, hid nothing). Overlapped, it measures what each round landed late still cost a worker (its
launch, and its wait to land: e) and only lengthens k: where e/(e + k·c) > ρ, the link took about
k·c + e, and k becomes the one whose steps take twice that (at most k_max). It never shortens k or
leaves overlap.

An epoch's last rounds: where every worker's source knows the epoch's length (a list, a map-style
DataLoader; not the queue feed or an iterable), a round after which the epoch's rest would be one
round shorter than its exchange needs (fewer than (x + a)(1 − ρ)/(ρ·(c + b)) steps) runs to the epoch's
end instead, if that is at most k_max steps (Pilot.steps): the tail would spend a whole exchange
on a few steps, and the epoch's end lands one anyway.

Every rank makes the same choice: it decides from the header's sums alone (each worker's measures
and its model's sizes, summed by the round's all-reduce, are the same numbers on every rank),
whatever its own measures said, and applies the decision from the next round on. Each worker also
sends the choice it ran with, so a round whose workers disagree fails instead of averaging. The
pilot's state goes in every checkpoint and carries over from one fit() to the next. Imports nothing
of the package but payloads.py's names and bits.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict, cast

from .payloads import FORMS, bits, is_sparse, problem

PAYLOADS = ("float32", "bfloat16", "int8")  # the payloads it may choose, when none is set
UPDATER_PERIODS = (1, 2, 4, 0)  # every how many rounds the optimizer's state travels, when not set (0: never)
JUMP = 2.0  # a measure this many times its mean or more, or 1/JUMP or less, replaces it: the link (or a worker) changed
FALL = 0.7  # k falls to its half only when the k it needs is below this share of that half
REACH = 16.0  # a climb's estimate is trusted to this many times the bytes measured (int8's parameters to float32 with Adam's state: 12x)
MARGIN = 0.10  # a rung tried is kept when its exchange is faster than the one before it by this share
OVERLAP = 2.0  # it overlaps where even k_max leaves exchanges above this many times ρ of the time
HIDE = 2.0  # overlapped, a round's steps take at least this many times the link's measured part (slow links vary)
WAIT_WINDOW = 16  # a wait's mean runs over about this many measures: a round's wait varies several times over from round to round
NOISE = 1.0  # a wait counts as growing with k where its fitted growth is more than this many standard errors
PILOT_LEN = 10  # numbers the pilot adds to a round's header: local work's seconds and steps, the last exchange's seconds, its codec's and the wait, the model's three sizes, the choice


@dataclass(frozen=True)
class Autopilot:
    """`.averaging_frequency("auto", ...)`: the bounds of the autopilot's choices. `payloads` and
    `updater_periods` are what it may choose among: one value when the user set that option, and
    none that config.CONFLICTS refuses beside the other options (config.steered); `overlap`, whether
    it may turn overlap_averaging on (not when the user set it off, or the table refuses it)."""

    k_min: int = 1
    k_max: int = 128
    exchange_share: float = 0.05  # ρ: the share of a worker's time in exchanges aimed at
    payloads: tuple[str, ...] = PAYLOADS
    updater_periods: tuple[int, ...] = UPDATER_PERIODS
    overlap: bool = True  # it may land rounds a round late, as its last resort (False: the user set overlap_averaging(False), or the table refuses it)

    def __post_init__(self) -> None:
        fix = 'e.g. .averaging_frequency("auto", k_min=1, k_max=128, exchange_share=0.05)'
        for name in ("k_min", "k_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"averaging_frequency('auto'): {name} must be an int >= 1, got {value!r}; {fix}")
        if self.k_min > self.k_max:
            raise ValueError(f"averaging_frequency('auto'): k_min {self.k_min} is above k_max {self.k_max}; {fix}")
        share = self.exchange_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise ValueError(f"averaging_frequency('auto'): exchange_share must be a number in (0, 1), got {share!r}; {fix}")
        if not self.rungs:
            raise ValueError(f"averaging_frequency('auto'): payloads {self.payloads} and optimizer-state periods {self.updater_periods} leave nothing to send with; {fix}")

    @property
    def k_start(self) -> int:
        """The k of its first rounds, before anything is measured: the middle of its bounds,
        k_min·2^⌈i/2⌉ where k_min·2^i is the last power within k_max (16 for 1..128). A start at
        k_min would spend the exchange that must come before any measure on the fewest steps
        (docs/guides/autopilot.md)."""
        top = 0
        while self.k_min << (top + 1) <= self.k_max:
            top += 1
        return self.k_min << math.ceil(top / 2)

    @property
    def start(self) -> Rung:
        """The rung of its first rounds, before anything is measured: the fewest bits it may send
        (int8), with the fewest of the optimizer's state (the parameters alone, else its longest
        period). The rounds before the first measure then cost least: at 10 Mbit/s a float32 round
        of a 6M-parameter model's parameters took 22 s, int8's about 6 s, and on a fast link int8
        costs its codec's few milliseconds a round (docs/guides/autopilot.md). It climbs to more
        bytes once a measure says they fit."""
        return min(self.rungs, key=lambda r: (bits(r.payload), r.updaters_every != 0, -r.updaters_every))

    def check_payloads(self) -> None:
        """A ValueError unless every payload it may choose is a payload (payloads.py)."""
        unknown = [p for p in self.payloads if problem(p) is not None]
        if unknown:
            raise ValueError(f"averaging_frequency('auto'): payloads {unknown} are not payloads; choose among {FORMS}")

    @property
    def rungs(self) -> tuple[Rung, ...]:
        """Every way it may send a round, in a fixed order (the header names a rung by its place):
        each payload with each optimizer-state period, except that a coded payload carries the
        optimizer's state with the parameters, one residual for both, every round or never, and
        sparse the parameters alone (config.CONFLICTS says why)."""
        return tuple(
            Rung(p, m) for p in self.payloads for m in self.updater_periods
            if p == "float32" or (m in (0, 1) and (not is_sparse(p) or m == 0))
        )  # fmt: skip


@dataclass(frozen=True)
class Rung:
    """A way to send a round: its payload, and every how many rounds the optimizer's state goes
    (0: never, the parameters alone)."""

    payload: str
    updaters_every: int

    def __str__(self) -> str:
        if self.updaters_every == 1:
            return self.payload
        return self.payload + (", parameters only" if self.updaters_every == 0 else f", optimizer state every {self.updaters_every} rounds")

    def at(self, k: int, overlap: bool = False) -> Choice:
        """This rung with k local steps a round (`overlap`: each round landed a round late)."""
        return Choice(k, self.payload, self.updaters_every, overlap)

    def elements(self, sizes: Sizes) -> float:
        """Numbers a worker sends a round on average, for a model of `sizes`."""
        return sizes.parameters + self._share * sizes.state

    def coded(self, sizes: Sizes) -> float:
        """Of those, the numbers its codec codes: none for float32; else all but the optimizer's
        second moments, which go in full precision beside the codes."""
        return 0.0 if self.payload == "float32" else self.elements(sizes) - self._share * sizes.exact

    def bytes(self, sizes: Sizes) -> float:
        """Bytes a worker sends a round on average, for a model of `sizes`."""
        coded = self.coded(sizes)
        return coded * bits(self.payload) / 8 + (self.elements(sizes) - coded) * 4

    @property
    def _share(self) -> float:
        """The share of rounds the optimizer's state goes in."""
        return 1 / self.updaters_every if self.updaters_every else 0.0

    def estimate(self, other: Rung, link_s: float, codec_s: float, sizes: Sizes) -> float:
        """The seconds an exchange of `other` would take, where one of this rung takes `link_s` on
        the link and `codec_s` in its codec: the link's part follows the bytes, the codec's the
        numbers it codes (float32 has none)."""
        coded = codec_s * other.coded(sizes) / self.coded(sizes) if codec_s and self.coded(sizes) else 0.0
        return link_s * other.bytes(sizes) / self.bytes(sizes) + coded


@dataclass(frozen=True)
class Sizes:
    """Elements a round may carry: the trained parameters', and the optimizer state's (a mean
    over the workers, whose optimizers may not all hold state for every parameter)."""

    parameters: float
    state: float
    exact: float = 0.0  # of the state, what a coded payload sends in full precision (second moments)


@dataclass(frozen=True)
class Choice:
    """What is in force for a round: k, the rung, and whether rounds land a round late."""

    k: int
    payload: str
    updaters_every: int
    overlap: bool = False

    @property
    def rung(self) -> Rung:
        return Rung(self.payload, self.updaters_every)


@dataclass(frozen=True)
class Change:
    """One of the autopilot's decisions: from which round on, what, and why."""

    round: int  # the first round it is in force for (rounds over the wrapper's life, from 1)
    choice: Choice
    why: str


class ChoiceFields(TypedDict):
    """A Choice as plain values (dataclasses.asdict), as a checkpoint holds it (one from before
    overlap was a lever has no `overlap`: False)."""

    k: int
    payload: str
    updaters_every: int
    overlap: NotRequired[bool]


class PilotState(TypedDict):
    """Pilot.state_dict: the pilot's part of a worker's own state in a checkpoint, in plain values
    (load_state_dict takes the tuples back as lists too, and the links' keys as strings: JSON's)."""

    choice: ChoiceFields
    why: str
    ran: ChoiceFields | None
    ran_steps: NotRequired[int]  # the local steps that round ran (none in a checkpoint from before: its k)
    step: tuple[float, int]  # a _Mean's (value, count)
    waits: NotRequired[dict[int, tuple[float, int] | tuple[float, int, float]]]  # the wait before an exchange at each k run, a _Spread's (value, count, square) each (before: (value, count))
    wait: NotRequired[tuple[float, int]]  # a checkpoint's from before: the wait at the k in force
    links: dict[int, tuple[float, int]]
    codecs: dict[int, tuple[float, int]]
    trial: int | None
    done: bool
    exposed: NotRequired[tuple[float, int]]  # overlapped rounds' cost, a _Mean's (value, count)
    expected: NotRequired[float]  # the seconds an exchange of the choice in force was expected to take when chosen
    changes: list[tuple[int, ChoiceFields, str]]  # (round, choice, why)


def _fields(choice: Choice) -> ChoiceFields:
    return cast(ChoiceFields, dataclasses.asdict(choice))


def _pair(mean: _Mean) -> tuple[float, int]:
    return cast("tuple[float, int]", dataclasses.astuple(mean))


@dataclass
class _Mean:
    """A running mean of the last few measures: the mean of the first four, then an EWMA of 1/4."""

    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) / min(self.count, 4)


def _jumped(before: float, now: float) -> bool:
    """Whether `now` is JUMP times `before` or more, or 1/JUMP of it or less: not noise, a change."""
    return not 1 / JUMP < max(now, 1e-9) / max(before, 1e-9) < JUMP


@dataclass
class _Spread:
    """A running mean of a noisy measure and of its square, over its last WAIT_WINDOW or so (the
    plain mean of the first WAIT_WINDOW, then an EWMA of 1/WAIT_WINDOW): its value and how far a
    mean of its measures strays."""

    value: float = 0.0
    count: int = 0
    square: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        weight = 1 / min(self.count, WAIT_WINDOW)
        self.value += (x - self.value) * weight
        self.square += (x * x - self.square) * weight

    @property
    def variance(self) -> float:
        """The measures' variance about their mean (0 from one measure)."""
        return max(0.0, self.square - self.value * self.value)

    @property
    def weight(self) -> int:
        """How many measures the mean is worth: all of them up to the window, then the EWMA's
        2·WAIT_WINDOW − 1 (its variance is σ²·α/(2 − α), α = 1/WAIT_WINDOW)."""
        return min(self.count, 2 * WAIT_WINDOW - 1)


@dataclass
class _Waits:
    """The wait for the others before an exchange, measured at each k it ran, and split into the
    part a round costs whatever its k (a worker that starts its exchange late, first-come batches'
    last one) and the part that grows with k (a slower worker training its own batches: a step's
    difference each step), fitted as w(k) = a + b·k over the ks measured. A longer round hides a,
    not b, which costs every step alike. With one k measured it cannot tell them apart and takes
    half of each: on the GPT arena at 200 Mbit/s, where the waits grew with k (int8 at k = 8: 0.06
    s a round with the exchange, at 32: 0.12 s), the pilot counting the whole wait as a round's
    held k = 32 and took 1.18x and 1.12x the best fixed setting's time to its first two targets,
    the same pilot counting half of it 1.02x and 1.04x (`benchmarks/README.md`, "The same with
    half the wait counted"). A k's wait counts once measured twice where two ks are: one wait, a
    fit's first round's, can be a stall.

    Where two ks or more are measured, b counts only where it is more than NOISE times its standard
    error (from the spread of the waits at each k, pooled): a round's wait over a link varies
    several times over from one round to the next, and a growth read from two means of a few such
    waits is often noise. On the GPT arena at 50 Mbit/s the waits at k = 16, 32 and 64 averaged
    0.14-0.19 s (each 0-0.9 s; a growth of 0.3 standard errors), but fitted as measured they read as
    4-6 ms a step, and the pilot, taking them for a step's, ran int8 at k = 16 for 54 of 61 rounds,
    communicating 8.6% of its time (median) where int8 at k = 128 spent 1.4% (`benchmarks/README.md`,
    "Beside torchft's DiLoCo at 50 Mbit/s"). At 200 Mbit/s they grew, 0.04 s at k = 8 and 0.07 s
    at 16 (1.3 standard errors), and k = 8 was the best fixed setting ("The wait fitted over the ks
    it ran"). Within NOISE the wait is a round's: the waits' weighted mean, which a longer round
    hides. Raced beside the rule before (NOISE = 0) at 50 and 200 Mbit/s, two seeds each, it
    reached 9 of 12 targets within 1.05x of the fastest fixed setting, the rule before 7 ("The
    waits' noise weighed")."""

    at: dict[int, _Spread] = dataclasses.field(default_factory=dict)

    def add(self, k: int, seconds: float) -> None:
        self.at.setdefault(k, _Spread()).add(seconds)

    def split(self) -> tuple[float, float, int]:
        """(a, b, n): the seconds a round, the seconds a step, and how many ks they are fitted to."""
        points = [(k, m) for k, m in sorted(self.at.items()) if m.count]
        twice = [(k, m) for k, m in points if m.count >= 2]
        points = twice if len(twice) >= 2 else points
        if not points:
            return 0.0, 0.0, 0
        if len(points) == 1:
            (k, m), = points
            return m.value / 2, m.value / (2 * k), 1
        ks, ws = [k for k, _ in points], [m.value for _, m in points]
        flat = sum(m.weight * m.value for _, m in points) / sum(m.weight for _, m in points), 0.0, len(points)
        b, a = statistics.linear_regression(ks, ws)  # least squares (distinct ks: never a flat x)
        if b <= NOISE * self._error(points):  # it does not grow with k beyond its noise: a round's
            return flat
        if a < 0:  # it grows faster than k: a step's, through the origin
            return 0.0, sum(k * w for k, w in zip(ks, ws, strict=True)) / sum(k * k for k in ks), len(points)
        return a, b, len(points)

    @staticmethod
    def _error(points: list[tuple[int, _Spread]]) -> float:
        """The standard error of the least-squares slope over `points`, each mean's own error from
        the waits' variance pooled over the ks (0 where no k has two measures)."""
        spare = sum(m.count - 1 for _, m in points)
        pooled = sum((m.count - 1) * m.variance for _, m in points) / spare if spare else 0.0
        mean_k = statistics.fmean(k for k, _ in points)
        spread = sum((k - mean_k) ** 2 for k, _ in points)
        return math.sqrt(sum((k - mean_k) ** 2 * pooled / m.weight for k, m in points)) / spread


@dataclass
class _Exchange:
    """A rung's exchanges, measured: their seconds, and of those the codec's."""

    seconds: _Mean = dataclasses.field(default_factory=_Mean)
    codec: _Mean = dataclasses.field(default_factory=_Mean)

    @property
    def codec_s(self) -> float:
        """Of the mean exchange, the codec's seconds (never more than the exchange's)."""
        return min(self.codec.value, self.seconds.value)


class Pilot:
    """One worker's autopilot. The round loop's policy (rounds/policy.py's Steered) asks `header()`
    for the pilot's part of a round's header before it goes out, and hands `landed()` that part
    summed when it lands; `choice` is what the next round runs with. Every input of a decision is
    a sum of the header's, so every worker's pilot decides the same."""

    def __init__(self, spec: Autopilot, start: Choice) -> None:
        self.spec = spec
        self.rungs = spec.rungs
        self.choice = start
        self.changes: list[Change] = []
        self._why = ""
        self._ran: Choice | None = None  # what the round before the last one landed ran with: what its exchange measured
        self._ran_steps = 0  # that round's local steps, the k its wait is measured at (an epoch's last round may run more, a fit's last fewer)
        self._step = _Mean()
        self._waits = _Waits()  # seconds a worker waits for the others before an exchange, at each k run
        self._links: dict[int, _Exchange] = {}  # by rung index: its exchanges' seconds, and the codec's
        self._trial: int | None = None  # trying another rung than this one (down to fewer bytes, or up to more)
        self._done = False  # a rung tried did not pay: the search for a rung rests, until a measure jumps (JUMP)
        self._moved = False  # the measure just taken jumped: decided on at once, a state period's rounds not awaited
        self._sizes = Sizes(0, 0)  # the model's, from the last header (a worker's mean)
        self._exposed = _Mean()  # overlapped: seconds a round landed late still cost a worker, at the k in force
        self._expected = 0.0  # the seconds (with the wait) an exchange of the choice in force was expected to take when chosen
        self._epoch: int | None = None  # each worker's steps in the epoch being trained, where it knows them (`steps`)

    def header(self, compute_s: float, steps: int, exchange_s: float, codec_s: float, waited_s: float, sizes: Sizes) -> list[float]:
        """This worker's part of a round's header: its local work's seconds and steps, its last
        exchange's seconds, of those its codec's, and its wait for the others before it (0 when
        that exchange was no fair measure, or none was in this fit); the elements a round of its
        model may carry; and the choice it runs the round with, which every worker's must equal."""
        return [compute_s, float(steps), exchange_s, codec_s, waited_s, float(sizes.parameters), float(sizes.state), float(sizes.exact), float(self.choice.k), self._code(self.choice)]

    def landed(self, summed: Sequence[float], workers: int, rounds: int, late: bool = False) -> Change | None:
        """A round landed: `summed`, the pilot's part of its header over the `workers` that sent
        it; `rounds` landed so far; `late`: after the next round's local work (overlapped).
        Measures, and decides what the next round to start runs with (returned when it changes
        anything)."""
        compute_s, steps, exchange_s, codec_s, waited_s, parameters, state, exact, k_sum, rung_sum = summed
        now = self.choice
        if (k_sum, rung_sum) != (workers * now.k, workers * self._code(now)):
            raise RuntimeError(
                f"the autopilot's workers ran round {rounds} with different choices (this worker: k = {now.k}, {now.rung}{', overlapped' if now.overlap else ''}; "
                f"the sums: k {k_sum:g}, rung {rung_sum:g} over {workers} workers): a bug; set a fixed k and report it"
            )
        if steps > 0 and compute_s > 0:
            if self._step.count and _jumped(self._step.value, compute_s / steps):  # the steps changed pace (a worker replaced, a machine busy): what fits changed
                self._step, self._waits, self._done = _Mean(), _Waits(), False
            self._step.add(compute_s / steps)
        if exchange_s > 0 and self._ran == now:  # a measure of what is in force
            if now.overlap:
                self._exposed.add(exchange_s / workers)
            else:
                self._measure(exchange_s / workers, codec_s / workers, waited_s / workers)
        self._ran, self._ran_steps = now, round(steps / workers) if steps > 0 else now.k
        self._sizes = Sizes(parameters / workers, state / workers, exact / workers)
        return self._decided(rounds, late)

    def steps(self, left: int | None, epoch: int | None = None) -> int:
        """The local steps of the round about to start, with `left` steps of the epoch still to
        take on each worker, of its `epoch` steps in all (None: not known; the same on every
        worker, kept for the overlap's decision): the choice's k; or all `left`, at most k_max,
        where the round after it would be the epoch's last and too short for ρ (fewer steps than
        its exchange needs). That round would cost a whole exchange for a few steps, and the
        epoch's end lands one anyway. Overlapped, k. The exchange is the choice's measure, else
        what it was expected to take when chosen (every worker's pilot holds the same)."""
        now, self._epoch = self.choice, epoch
        if left is None or now.overlap or not now.k < left <= self.spec.k_max:
            return now.k
        link = self._links.get(self.rungs.index(now.rung))
        a, b, _ = self._waits.split()
        exchange = link.seconds.value + a if link is not None and link.seconds.count else self._expected
        if exchange <= 0 or self._step.value <= 0:
            return now.k
        return left if left - now.k < self._need(exchange, self._step.value + b) else now.k

    def _code(self, choice: Choice) -> float:
        """The choice's rung and overlap as one number for the header: the rung's place from 1,
        past every rung's when overlapped."""
        return float(self.rungs.index(choice.rung) + 1 + len(self.rungs) * choice.overlap)

    @property
    def unmeasured(self) -> bool:
        """Whether the choice in force has too few measures of its exchange to decide on. The
        engine then hands the exchange of the round just landed to `measured` at once, summed by
        an all-reduce of a few numbers, instead of in the next round's header: a round sooner.
        Never once overlapped: nothing is left to decide."""
        if self.choice.overlap:
            return False
        link = self._links.get(self.rungs.index(self.choice.rung))
        return link is None or link.seconds.count < max(1, self.choice.updaters_every)

    def measured(self, summed: Sequence[float], workers: int, rounds: int) -> Change | None:
        """The exchange of the round just landed (after `landed`, which left the choice as it
        was): `summed`, its seconds, its codec's and the wait before it, and the workers for whom
        it was a fair measure of its rung, over every worker. A measure only when fair on every
        worker; then decides as `landed` does."""
        exchange_s, codec_s, waited_s, fair = summed
        if fair < workers or exchange_s <= 0:
            return None
        self._measure(exchange_s / workers, codec_s / workers, waited_s / workers)
        return self._decided(rounds)

    def _measure(self, exchange_s: float, codec_s: float, waited_s: float) -> None:
        """An exchange of the rung in force, a worker's mean: its seconds, its codec's, the wait
        (at the steps its round ran: a tail's wait is not k's)."""
        here = self.rungs.index(self.choice.rung)
        link = self._links.setdefault(here, _Exchange())
        if self._link_moved(link, exchange_s - codec_s):  # the rungs' measures are of the old link: the search starts again
            link = _Exchange()
            self._links, self._trial, self._done, self._moved = {here: link}, None, False, True
        link.seconds.add(exchange_s)
        link.codec.add(codec_s)
        self._waits.add(self._ran_steps, waited_s)

    def _link_moved(self, link: _Exchange, link_s: float) -> bool:
        """Whether an exchange's link part (its seconds less its codec's) of `link_s` is JUMP times
        the rung's measured one or more, or 1/JUMP of it or less, where either is above a quarter
        of ρ of a round's compute: the link changed. Its mean of earlier measures would take it for
        noise (a link that fell from 200 to 10 Mbit/s kept three fast measures in its mean, read
        1.12 s where the last two exchanges took 3.9 s), and the codec's part, which stays, would
        hide a link's fall or rise in the exchange's total. Below the floor, noise moves nothing."""
        if not link.seconds.count:
            return False
        before = link.seconds.value - link.codec_s
        if max(before, link_s) <= self.spec.exchange_share / 4 * self.choice.k * self._step.value:
            return False
        return _jumped(before, link_s)

    def _decided(self, rounds: int, late: bool = False) -> Change | None:
        """Decide what the next round to start after round `rounds` landed runs with: the change,
        if any. Landed `late`, the round after it has done its steps already."""
        now = self.choice
        decided = self._decide(self._sizes)
        if decided == now:
            return None
        change = Change(rounds + 1 + late, decided, self._why)
        self.changes.append(change)
        self._links.pop(self.rungs.index(decided.rung), None)  # measured afresh at its k
        self._exposed = _Mean()
        self.choice = decided
        return change

    def _decide(self, sizes: Sizes) -> Choice:
        now = self.choice
        here, step = self.rungs.index(now.rung), self._step.value
        link = self._links.get(here)
        if now.overlap:
            return self._lengthened(now)  # its last resort: it stays, at k as long as the link needs
        moved, self._moved = self._moved, False
        if self._step.count == 0 or step <= 0 or link is None or (link.seconds.count < max(1, now.updaters_every) and not moved):
            return now  # not measured enough yet (a rung whose state goes every m rounds: m rounds), unless the link moved
        x, codec_s = link.seconds.value, link.codec_s
        a, per_step, fitted = self._waits.split()  # the wait's part a round (a longer one hides it), and its part a step (none does)
        pace = step + per_step  # a step's seconds, with its share of the wait
        measures = {self.rungs[i]: e.seconds.value for i, e in self._links.items() if e.seconds.count}  # on this link (_measure)
        guess = {r: measures.get(r) or now.rung.estimate(r, x - codec_s, codec_s, sizes) for r in self.rungs}  # each rung's exchange: measured, else by this one's
        ks = {r: self._power(self._need(guess[r] + a, pace)) for r in self.rungs}  # the k each would run at, were there no k_max
        fastest = min(self.rungs, key=guess.__getitem__)
        short, need = ks[fastest], self._need(x + a, pace)  # the shortest k any rung allows: more bytes only where they fit at it
        fit = {r for r in self.rungs if ks[r] <= short}
        if short > self.spec.k_max:  # no k keeps the share: the rungs whose link alone keeps it at k_max (the wait is what does not), else the fastest
            fit = {r for r in self.rungs if self._need(guess[r], pace) <= self.spec.k_max} or {fastest}
        if self._trial is not None:  # the rung it tried is measured: a step down kept only where faster by MARGIN, one up where it fits
            rung, before = self.rungs[self._trial], self._links[self._trial].seconds.value
            up = rung.bytes(sizes) < now.rung.bytes(sizes)  # a climb is kept where it fits at the shortest k, or is faster anyway
            if x > before * (1 - MARGIN) and (now.rung not in fit or not up):
                self._trial, self._done = None, True
                if up:
                    self._why = f"{now.rung} exchanges in {x:.3g} s, which would need k = {need:.0f} (more than {short}): back to {rung}, {before:.3g} s"
                else:
                    self._why = f"{rung} exchanges in {before:.3g} s, {now.rung} in {x:.3g} s: back to {rung}"
                return self._steer(before + a, pace, rung)
            self._trial = None
        other = None
        if not self._done:  # up where a rung with more bytes fits at the shortest k (this one's codec may be what does not), else down where this one needs a longer k
            other = self._more_bytes(now.rung, fit, sizes)
            if other is None and now.rung not in fit:
                other = self._fewer_bytes(now.rung, fit, sizes)
        if other is not None:  # tried at once
            self._trial = here
            measured = f"an exchange takes {x:.3g} s ({codec_s:.3g} s of it in the codec) and a step {step:.3g} s: "
            if other.bytes(sizes) > now.rung.bytes(sizes):
                self._why = measured + f"{other} would take about {guess[other]:.3g} s and need k = {self._need(guess[other] + a, pace):.0f}, within k = {short}"
            else:
                self._why = measured + (f"{now.rung} would need k = {need:.0f} to keep exchanges under {self.spec.exchange_share:.2g} of the time, "
                                        f"{fastest} k = {short}; trying {other}, about {guess[other]:.3g} s")
            return self._steer(guess[other] + a, pace, other)
        k = self._overlapped_k(x - codec_s, codec_s, step)
        if self._overlaps(x, step, now.rung) and self._hides(x, x - codec_s, k, step):
            rho = self.spec.exchange_share
            self._why = (f"an exchange takes {x:.3g} s ({codec_s:.3g} s of it in the codec) and a step {step:.3g} s: at k = "
                         f"{self.spec.k_max} (k_max), with no rung left to try, exchanges would still take "
                         f"{x / (x + self.spec.k_max * step):.2g} of the time (more than {OVERLAP:g} x {rho:.2g}): overlapped from now on, each "
                         f"round landing after the next round's steps, at k = {k}, whose steps hide the link's part")
            return now.rung.at(k, overlap=True)
        if self._k_for(x + a, pace) == now.k:
            return now
        waited = f"{a + per_step * now.k:.3g} s"
        if per_step:
            how = "halved: measured at one k" if fitted == 1 else f"fitted over {fitted} ks"
            waited += f" ({a:.3g} s a round, {per_step * 1e3:.3g} ms a step: {how})"
        elif fitted > 1:
            waited += f" (a round's: no growth beyond its noise over {fitted} ks)"
        self._why = f"an exchange takes {x:.3g} s after {waited} waiting for the others, and a step {step:.3g} s"
        return self._steer(x + a, pace, now.rung)

    def _overlaps(self, exchange_s: float, step_s: float, rung: Rung) -> bool:
        """Its last resort: overlap, where it may (and the rung sends the optimizer's state every
        round or never: overlap averages the whole state in the background), once the search for a
        rung is over and even k_max would leave exchanges of `exchange_s` above OVERLAP·ρ of the
        time: well above, since overlapped rounds land a round late and each costs its codec's
        compute, so a link at the edge of the bound stays as it is. The wait for a slower worker
        is not counted: overlap hides the link, not an imbalance."""
        spec = self.spec
        share = exchange_s / (exchange_s + spec.k_max * step_s)
        return spec.overlap and rung.updaters_every in (0, 1) and share > OVERLAP * spec.exchange_share

    def _hides(self, exchange_s: float, link_s: float, k: int, step_s: float) -> bool:
        """Whether overlapped at `k` its exchanges cost a smaller share of the time than landed at
        once at k_max: of an epoch's R = ⌈E/k⌉ rounds (E its steps, where known) the last lands
        at once, so each round still costs the exchange less R − 1 Rth of its link's part."""
        if self._epoch is None or self._epoch <= 0:
            return True  # not known (a queue, an iterable): overlapped rounds land late from one epoch to the next
        rounds = math.ceil(self._epoch / k)
        exposed = exchange_s - link_s * (rounds - 1) / rounds
        return exposed / (exposed + k * step_s) < exchange_s / (exchange_s + self.spec.k_max * step_s)

    def _overlapped_k(self, link_s: float, codec_s: float, step_s: float) -> int:
        """Overlapped, the k at which a round's steps take HIDE times the link's part of an
        exchange (hidden behind them) and its codec's part (compute at the launch and the
        landing, not hidden) stays under ρ of the time: the smallest k_min·2^i with both, at most
        k_max. HIDE, not 1: at 2 Mbit/s a first exchange measured 27 s, and the overlapped ones at
        the k whose steps took 31 s waited 10-12 s each to land (the GPT arena at 2 Mbit/s: `git show 0a8f6f4:benchmarks/README.md`)."""
        spec = self.spec
        k = spec.k_min
        while (k * step_s < HIDE * link_s or k < self._need(codec_s, step_s)) and k < spec.k_max:
            k *= 2
        return min(k, spec.k_max)

    def _lengthened(self, now: Choice) -> Choice:
        """Overlapped at `now`: a longer k where the rounds landed late still cost a worker more
        than ρ of its time (measured twice: a round's exposed seconds vary on a slow link). A
        round that waited to land took the link its steps' time and the wait: the new k is the
        one whose steps take HIDE times that, as at the switch (longer than now.k, whose codec's
        part already kept under ρ)."""
        spec, step, exposed = self.spec, self._step.value, self._exposed.value
        if self._exposed.count < 2 or step <= 0 or now.k >= spec.k_max or self._need(exposed, step) <= now.k:
            return now
        link = now.k * step + exposed
        k = self._overlapped_k(link, 0.0, step)
        self._why = (f"overlapped rounds at k = {now.k} still cost {exposed:.3g} s each to launch and land, and a step takes {step:.3g} s: "
                     f"{exposed / (exposed + now.k * step):.2g} of the time (more than {spec.exchange_share:.2g}); the link takes about "
                     f"{link:.3g} s: k = {k}{' (k_max)' if k == spec.k_max else ''}, whose steps hide it")
        return now.rung.at(k, overlap=True)

    def _power(self, need: float) -> int:
        """The smallest k_min·2^i of at least `need` steps, above k_max too (so that rungs that all
        need more than k_max still compare). A rung sends more bytes only where it runs at the k
        of the fastest: a longer round costs loss per step, more bytes buy little
        (docs/guides/autopilot.md)."""
        k = self.spec.k_min
        while k < need:
            k *= 2
        return k

    def _need(self, exchange_s: float, step_s: float) -> float:
        """The steps a round needs for exchanges of `exchange_s` to take ρ of the time."""
        rho = self.spec.exchange_share
        return exchange_s * (1 - rho) / (rho * step_s)

    def _fewer_bytes(self, rung: Rung, fit: set[Rung], sizes: Sizes) -> Rung | None:
        """The rung to try instead of `rung` (None: none sends fewer bytes by MARGIN): of those,
        the one that sends the most of the rungs that `fit` (run at the shortest k of all); else
        the one that sends least."""
        sends = {r: r.bytes(sizes) for r in self.rungs}
        fewer = [r for r in self.rungs if sends[r] < sends[rung] * (1 - MARGIN)]
        if not fewer:
            return None
        fits = [r for r in fewer if r in fit]
        if fits:
            return max(fits, key=sends.__getitem__)  # the first of equals: max keeps it
        return min(fewer, key=sends.__getitem__)

    def _more_bytes(self, rung: Rung, fit: set[Rung], sizes: Sizes) -> Rung | None:
        """The rung to climb to from `rung`: of those that send more by MARGIN and at most REACH
        times its bytes, else the nearest above it, the one that sends the most of the rungs that
        `fit` (run at the shortest k of all); None when none does. A guess further than REACH is
        not one: from a sparse round of 52 KB, which a link's burst let through in 0.02 s,
        float32's 141x the bytes were guessed at 0.33 s and took 105 s (the GPT arena at 2 Mbit/s)."""
        sends = {r: r.bytes(sizes) for r in self.rungs}
        above = sorted((r for r in self.rungs if sends[r] > sends[rung] * (1 + MARGIN)), key=sends.__getitem__)
        near = [r for r in above if sends[r] <= sends[rung] * REACH] or above[:1]
        fits = [r for r in near if r in fit]
        return max(fits, key=sends.__getitem__) if fits else None

    def _steer(self, exchange_s: float, step_s: float, rung: Rung) -> Choice:
        """`rung` at the k that keeps its exchanges (with the wait before them) under ρ of the
        time; the reason says so."""
        k, rho = self._k_for(exchange_s, step_s), self.spec.exchange_share
        self._expected = exchange_s
        bound = " (k_max)" if k == self.spec.k_max and exchange_s * (1 - rho) > rho * step_s * k else ""
        self._why += f": k = {k}{bound} keeps exchanges under {rho:.2g} of the time"
        return rung.at(k)

    def _k_for(self, exchange_s: float, step_s: float) -> int:
        """The smallest of k_min·2^i that keeps exchanges under ρ of the time, within the bounds;
        below the k in force only when FALL of its half would do (a need that hovers about a
        power of two would move k up and down every round)."""
        need = self._need(exchange_s, step_s)
        k = min(self._power(need), self.spec.k_max)
        return self.choice.k if k < self.choice.k and need > FALL * self.choice.k / 2 else k

    # -- a checkpoint's part ---------------------------------------------------------------------

    def state_dict(self) -> PilotState:
        return {
            "choice": _fields(self.choice), "why": self._why,
            "ran": None if self._ran is None else _fields(self._ran), "ran_steps": self._ran_steps, "step": _pair(self._step), "waits": {k: dataclasses.astuple(m) for k, m in self._waits.at.items()},
            "links": {i: _pair(e.seconds) for i, e in self._links.items()}, "codecs": {i: _pair(e.codec) for i, e in self._links.items()},
            "trial": self._trial, "done": self._done, "exposed": _pair(self._exposed), "expected": self._expected,
            "changes": [(c.round, _fields(c.choice), c.why) for c in self.changes],
        }  # fmt: skip

    def load_state_dict(self, state: PilotState) -> None:
        """Take `state` (state_dict's) as this pilot's. A choice overlapped where this pilot may
        not overlap (resumed with `.overlap_averaging(False)`) runs its k and rung with rounds
        landed at once."""
        self.choice = Choice(**state["choice"])
        if self.choice.overlap and not self.spec.overlap:
            self.choice = dataclasses.replace(self.choice, overlap=False)
        self._why, self._step = state["why"], _Mean(*state["step"])
        waits = state.get("waits", {self.choice.k: state["wait"]} if "wait" in state else {})  # JSON's keys are strings
        self._waits = _Waits({int(k): _Spread(*m) if len(m) == 3 else _Spread(m[0], m[1], m[0] ** 2) for k, m in waits.items()})
        self._trial, self._done = state["trial"], state["done"]
        self._exposed = _Mean(*state.get("exposed", (0.0, 0)))  # none in a checkpoint from before it was measured
        self._expected = state.get("expected", 0.0)  # none in a checkpoint from before: the epoch's last rounds run at k until measured
        self._ran = None if state["ran"] is None else Choice(**state["ran"])
        self._ran_steps = state.get("ran_steps", 0 if self._ran is None else self._ran.k)
        codecs = state.get("codecs", {})  # none in a checkpoint from before codecs were measured: no codec time
        self._links = {int(i): _Exchange(_Mean(*m), _Mean(*codecs.get(i, (0.0, 0)))) for i, m in state["links"].items()}
        self.changes = [Change(r, Choice(**c), why) for r, c, why in state["changes"]]


def levers(options: dict[str, Any]) -> dict[str, Any]:
    """The builder's options with the autopilot's levers narrowed to what the user left free: a
    payload or an optimizer-state period the user set is the only one it may choose, and overlap
    set off is never turned on."""
    spec = options.get("autopilot")
    if spec is None:
        return options
    payloads = (options["payload_dtype"],) if "payload_dtype" in options else spec.payloads
    if "average_updaters" in options or "average_updaters_every" in options:
        periods: tuple[int, ...] = (options.get("average_updaters_every", 1),)
    else:
        periods = spec.updater_periods
    if options.get("average_updaters") is False:
        periods = (0,)  # the parameters alone
    overlap = spec.overlap and options.get("overlap_averaging") is not False  # True: refused (config.CONFLICTS)
    spec = dataclasses.replace(spec, payloads=tuple(payloads), updater_periods=periods, overlap=overlap)
    start = spec.start
    return {**options, "autopilot": spec, "averaging_frequency": spec.k_start, "payload_dtype": start.payload, **in_config(start)}


def in_config(rung: Rung) -> dict[str, Any]:
    """The Config fields that send a round as `rung` says, but for its payload."""
    return {"average_updaters": rung.updaters_every != 0, "average_updaters_every": max(1, rung.updaters_every)}


__all__ = ["PAYLOADS", "PILOT_LEN", "UPDATER_PERIODS", "Autopilot", "Change", "Choice", "Pilot", "Rung", "Sizes", "in_config", "levers"]
