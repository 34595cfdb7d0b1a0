"""`.averaging_frequency("auto")` (autopilot.py): k, the payload and the optimizer state's period
chosen round by round from the measured step and exchange times.

Fast tier: the policy against simulated rounds (a fast link keeps float32 and a small k, a slow
one takes k to its bound and fewer bits, a codec slower than the link keeps float32, a resumed
pilot decides as the uninterrupted one, every rank decides the same from the header's sums) and the options'
checks. Real processes: two gloo workers with an exchange slowed in proportion to its bytes
choose a larger k and fewer bits than with the link as it is, and end each round with equal
replicas; a pilot whose bounds leave it nothing to choose trains bitwise as that fixed setting;
spawned workers and torchrun agree on every choice (the header checks it every round);
a checkpoint resumes the pilot where it was."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from groups import run_each, run_group
from parallelwrapper import ParallelWrapper
from parallelwrapper.autopilot import Autopilot, Choice, Pilot, Rung, Sizes, _Waits, levers
from parallelwrapper.config import Config, Pipeline, TrainingMode, steered
from parallelwrapper.job import Job
from parallelwrapper.listeners import autopilot_changes
from parallelwrapper.payloads import bits
from parallelwrapper.rounds import Rounds
from parallelwrapper.rounds.policy import Steered
from parallelwrapper.worker import Replica
from test_round_protocol import CPU, ListSource

pytestmark = pytest.mark.timeout(180)

START = Choice(1, "float32", 1)
MOMENTUM = Sizes(1000, 1000)  # a model trained with momentum: its optimizer's state as large as its parameters


def fly(
    pilots: list[Pilot], step_s: float, link_s: Callable[[Rung], float], rounds: int, first: int = 1, wait_s: float | Callable[[int], float] = 0.0, sizes: Sizes = MOMENTUM,
    codec_s: Callable[[Rung], float] = lambda rung: 0.0,
) -> list[Choice]:
    """Rounds as the engine runs them: each pilot's header, summed, landed on every pilot; a round's exchange (`link_s` plus `codec_s`, of which `codec_s` in its codec) is
    reported in the next header, with `wait_s` before it (`wait_s(k)` where the wait depends on the round's k; at once, summed apart, while the choice
    in force is unmeasured: Pilot.measured), but 0 for the first round of a coded
    rung that sends the optimizer's state where the rung before did not send it every round (that
    round averages every worker's state anew, in float32: no measure of the rung). Overlapped, each
    round lands late, and its measure is what the next round's steps do not hide of the link, and
    the codec's seconds. The choice each round ran with."""
    ran: list[Choice] = []
    previous: Rung | None = None
    exchange, coded, waited = 0.0, 0.0, 0.0
    for r in range(first, first + rounds):
        choice = pilots[0].choice
        headers = [p.header(step_s * choice.k, choice.k, exchange, coded, waited if exchange else 0.0, sizes) for p in pilots]
        summed = [sum(column) for column in zip(*headers)]
        changed = [p.landed(summed, len(pilots), r, late=choice.overlap) for p in pilots]
        rung = choice.rung
        anew = rung != previous and rung.payload != "float32" and rung.updaters_every != 0 and (previous is None or previous.updaters_every != 1)
        exchange, coded = (0.0, 0.0) if anew else (link_s(rung) + codec_s(rung), codec_s(rung))
        if choice.overlap:  # what the steps of the round after it do not hide, and its codec's compute
            exchange, coded = max(0.0, link_s(rung) - choice.k * step_s) + codec_s(rung), 0.0
        previous, waited = rung, wait_s(choice.k) if callable(wait_s) else wait_s
        if changed[0] is None and pilots[0].unmeasured:  # measured at once, not in the next header
            fair = len(pilots) * float(exchange > 0)
            for p in pilots:
                p.measured([len(pilots) * exchange, len(pilots) * coded, len(pilots) * (waited if exchange else 0.0), fair], len(pilots), r)
            exchange, coded = 0.0, 0.0
        ran.append(choice)
    return ran


def slow_link(rung: Rung) -> float:
    """A link slower than any codec: 0.5 s for float32 with the state every round, the seconds
    following the bytes."""
    return 0.5 * rung.bytes(MOMENTUM) / Rung("float32", 1).bytes(MOMENTUM)


@pytest.mark.fast
def test_a_fast_link_keeps_float32_and_a_small_k() -> None:
    pilot = Pilot(Autopilot(), START)
    ran = fly([pilot], step_s=0.05, link_s=lambda rung: 0.005, rounds=30)
    assert ran[-1] == Choice(2, "float32", 1)  # 0.005 s · 0.95 / (0.05 · 0.05 s) = 1.9 steps
    # By their bytes the parameters alone would run at k = 1: tried for a round, no faster on this
    # link (its seconds do not follow the bytes), so float32 with the state stays, at k = 2.
    assert {c.payload for c in ran} == {"float32"} and [c.choice for c in pilot.changes] == [Choice(1, "float32", 0), Choice(2, "float32", 1)]
    assert "float32 would need k = 2 to keep exchanges under 0.05 of the time, int8, parameters only k = 1; trying float32, parameters only" in pilot.changes[0].why
    assert "float32 exchanges in 0.005 s, float32, parameters only in 0.005 s: back to float32: k = 2 keeps exchanges under 0.05 of the time" in pilot.changes[1].why


@pytest.mark.fast
def test_a_slow_link_takes_bytes_off_first_straight_to_the_rung_they_need_then_overlaps() -> None:
    pilot = Pilot(Autopilot(k_max=32), START)
    ran = fly([pilot], step_s=0.01, link_s=slow_link, rounds=80)
    # float32 with the state would need k = 950, the parameters alone in int8 (1/8 of the bytes)
    # k = 128: it tries the one that runs the shortest k, and keeps it (measured 8x faster). That one
    # still needs k = 119: with no rung left, it overlaps, at k = 16, whose 0.16 s of steps take
    # twice its 0.0625 s (no codec time), and stays.
    assert [c.choice for c in pilot.changes] == [Choice(32, "int8", 0), Choice(16, "int8", 0, overlap=True)]
    why = "an exchange takes 0.5 s (0 s of it in the codec) and a step 0.01 s: float32 would need k = 950 to keep exchanges under 0.05 of the time"
    assert why + ", int8, parameters only k = 128; trying int8, parameters only, about 0.0625 s" in pilot.changes[0].why
    assert pilot.changes[1].why == (
        "an exchange takes 0.0625 s (0 s of it in the codec) and a step 0.01 s: at k = 32 (k_max), with no rung left to try, exchanges "
        "would still take 0.16 of the time (more than 2 x 0.05): overlapped from now on, each round landing after the next round's steps, "
        "at k = 16, whose steps hide the link's part"
    )
    assert ran[0] == START and ran[1] != START  # the first round's measure, summed at once, decides the second
    assert ran[1] == Choice(32, "int8", 0) and ran[2:] == [Choice(16, "int8", 0, overlap=True)] * 78  # the trial measured at once too
    coded = Pilot(Autopilot(k_max=32), Choice(16, "int8", 0))  # a codec's compute is not hidden: k keeps it under ρ
    fly([coded], step_s=0.01, link_s=lambda rung: 0.0625, rounds=5, codec_s=lambda rung: 0.01)
    assert coded.choice == Choice(32, "int8", 0, overlap=True)  # 0.0725 s: 0.0625 s hidden by k = 16, 0.01 s needs k = 19
    kept = Pilot(Autopilot(k_max=32, overlap=False), START)  # overlap_averaging(False): never overlapped
    assert fly([kept], step_s=0.01, link_s=slow_link, rounds=80)[-1] == Choice(32, "int8", 0)
    plain = Pilot(Autopilot(k_max=32, payloads=("float32",), updater_periods=(4,)), Choice(32, "float32", 4))
    assert not any(c.overlap for c in fly([plain], step_s=0.01, link_s=slow_link, rounds=20))  # DES-LOC's period does not overlap


@pytest.mark.fast
def test_it_overlaps_only_where_the_epochs_rounds_hide_the_link() -> None:
    # As above, int8 needs k = 119 and k_max is 32, and overlapped it would run k = 16. But an
    # epoch's last round lands at once (a fit's too): in an epoch of 16 steps (one round) that
    # hides nothing, in one of 32 (two rounds) one exchange of two, which costs what k = 32 landed
    # at once does; in one of 64, three of four. Not known (a queue): it overlaps, as before.
    for epoch, overlaps in ((16, False), (32, False), (64, True), (None, True)):
        pilot = Pilot(Autopilot(k_max=32), START)
        pilot.steps(None, epoch)
        ran = fly([pilot], step_s=0.01, link_s=slow_link, rounds=20)
        assert ran[-1] == (Choice(16, "int8", 0, overlap=True) if overlaps else Choice(32, "int8", 0)), epoch


@pytest.mark.fast
def test_overlapped_rounds_the_steps_do_not_hide_lengthen_k_and_never_shorten_it() -> None:
    # Overlapped at k = 16 (0.16 s of steps), a link of 0.5 s leaves 0.34 s a round to wait:
    # 68% of the time. After two such rounds it takes the link for 0.16 + 0.34 s, and k = 128,
    # whose 1.28 s of steps take more than twice that; there nothing waits, and it stays.
    pilot = Pilot(Autopilot(k_max=128), Choice(16, "int8", 0, overlap=True))
    ran = fly([pilot], step_s=0.01, link_s=lambda rung: 0.5, rounds=12)
    assert [(c.round, c.choice) for c in pilot.changes] == [(5, Choice(128, "int8", 0, overlap=True))]  # decided as round 3 lands, late: round 4 has done its steps
    assert pilot.changes[0].why == (
        "overlapped rounds at k = 16 still cost 0.34 s each to launch and land, and a step takes 0.01 s: 0.68 of the time (more than 0.05); "
        "the link takes about 0.5 s: k = 128 (k_max), whose steps hide it"
    )
    assert ran[-1] == Choice(128, "int8", 0, overlap=True)
    bounded = Pilot(Autopilot(k_max=32), Choice(16, "int8", 0, overlap=True))  # at k_max it stays, whatever it waits
    assert fly([bounded], step_s=0.01, link_s=lambda rung: 0.5, rounds=12)[-1] == Choice(32, "int8", 0, overlap=True)
    hidden = Pilot(Autopilot(k_max=128), Choice(64, "int8", 0, overlap=True))  # a link its steps hide: no shorter k
    assert fly([hidden], step_s=0.01, link_s=lambda rung: 0.05, rounds=12)[-1] == Choice(64, "int8", 0, overlap=True) and not hidden.changes
    resumed = Pilot(Autopilot(k_max=128), Choice(16, "int8", 0, overlap=True))  # a checkpoint between its two measures
    fly([resumed], step_s=0.01, link_s=lambda rung: 0.5, rounds=2)
    again = Pilot(Autopilot(k_max=128), Choice(16, "int8", 0, overlap=True))
    again.load_state_dict(resumed.state_dict())
    assert again.state_dict() == resumed.state_dict()
    barred = Pilot(Autopilot(k_max=128, overlap=False), START)  # resumed with overlap_averaging(False): the same k and rung, landed at once
    barred.load_state_dict(resumed.state_dict())
    assert barred.choice == Choice(16, "int8", 0)


@pytest.mark.fast
def test_it_sends_the_most_bytes_that_run_at_the_shortest_k_and_never_lengthens_k_for_bytes() -> None:
    pilot = Pilot(Autopilot(k_max=32), START)
    ran = fly([pilot], step_s=0.01, link_s=lambda rung: 0.03 * rung.bytes(MOMENTUM) / Rung("float32", 1).bytes(MOMENTUM), rounds=40)
    # float32 every round needs k = 57; the parameters alone in bfloat16, 14; in int8, 7: k = 8,
    # and no rung with more bytes runs at 8 (the first version sent bfloat16 at k = 16).
    assert [c.choice for c in pilot.changes] == [Choice(8, "int8", 0)] and ran[-1] == Choice(8, "int8", 0)
    plain = Pilot(Autopilot(k_max=32), START)  # an optimizer without state: only fewer bits send less
    ran = fly([plain], step_s=0.01, link_s=lambda rung: 0.012 * bits(rung.payload) / 32, rounds=40, sizes=Sizes(1000, 0))
    assert ran[-1] == Choice(8, "int8", 1)


@pytest.mark.fast
def test_a_wait_for_the_others_lengthens_k_as_far_as_a_longer_round_hides_it_and_never_changes_the_payload() -> None:
    pilot = Pilot(Autopilot(k_max=16), START)
    ran = fly([pilot], step_s=0.05, link_s=lambda rung: 0.005, rounds=30, wait_s=0.05)
    assert ran[-1] == Choice(16, "float32", 1)  # (0.005 + 0.05) s · 0.95 / (0.05 · 0.05 s) = 20.9 steps: k_max
    assert {c.rung for c in ran} == {Rung("float32", 1)}  # the link's own share at k = 16 is 0.6%: no rung tried
    # A wait of 6 steps at every k (a worker that starts its exchange late) is a round's: measured
    # at one k, half of it is taken for a round's and half for a step's (k = 16); measured at two,
    # none grows with k, and a round long enough to hide it all is k_max.
    late = Pilot(Autopilot(k_max=128), START)
    ran = fly([late], step_s=0.05, link_s=lambda rung: 0.005, rounds=30, wait_s=0.3)
    assert [c.choice.k for c in late.changes] == [16, 128] and ran[-1] == Choice(128, "float32", 1)
    assert "an exchange takes 0.005 s after 0.3 s (0.15 s a round, 150 ms a step: halved: measured at one k) waiting" in late.changes[0].why
    assert "after 0.3 s (a round's: no growth beyond its noise over 2 ks) waiting" in late.changes[1].why
    # A wait that grows with k (a slower worker with its own batches, 2 ms behind each step) is a
    # step's: no k hides it, and k stays where the exchange alone puts it.
    slower = Pilot(Autopilot(k_max=128), START)
    ran = fly([slower], step_s=0.05, link_s=lambda rung: 0.005, rounds=30, wait_s=lambda k: 0.002 * k)
    assert ran[-1] == Choice(4, "float32", 1)  # k = 1, then 4 (half of k = 1's wait a round's); fitted: 0.005 s · 0.95 / (0.05 · 0.052 s) = 1.8 steps, not below FALL
    mixed = Pilot(Autopilot(k_max=128), START)
    ran = fly([mixed], step_s=0.05, link_s=lambda rung: 0.005, rounds=30, wait_s=lambda k: 0.05 + 0.002 * k)
    assert ran[-1] == Choice(32, "float32", 1)  # (0.005 + 0.05) s · 0.95 / (0.05 · 0.052 s) = 20.1 steps
    assert "after 0.066 s (0.05 s a round, 2 ms a step: fitted over 2 ks) waiting for the others" in mixed.changes[-1].why


@pytest.mark.fast
def test_a_codec_slower_than_the_link_keeps_float32_after_trying_it() -> None:
    pilot = Pilot(Autopilot(k_max=8, updater_periods=(1,), overlap=False), START)
    link = {"float32": 0.2, "bfloat16": 0.26, "int8": 0.3}
    ran = fly([pilot], step_s=0.01, link_s=lambda rung: link[rung.payload], rounds=40)
    assert [c.choice.payload for c in pilot.changes] == ["int8", "float32"]  # no rung fits: the fewest bytes tried
    assert ran[-1] == Choice(8, "float32", 1)
    assert "float32 exchanges in 0.2 s, int8 in 0.3 s: back to float32: k = 8 (k_max)" in pilot.changes[-1].why


@pytest.mark.fast
def test_a_link_that_changes_is_followed_at_once_both_ways_and_the_search_starts_again() -> None:
    """A measure twice its mean or more (or half or less) replaces the mean, drops what the other
    rungs measured on the old link and lifts the rest a rejected trial put on the search. int8's
    codec takes 0.05 s. On a fast link float32 fits; 20x slower, int8 is tried, is slower, and
    float32 is kept; 10x slower again, int8 is tried again and kept (before, a rejected rung was
    never tried again); back on the fast link, float32 returns (before, a rung that did not fit
    only ever looked down, whatever its codec cost)."""
    pilot = Pilot(Autopilot(k_max=8, updater_periods=(1,), overlap=False), START)
    codec = {"float32": 0.0, "bfloat16": 0.03, "int8": 0.05}

    def link(float32_s: float) -> Callable[[Rung], float]:  # the link's part follows the bytes
        return lambda rung: float32_s * bits(rung.payload) / 32

    def run(float32_s: float, first: int) -> list[Choice]:
        return fly([pilot], step_s=0.01, link_s=link(float32_s), rounds=20, first=first, sizes=Sizes(1000, 0), codec_s=lambda rung: codec[rung.payload])

    assert run(0.001, 1)[-1] == Choice(2, "float32", 1)  # fits at k = 2
    assert run(0.02, 21)[-1] == Choice(8, "float32", 1) and pilot.changes[-1].why.startswith("float32 exchanges in 0.02 s, int8 in 0.055 s: back to float32")
    slower = run(0.2, 41)
    assert slower[3:] == [Choice(8, "int8", 1)] * 17 and "an exchange takes 0.2 s" in pilot.changes[-1].why
    back = run(0.001, 61)
    assert back[-1] == Choice(2, "float32", 1), [c.why for c in pilot.changes[-3:]]


@pytest.mark.fast
def test_a_link_that_falls_is_followed_within_two_rounds_even_where_the_state_goes_every_four() -> None:
    """Under a rung whose state travels every 4 rounds, the autopilot waits for 4 measures before
    it decides, but a measure that jumped is decided on at once: the fall's first exchange lands in
    the next round's header, and the round after that runs the new rung."""
    pilot = Pilot(Autopilot(k_max=32, payloads=("float32", "int8"), updater_periods=(4, 0)), Choice(8, "float32", 4))
    codec = lambda rung: 0.02 if rung.payload == "int8" else 0.0  # noqa: E731
    steady = fly([pilot], step_s=0.05, link_s=following_bytes(0.0295), rounds=12, codec_s=codec)
    assert steady[-1] == Choice(8, "float32", 4), [c.why for c in pilot.changes]  # k = 7 for it, 9 for int8's codec
    fallen = fly([pilot], step_s=0.05, link_s=following_bytes(0.59), rounds=8, first=13, codec_s=codec)
    assert fallen[0] == fallen[1] == Choice(8, "float32", 4) and fallen[2] != fallen[0], fallen  # measured in round 14's header, in force from 15
    assert fallen[-1] == Choice(32, "int8", 0), [c.why for c in pilot.changes]


@pytest.mark.fast
def test_a_climb_goes_no_further_than_its_estimate_reaches() -> None:
    """From a sparse round a link's burst lets through at once (0.001 s for 28 KB), every rung's
    estimate runs at k = 1 (steps of 10 s); the climb tries the nearest rung above (int8, 35x the
    bytes: nothing is within REACH = 16x), not float32 (141x), whose round would take 16 s, and
    comes back from int8's 4 s."""
    pilot = Pilot(Autopilot(k_max=64, payloads=("float32", "int8", "sparse"), updater_periods=(0,)), Choice(16, "sparse", 0))
    sizes = Sizes(1_000_000, 0)

    def burst(rung: Rung) -> float:  # 64 KB pass at once, the rest at 0.25 MB/s
        size = rung.bytes(sizes)
        return 0.001 if size <= 64_000 else size / 250_000

    ran = fly([pilot], step_s=10.0, link_s=burst, rounds=12, sizes=sizes)
    assert [c.choice.payload for c in pilot.changes][:2] == ["int8", "sparse"], [c.why for c in pilot.changes]
    assert "float32" not in {c.payload for c in ran} and ran[-1].payload == "sparse"


@pytest.mark.fast
def test_the_bounds_and_the_levers_the_user_set_are_kept() -> None:
    pilot = Pilot(Autopilot(k_min=4, k_max=16, payloads=("bfloat16",), updater_periods=(1,)), Choice(4, "bfloat16", 1))
    ran = fly([pilot], step_s=0.01, link_s=slow_link, rounds=40)
    assert {c.rung for c in ran} == {Rung("bfloat16", 1)} and ran[-1].k == 16
    fast = Pilot(Autopilot(k_min=4, k_max=16), Choice(4, "float32", 1))
    assert {c.k for c in fly([fast], step_s=0.05, link_s=lambda rung: 1e-4, rounds=20)} == {4}  # never below k_min
    model = nn.Linear(3, 2)
    options = ParallelWrapper.builder(model).averaging_frequency("auto", k_max=32).payload_dtype("int8")._options
    spec = levers(options)["autopilot"]
    assert spec.rungs == (Rung("int8", 1), Rung("int8", 0)) and spec.k_max == 32
    options = ParallelWrapper.builder(model).averaging_frequency("auto").average_updaters(True, every=4)._options
    assert levers(options)["autopilot"].rungs == (Rung("float32", 4),)
    options = ParallelWrapper.builder(model).averaging_frequency("auto").average_updaters(False)._options
    assert levers(options)["autopilot"].rungs == (Rung("float32", 0), Rung("bfloat16", 0), Rung("int8", 0))
    assert levers(options)["autopilot"].overlap and not levers({**options, "overlap_averaging": False})["autopilot"].overlap
    assert "autopilot" not in ParallelWrapper.builder(model).averaging_frequency("auto").averaging_frequency(4)._options


@pytest.mark.fast
def test_it_starts_in_the_middle_of_its_bounds_with_the_fewest_bytes() -> None:
    assert [Autopilot(lo, hi).k_start for lo, hi in ((1, 64), (1, 4), (1, 32), (4, 16), (4, 4), (3, 50))] == [8, 2, 8, 8, 4, 12]
    model = nn.Linear(3, 2)
    started = levers(ParallelWrapper.builder(model).averaging_frequency("auto")._options)
    assert (started["averaging_frequency"], started["payload_dtype"], started["average_updaters"]) == (16, "int8", False)
    assert Autopilot(updater_periods=(1, 2, 4)).start == Rung("int8", 1)  # no 'never' to choose: a coded payload's state goes every round
    assert Autopilot(payloads=("float32",), updater_periods=(1, 2, 4)).start == Rung("float32", 4)  # float32 alone: the longest period
    assert Autopilot(payloads=("float32", "bfloat16")).start == Rung("bfloat16", 0)
    started = levers(ParallelWrapper.builder(model).averaging_frequency("auto").average_updaters(True)._options)
    assert (started["payload_dtype"], started["average_updaters"], started["average_updaters_every"]) == ("int8", True, 1)
    started = levers(ParallelWrapper.builder(model).averaging_frequency("auto").payload_dtype("float32")._options)
    assert (started["payload_dtype"], started["average_updaters"]) == ("float32", False)


def following_bytes(seconds: float) -> Callable[[Rung], float]:
    """A link whose exchanges take `seconds` for float32 with the state every round, the others'
    in proportion to their bytes."""
    return lambda rung: seconds * rung.bytes(MOMENTUM) / Rung("float32", 1).bytes(MOMENTUM)


@pytest.mark.fast
def test_from_its_start_a_fast_link_climbs_to_the_most_bytes_at_the_shortest_k_and_a_slow_one_stays_at_k_max() -> None:
    start = Autopilot().start.at(Autopilot().k_start)
    assert start == Choice(16, "int8", 0)
    pilot = Pilot(Autopilot(), start)
    ran = fly([pilot], step_s=0.05, link_s=following_bytes(0.005), rounds=30)
    # int8 of the parameters alone takes 0.000625 s, k = 1: of the rungs with more bytes, the
    # parameters alone in float32 (0.0025 s) still run at k = 1, float32 with the state (by its
    # bytes 0.005 s) would need k = 2.
    assert pilot.changes[0].choice == Choice(1, "float32", 0) and ran[-1] == Choice(1, "float32", 0)
    assert "an exchange takes 0.000625 s (0 s of it in the codec) and a step 0.05 s: float32, parameters only would take about 0.0025 s and need k = 1, within k = 1" in pilot.changes[0].why
    assert ran[0] == start and ran[1] == Choice(1, "float32", 0)  # measured in the first round, decided as it lands, in force from the second
    slow = Pilot(Autopilot(k_max=32, overlap=False), start)  # (with overlap it would overlap next: above)
    ran = fly([slow], step_s=0.01, link_s=slow_link, rounds=40)
    # int8 of the parameters alone needs k = 119: nothing sends fewer bytes, so k goes to its bound.
    assert [c.choice for c in slow.changes] == [Choice(32, "int8", 0)] and ran[-1] == Choice(32, "int8", 0)
    assert "an exchange takes 0.0625 s after 0 s waiting for the others, and a step 0.01 s: k = 32 (k_max)" in slow.changes[0].why


@pytest.mark.fast
def test_the_codecs_seconds_are_not_taken_to_follow_the_bytes() -> None:
    # On a fast link int8's exchange is mostly its codec: 0.004 s of compute and 0.000625 s on the
    # link. By the bytes alone float32's parameters would take 0.0123 s and need k = 5, more than
    # int8's 2; without the codec, it takes the link's 0.0025 s: k = 1, as fast as any.
    start = Choice(4, "int8", 0)
    pilot = Pilot(Autopilot(k_max=8), start)
    codec = lambda rung: 0.004 * rung.elements(MOMENTUM) / MOMENTUM.parameters if rung.payload != "float32" else 0.0  # noqa: E731
    ran = fly([pilot], step_s=0.05, link_s=following_bytes(0.005), rounds=30, codec_s=codec)
    assert [c.choice for c in pilot.changes] == [Choice(1, "float32", 0)] and ran[-1] == Choice(1, "float32", 0)
    assert "an exchange takes 0.00462 s (0.004 s of it in the codec) and a step 0.05 s: float32, parameters only would take about 0.0025 s and need k = 1" in pilot.changes[0].why
    # A slower link: int8's parameters, 0.0165 s, k = 8; bfloat16's would need k = 16 (the first
    # version, which sent the most bytes that kept k at half of k_max, sent float32 with the state
    # every 2 rounds at k = 32).
    middling = Pilot(Autopilot(k_max=64), start)
    ran = fly([middling], step_s=0.05, link_s=following_bytes(0.1), rounds=40, codec_s=codec)
    assert [c.choice for c in middling.changes] == [Choice(8, "int8", 0)] and ran[-1] == Choice(8, "int8", 0)


@pytest.mark.fast
def test_a_climb_the_link_does_not_bear_goes_back_and_stays() -> None:
    # The state's bytes cost far more than their share (15% of the numbers): the estimate climbs,
    # the measure refuses.
    link = {0: 0.005, 1: 0.5, 2: 0.5, 4: 0.5}
    pilot = Pilot(Autopilot(k_max=32, payloads=("float32",)), Choice(8, "float32", 0))
    ran = fly([pilot], step_s=0.06, link_s=lambda rung: link[rung.updaters_every], rounds=40, sizes=Sizes(1000, 150))
    assert [c.choice.updaters_every for c in pilot.changes] == [1, 0]
    assert "float32 exchanges in 0.5 s, which would need k = 158 (more than 2): back to float32, parameters only, 0.005 s: k = 2" in pilot.changes[1].why
    assert ran[-1].rung == Rung("float32", 0) and ran[-10:] == [ran[-1]] * 10


@pytest.mark.fast
def test_a_resumed_pilot_decides_as_the_uninterrupted_one() -> None:
    def wait(k: int) -> float:
        return 0.01 + 0.0005 * k  # its waits, measured at each k, carry over too

    whole = Pilot(Autopilot(k_max=32), START)
    fly([whole], 0.01, slow_link, 80, wait_s=wait)
    first = Pilot(Autopilot(k_max=32), START)
    fly([first], 0.01, slow_link, 23, wait_s=wait)  # mid-descent
    assert len(first.state_dict()["waits"]) >= 2
    resumed = Pilot(Autopilot(k_max=32), START)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint keeps it
    fly([resumed], 0.01, slow_link, 57, first=24, wait_s=wait)
    assert resumed.changes == whole.changes and resumed.choice == whole.choice
    older = {k: v for k, v in first.state_dict().items() if k not in ("codecs", "waits")}  # from before codecs and each k's wait were measured
    older["wait"] = first.state_dict()["waits"].get(first.choice.k, (0.0, 0))  # the wait at the k in force (none yet: just changed)
    earlier = Pilot(Autopilot(k_max=32), START)
    earlier.load_state_dict(older)  # type: ignore[arg-type]
    fly([earlier], 0.01, slow_link, 57, first=24, wait_s=wait)
    assert earlier.choice == whole.choice  # its links taken as having no codec time (slow_link has none), its wait as measured at the k in force


@pytest.mark.fast
def test_a_rounds_wait_counts_at_the_steps_it_ran_not_at_k() -> None:
    """An epoch's tail run in the round before (more steps than k) or a fit's last round (fewer)
    waits as a round of its own steps: counted at k, a tail's longer wait would read in the fit of
    w(k) = a + b·k as k's own."""
    pilot = Pilot(Autopilot(k_max=128, payloads=("float32",), updater_periods=(0,)), Choice(64, "float32", 0))

    def land(r: int, steps: int, exchange_s: float = 0.0, waited_s: float = 0.0) -> None:  # one worker's round: its steps, and the last exchange
        assert pilot.landed(pilot.header(1.0 * steps, steps, exchange_s, 0.0, waited_s, MOMENTUM), 1, r) is None

    land(1, 64)
    pilot.measured([2.85, 0.0, 0.5, 1.0], 1, 1)  # unmeasured: its exchange summed at once, the wait before it 0.5 s
    land(2, 112)  # the epoch's tail run in this round
    land(3, 64, exchange_s=2.85, waited_s=0.9)  # round 2's exchange, in round 3's header
    land(4, 20, exchange_s=2.85, waited_s=0.5)  # round 3's
    land(5, 64, exchange_s=2.85, waited_s=0.2)  # round 4's: a fit's last, short round
    assert {k: count for k, (_, count, _) in pilot.state_dict()["waits"].items()} == {64: 2, 112: 1, 20: 1}
    resumed = Pilot(Autopilot(k_max=128, payloads=("float32",), updater_periods=(0,)), START)
    resumed.load_state_dict(json.loads(json.dumps(pilot.state_dict())))  # a checkpoint keeps the steps the last round ran
    assert resumed.state_dict()["ran_steps"] == 64


@pytest.mark.fast
def test_an_epochs_tail_too_short_for_its_exchange_runs_in_the_round_before() -> None:
    pilot = Pilot(Autopilot(k_max=128, payloads=("float32",), updater_periods=(0,)), Choice(64, "float32", 0))
    assert pilot.steps(112) == 64  # nothing measured: no exchange to weigh a tail against
    fly([pilot], step_s=1.0, link_s=lambda rung: 2.85, rounds=3)  # an exchange needs 2.85 · 0.95 / (0.05 · 1 s) = 54.15 steps
    assert pilot.choice == Choice(64, "float32", 0) and not pilot.changes
    # A tail of 48 steps would cost its exchange more than ρ of its time: the round runs to the epoch's end.
    assert pilot.steps(112) == 112
    assert pilot.steps(119) == 64  # a tail of 55 steps pays for its exchange
    assert [pilot.steps(left) for left in (None, 64, 30, 129)] == [64] * 4  # not known, no tail, the last round, past k_max
    resumed = Pilot(Autopilot(k_max=128, payloads=("float32",), updater_periods=(0,)), START)
    resumed.load_state_dict(json.loads(json.dumps(pilot.state_dict())))
    assert resumed.steps(112) == 112
    # Just after a change, the new choice's exchange is what it was expected to take.
    climbed = Pilot(Autopilot(k_max=256), START)
    fly([climbed], step_s=0.01, link_s=slow_link, rounds=1)
    assert climbed.choice == Choice(128, "int8", 0) and climbed.unmeasured  # about 0.0625 s: 0.0625 · 0.95 / (0.05 · 0.01 s) = 119 steps
    assert (climbed.steps(200), climbed.steps(250)) == (200, 128)
    overlapped = Pilot(Autopilot(k_max=128), Choice(16, "int8", 0, overlap=True))
    fly([overlapped], step_s=0.01, link_s=lambda rung: 0.5, rounds=1)
    assert overlapped.steps(20) == 16  # a round landed late: its steps hide the link, whatever their number


@pytest.mark.fast
def test_every_rank_decides_the_same_from_the_sums_whatever_it_measured() -> None:
    pilots = [Pilot(Autopilot(k_max=32), START) for _ in range(3)]
    exchange = 0.0
    for r in range(1, 40):  # each rank measures its own: rank i's steps take (1 + i) times rank 0's, its exchanges differ too
        k = pilots[0].choice.k
        headers = [p.header(0.01 * (1 + i) * k, k, exchange * (1 + i), 0.0, 0.0, MOMENTUM) for i, p in enumerate(pilots)]
        summed = [sum(column) for column in zip(*headers)]
        for p in pilots:
            p.landed(summed, 3, r)
        assert len({p.choice for p in pilots}) == 1
        exchange = slow_link(pilots[0].choice.rung)
    assert pilots[0].changes and [c.choice for c in pilots[2].changes] == [c.choice for c in pilots[0].changes]
    stray = Pilot(Autopilot(), Choice(4, "float32", 1))  # a worker that ran another k than the others
    summed = [a + b for a, b in zip(pilots[0].header(0.1, 8, 0.0, 0.0, 0.0, MOMENTUM), stray.header(0.1, 4, 0.0, 0.0, 0.0, MOMENTUM))]
    with pytest.raises(RuntimeError, match=r"^the autopilot's workers ran round 9 with different choices .*: a bug; set a fixed k"):
        stray.landed(summed, 2, 9)


@pytest.mark.fast
def test_auto_refuses_what_it_cannot_steer_and_bad_bounds() -> None:
    b = ParallelWrapper.builder(nn.Linear(3, 2)).workers(1)
    for options, reason in (
        ({"training_mode": TrainingMode.SHARED_GRADIENTS}, "TrainingMode.SHARED_GRADIENTS, which averages every step"),
        ({"deterministic": True}, r"deterministic\(True\): it chooses from measured times"),
        ({"overlap_averaging": True}, r"overlap_averaging\(True\): it turns overlap on itself, as its last resort"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^averaging_frequency\('auto'\) does not go with {reason}"):
            Config(autopilot=Autopilot(), **options)
    with pytest.raises(ValueError, match=r"payloads \['int3'\] are not payloads; choose among"):
        Config(autopilot=Autopilot(payloads=("float32", "int3")))
    with pytest.raises(ValueError, match=r"^averaging_frequency\('auto'\): k_min 8 is above k_max 4; e\.g\."):
        b.averaging_frequency("auto", k_min=8, k_max=4)
    with pytest.raises(ValueError, match=r"exchange_share must be a number in \(0, 1\), got 1\.5"):
        b.averaging_frequency("auto", exchange_share=1.5)
    with pytest.raises(ValueError, match=r"^averaging_frequency takes an int >= 1 or 'auto', got 'fast'"):
        b.averaging_frequency("fast")
    with pytest.raises(ValueError, match=r"deterministic\(True\)"):
        b.averaging_frequency("auto").deterministic(True).build()


@pytest.mark.fast
def test_it_chooses_only_what_the_table_runs_beside_the_other_options() -> None:
    # The optimizer state every 2 or 4 rounds goes with neither a pipeline nor replacement
    # (config.CONFLICTS): beside them, those periods are not its to choose.
    free = steered(Config(autopilot=Autopilot()))
    assert free.autopilot is not None and free.autopilot.updater_periods == (1, 2, 4, 0) and free.autopilot.overlap
    for options in ({"pipeline": Pipeline()}, {"on_worker_failure": "replace"}):
        config = steered(Config(**levers({"autopilot": Autopilot(), **options})))
        assert config.autopilot is not None and config.autopilot.updater_periods == (1, 0), options
        assert (config.payload_dtype, config.average_updaters) == ("int8", False)  # its start, the fewest bytes
    built = ParallelWrapper.builder(nn.Linear(3, 2)).workers(2).averaging_frequency("auto").on_worker_failure("replace").build()
    assert built.config.autopilot is not None and built.config.autopilot.updater_periods == (1, 0)
    built.close()


@pytest.mark.fast
def test_the_changes_are_read_off_the_scores() -> None:
    from parallelwrapper import Score

    scores = [Score(r, 0, 0, 0, 1.0, 0.0, k=k, why=why) for r, k, why in ((1, 1, None), (2, 1, "faster"), (3, 8, None), (4, 8, None))]
    assert autopilot_changes(scores) == [{"round": 3, "k": 8, "payload": "float32", "updaters_every": 1, "overlap": False, "why": "faster"}]
    # Overlapped, the round after the one whose landing decided has done its steps already.
    overlapped = [Score(r, 0, 0, 0, 1.0, 0.0, k=k, overlap=o, why=why) for r, k, o, why in ((1, 8, False, "slow"), (2, 8, True, None), (3, 8, True, "waits"), (4, 8, True, None), (5, 32, True, None))]
    assert [(c["round"], c["k"], c["overlap"]) for c in autopilot_changes(overlapped)] == [(2, 8, True), (5, 32, True)]


# -- real processes ------------------------------------------------------------------------------


def _slowed(seconds_per_mb: float) -> None:
    """Slow this process's exchanges in proportion to their bytes, as a slow link would: each
    all-reduce and each coded send waits its bytes' time first."""
    import torch.distributed as dist

    from parallelwrapper import wire

    def wait_for(nbytes: int) -> None:
        time.sleep(nbytes / 1e6 * seconds_per_mb)

    # The functions as they were before any slowing: a second call in the same process replaces the slowing, not adds to it.
    all_reduce = getattr(dist.all_reduce, "unslowed", dist.all_reduce)
    send_coded = getattr(wire.send_coded, "unslowed", wire.send_coded)

    def slow_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        wait_for(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    def slow_send_coded(coder: Any, scale: float, group: Any) -> Any:
        works = send_coded(coder, scale, group)
        wait_for(sum(row[r].numel() * row[r].element_size() for row in coder.inbox for r in range(coder.ranks) if r != coder.rank))
        return works

    slow_all_reduce.unslowed, slow_send_coded.unslowed = all_reduce, send_coded  # type: ignore[attr-defined]
    dist.all_reduce = slow_all_reduce
    wire.send_coded = slow_send_coded
    import parallelwrapper.averaging as averaging
    import parallelwrapper.delta_averaging as delta_averaging

    averaging.send_coded = slow_send_coded  # type: ignore[attr-defined]
    delta_averaging.send_coded = slow_send_coded  # type: ignore[attr-defined]  # overlapped rounds


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def _auto_worker(rank: int, world: int, seconds_per_mb: float, batches: int) -> tuple[list[Choice], list[torch.Tensor]]:
    if seconds_per_mb:
        _slowed(seconds_per_mb)
    model = _model()
    job = Job(model, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, nn.functional.cross_entropy, None)
    # The payload alone: float32, bfloat16, int8 (the optimizer state's periods are the fast tier's;
    # overlap, which the slowed link would reach after int8 at k_max, has a test of its own).
    config = Config(**levers({"workers": world, "autopilot": Autopilot(k_max=32, updater_periods=(1,), overlap=False)}))
    rounds = Rounds(Replica(model, job, config, CPU, rank, world), config, CPU, rank, world)
    g = torch.Generator().manual_seed(rank)
    # Batches large enough that, unslowed, a step takes several times an exchange even with the
    # wait for the other worker: exchanges stay far under 5% of the time at k_max.
    data = [(torch.randn(2048, 32, generator=g), torch.randint(0, 4, (2048,), generator=g)) for _ in range(batches)]
    assert isinstance(rounds.policy, Steered)
    rounds.run(1, ListSource(data, rank, world), lambda r: None)
    choices = [rounds.policy.pilot.choice]
    rounds.run(2, ListSource(data, rank, world), lambda r: None)  # the second fit starts where the first ended
    choices.append(rounds.policy.pilot.choice)
    return [*choices, *(c.choice for c in rounds.policy.pilot.changes)], [p.detach().clone() for p in model.parameters()]


def _bounded_worker(rank: int, world: int, auto: bool) -> list[torch.Tensor]:
    model = _model()
    job = Job(model, torch.optim.AdamW, {"lr": 0.001, "weight_decay": 0.1}, nn.functional.cross_entropy, None)
    if auto:  # bounds that leave it nothing to choose: k = 4, float32, the state every round, no overlap
        config = Config(**levers({"workers": world, "autopilot": Autopilot(k_min=4, k_max=4, payloads=("float32",), updater_periods=(1,), overlap=False)}))
    else:
        config = Config(workers=world, averaging_frequency=4)
    rounds = Rounds(Replica(model, job, config, CPU, rank, world), config, CPU, rank, world)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(24)]
    for epochs in (1, 2):
        rounds.run(epochs, ListSource(data, rank, world), lambda r: None)
    return [p.detach().clone() for p in model.parameters()]


def test_a_pilot_left_nothing_to_choose_trains_bitwise_as_the_fixed_setting() -> None:
    auto, fixed = run_each(_bounded_worker, 2, [(True,), (False,)], timeout=240)
    assert all(torch.equal(a, f) for a, f in zip(auto[0], fixed[0]))  # its header's part and barrier change nothing else


def test_a_slowed_exchange_picks_fewer_bits_and_a_larger_k_and_replicas_end_equal() -> None:
    # The slow link's run second: it slows the processes' exchanges from then on.
    fast, slow = run_each(_auto_worker, 2, [(0.0, 120), (0.5, 200)], timeout=300)  # ~2 MB/s: 0.6 MB of state takes ~0.3 s
    for workers in (fast, slow):
        assert workers[0][0] == workers[1][0]  # the same choices on both ranks, in the same order
        for a, b in zip(workers[0][1], workers[1][1]):
            assert torch.equal(a, b)  # every fit ends on the average
    fast_choices, slow_choices = fast[0][0], slow[0][0]
    slow_end = slow_choices[1]
    # From int8 (the fewest bytes) the fast link climbs to more bits, which run at the shortest k
    # (float32 on a quiet machine). Where it ends depends on loopback's noise: an exchange that
    # takes twice its mean or half starts the search again, and a noisy measure may keep int8
    # (kept when 10% faster): two assertions that it ends above int8 failed on a loaded machine.
    # The slowed one keeps int8, at k_max.
    assert any(bits(c.payload) > 8 for c in fast_choices), fast_choices
    assert slow_end.k == 32 and {c.payload for c in slow_choices} == {"int8"}, slow_choices  # every payload needs more than k_max: it stays with the fewest bytes


def _slow_loss(output: torch.Tensor, target: torch.Tensor, seconds: float = 0.15) -> torch.Tensor:
    """Cross-entropy, `seconds` late: a step as long as a large model's."""
    time.sleep(seconds)
    return nn.functional.cross_entropy(output, target)


def _folding_worker(rank: int, world: int, known: bool) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """float32 of the parameters alone at k of at most 16 (from 4), steps of 0.05 s, exchanges of
    at least 0.27 s (0.9 s a MB), ρ = 0.5, over an epoch of 22 steps a worker whose length the
    source tells (`known`) or not: each Score's k and iteration, and the parameters at the end."""
    from parallelwrapper.types import Score

    _slowed(0.9)
    job = Job(_model(), torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, functools.partial(_slow_loss, seconds=0.05), None)
    auto = Autopilot(k_max=16, exchange_share=0.5, payloads=("float32",), updater_periods=(0,))
    config = Config(**levers({"workers": world, "autopilot": auto}))
    rounds = Rounds(Replica(job.model, job, config, CPU, rank, world), config, CPU, rank, world)
    reports: list[object] = []
    rounds.run(1, ListSource(_tiny_data(22), rank, world, known=known), reports.append)
    return [(r.k, r.iteration) for r in reports if isinstance(r, Score)], [p.detach().clone() for p in job.model.parameters()]


def test_the_autopilot_runs_an_epochs_short_tail_in_the_round_before_where_it_knows_the_length() -> None:
    # The start round (k = 4) measures about 0.28 s against steps of 0.05 s: k = 8 (it needs
    # 0.28 · 0.5 / (0.5 · 0.05 s) = 5.6 steps; any exchange of 0.2-0.4 s gives k = 8, a window
    # wide for a loaded machine's latency). After 12 steps, 10 are left: a tail of 2 steps would
    # spend 0.28 s on 0.1 s of work, so the round takes all 10 and the epoch ends with it
    # (iterations: the batches of both workers). Where it cannot know, the tail is a round of its own.
    cases = ((True, [(4, 8), (8, 24), (10, 44)]), (False, [(4, 8), (8, 24), (8, 40), (8, 44)]))
    for (known, rounds), ((seen, params), (other, others)) in zip(cases, run_each(_folding_worker, 2, [(known,) for known, _ in cases], timeout=240)):
        assert seen == other == rounds, (known, seen)
        assert all(torch.equal(a, b) for a, b in zip(params, others))


def _overlapping_worker(rank: int, world: int) -> tuple[list[Choice], list[list[tuple[int, bool]]], list[int], list[torch.Tensor]]:
    """int8 of the parameters alone at k of at most 8, steps of 0.15 s, over a link far too slow
    for it that no step hides (each send waits its bytes' time before it goes): the choices it
    made, each fit's Scores' k and overlap, each fit's all-reduces of the parameters in full
    precision, and the parameters after a second fit resumed from the first's own state in a new
    round engine (as a checkpoint resumes it)."""
    import torch.distributed as dist

    from parallelwrapper.types import Score

    # 2.2 s a MB: an int8 round of 75k parameters takes at least 0.165 s. It overlaps at k = 4 where
    # the link measures 0.134-0.3 s (k_max's steps leave it over 2 x 0.05 of the time; k = 4's steps
    # take twice it): a window wide enough for a loaded machine's latency (CI measured over 0.2 s
    # where steps of 0.1 s left it 0.089-0.2).
    _slowed(2.2)
    whole: list[int] = []  # the all-reduces of a buffer of parameters (a coded round sends none)
    slowed = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.numel() > 1000:
            whole.append(tensor.numel())
        return slowed(tensor, *args, **kwargs)

    dist.all_reduce = counted
    in_full: list[int] = []
    job = Job(_model(), torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, _slow_loss, None)
    config = Config(**levers({"workers": world, "autopilot": Autopilot(k_max=8, payloads=("int8",), updater_periods=(0,))}))
    fits: list[list[tuple[int, bool]]] = []
    own = None
    for _ in range(2):
        rounds = Rounds(Replica(job.model, job, config, CPU, rank, world), config, CPU, rank, world)
        if own is not None:
            rounds.load_own_state(own)
        reports: list[object] = []
        rounds.run(1, ListSource(_tiny_data(48), rank, world), reports.append)
        scores = [r for r in reports if isinstance(r, Score)]
        fits.append([(r.k, r.overlap) for r in scores])
        # Each Score's local work is its own round's, not the one done while it was in flight.
        assert all(0.14 < s.step_s < 0.3 for s in scores), [s.step_s for s in scores]
        in_full.append(len(whole) - sum(in_full))
        own = rounds.own_state()
    assert isinstance(rounds.policy, Steered)
    return [c.choice for c in rounds.policy.pilot.changes], fits, in_full, [p.detach().clone() for p in job.model.parameters()]


def test_a_link_too_slow_for_k_max_and_the_fewest_bytes_overlaps_lengthens_k_and_a_resumed_engine_stays_overlapped() -> None:
    workers = run_group(_overlapping_worker, 2, timeout=150)
    (changes, fits, in_full, params), other = workers[0], workers[1]
    # From its start (k = 4), one measure (0.165 s against steps of 0.15 s: 12% at k_max) overlaps it
    # at k = 4, whose 0.6 s of steps take more than twice the link's 0.165 s. No step hides this
    # link, so two overlapped rounds measure 0.165 s left each, and k goes to its bound.
    assert changes == other[0] == [Choice(4, "int8", 0, overlap=True), Choice(8, "int8", 0, overlap=True)]
    first, resumed = fits
    assert first[:2] == [(4, False), (4, True)] and first[-2] == (8, True), first  # each Score says the k it ran with
    assert resumed and all(overlap and k == 8 for k, overlap in resumed), resumed  # the choice in force at the end, from the first round on
    # Every round goes coded: the first fit's overlapped ones from the average the switch landed on,
    # and a fit that starts overlapped from the parameters every replica starts it with.
    assert in_full == [0, 0], in_full
    assert all(torch.equal(a, b) for a, b in zip(params, other[3]))  # the fit's end lands every round: equal replicas


def _tiny_data(n: int = 96) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def test_spawned_workers_agree_report_each_choice_and_a_checkpoint_resumes_the_pilot(tmp_path: Path) -> None:
    data = _tiny_data()
    builder = ParallelWrapper.builder(_model()).workers(2).threads_per_worker(1).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    # An exchange share of nearly all the time: any link fits, so from the parameters alone it
    # climbs to the state every round (that round averages every worker's state anew) at k = 1.
    builder = builder.averaging_frequency("auto", k_max=4, exchange_share=0.99).checkpoint(tmp_path, every=1000)
    with builder.warmup_sync_steps(3).build() as wrapper:  # three gradient rounds first: no pilot's part in their headers
        history = wrapper.fit(data, epochs=2)
    assert wrapper.samples == 2 * 96 * 8  # every sample once per epoch, whatever k each round had
    changes = autopilot_changes(history.scores)
    assert (changes[0]["k"], changes[0]["payload"], changes[0]["updaters_every"]) == (1, "float32", 1)
    assert "float32 would take about" in changes[0]["why"]
    assert all(s.k in (1, 2, 4) and s.step_s > 0 and s.link_s > 0 for s in history.scores)  # warm-up rounds: 1
    assert 2 in {s.k for s in history.scores}  # its start: the middle of 1..4
    assert {s.updaters_every for s in history.scores} >= {0, 1}  # the parameters alone, then the state too
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    pilots = [own["autopilot"] for own in saved["rng"]]  # what is each worker's own
    assert pilots[0] == pilots[1]  # every worker's pilot is in the checkpoint, the same
    builder = ParallelWrapper.builder(_model()).workers(2).threads_per_worker(1).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    with builder.averaging_frequency("auto", k_max=4, exchange_share=0.99).checkpoint(tmp_path, every=1000).warmup_sync_steps(3).build() as wrapper:
        resumed = wrapper.fit(data, epochs=3, resume=tmp_path)
    first = resumed.scores[0]
    assert (first.k, first.payload, first.updaters_every, first.overlap) == tuple(pilots[0]["choice"].values())  # not k_min again
    assert wrapper.samples == 3 * 96 * 8


TORCHRUN_SCRIPT = """
import json, os, sys, torch
from torch import nn
sys.path.insert(0, {tests!r})
from test_autopilot import _model, _tiny_data
from parallelwrapper import ParallelWrapper
b = ParallelWrapper.builder(_model()).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
with b.averaging_frequency("auto", k_max=4, exchange_share=0.99).build() as w:
    h = w.fit(_tiny_data(), epochs=1)
if w.is_main:
    print(json.dumps({{"samples": w.samples, "ks": [s.k for s in h.scores], "rungs": [(s.payload, s.updaters_every) for s in h.scores]}}))
"""


def test_torchrun_ranks_agree_on_every_choice(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["samples"] == 96 * 8
    # Any link fits: from int8 it climbs to more bytes and k falls to 1; no rank disagreed.
    assert len(set(out["ks"])) >= 2 and len({tuple(r) for r in out["rungs"]}) >= 2, out


def _state_lands_late_worker(rank: int, world: int, delay: float) -> list[tuple[float, float, float]]:
    """Adam with its state averaged, whose sums land `delay` s late, as on a slow link where they
    arrive during the next round's first step: each Score's seconds in local work, in exchanges,
    and per local step."""
    import parallelwrapper.averaging as averaging
    from parallelwrapper.types import Score

    settle = averaging.FlatAverager.settle

    def late(self: averaging.FlatAverager) -> None:
        if self._later_scale is not None:
            time.sleep(delay)
        settle(self)

    averaging.FlatAverager.settle = late  # type: ignore[method-assign]
    model = _model()
    job = Job(model, torch.optim.Adam, {"lr": 1e-3}, nn.functional.cross_entropy, None)
    config = Config(workers=world, averaging_frequency=2)
    rounds = Rounds(Replica(model, job, config, CPU, rank, world), config, CPU, rank, world)
    reports: list[Score] = []
    rounds.run(1, ListSource(_tiny_data(24), rank, world), lambda r: reports.append(r) if isinstance(r, Score) else None)
    return [(r.training_s, r.exchange_s, r.step_s) for r in reports]


def test_a_step_waiting_for_the_last_rounds_state_counts_as_exchange_not_local_work() -> None:
    """On a slow link the optimizer's averaged state lands during the next round's first step
    (averaging.FlatAverager's `later`): those seconds are the exchange's. Counted as local work
    they made the autopilot take a step for 20x its time and keep a payload that was too slow."""
    scores = run_group(_state_lands_late_worker, 2, 0.5, timeout=120)[0]
    # The first round averages the state whole (the optimizer has none before its first step);
    # from the second on it lands late, in the next round's first step, and the last's before
    # its Score: else it landed when the fit let its buffers go, counted nowhere.
    later = scores[2:]
    assert len(later) >= 3, scores
    for training_s, exchange_s, step_s in later:
        assert step_s < 0.1 and training_s < 0.2, scores  # two tiny steps, without the 0.5 s wait
        assert exchange_s >= 0.5, scores  # the wait is the exchange's
    assert scores[-1][1] >= 2 * 0.5, scores  # the last round's: the round before's state, then its own


@pytest.mark.fast
def test_a_noisy_wait_counts_as_a_steps_only_where_it_grows_with_k_beyond_its_noise() -> None:
    """Waits that vary from round to round as much as the GPT arena's at 50 Mbit/s (0 to 0.9 s at
    every k) read as a step's when two means of a few of them are fitted as they are; beyond their
    noise only a growth that is one counts as a step's."""
    waits = _Waits()
    for w in (0.0, 0.4, 0.1, 0.3, 0.2, 0.2):  # k = 16: 0.2 s on average
        waits.add(16, w)
    for w in (0.5, 0.0, 0.3, 0.25):  # k = 32: 0.26 s on average, a growth of 3.75 ms a step as measured
        waits.add(32, w)
    a, b, fitted = waits.split()
    assert (b, fitted) == (0.0, 2) and a == pytest.approx((6 * 0.2 + 4 * 0.2625) / 10)  # a round's: their mean, each k's by its measures
    steady = _Waits()
    for k, w in [(8, 0.06), (8, 0.065), (8, 0.055), (16, 0.12), (16, 0.125), (16, 0.115)]:  # twice the wait at twice the k, a few ms apart
        steady.add(k, w)
    a, b, fitted = steady.split()
    assert fitted == 2 and b == pytest.approx(0.0075) and a == pytest.approx(0.0, abs=1e-9)
    # Flown: a round's noisy wait lengthens k as a round's does; a step's noisy one is still a step's.
    noise = random.Random(0)
    flat = Pilot(Autopilot(k_max=128), START)
    ran = fly([flat], step_s=0.05, link_s=lambda rung: 0.005, rounds=60, wait_s=lambda k: noise.uniform(0.0, 0.2))
    assert {c.k for c in ran[-20:]} == {64}  # (0.005 + 0.1) s · 0.95 / (0.05 · 0.05 s) = 40 steps
    growing = Pilot(Autopilot(k_max=128), START)
    ran = fly([growing], step_s=0.05, link_s=lambda rung: 0.005, rounds=60, wait_s=lambda k: 0.002 * k * noise.uniform(0.8, 1.2))
    a, b, fitted = growing._waits.split()
    assert fitted >= 2 and 0.0015 < b < 0.0025 and ran[-1].k <= 8  # a step's: no k hides it
