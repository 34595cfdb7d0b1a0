"""benchmarks/fleet_sim.py's model of a fleet that loses machines: one fault's cost in each design
equals what its rules say, worked out by hand on a fleet whose steps all take the same time.
Fast tier: pure Python, no process."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.fleet_sim import DESIGNS, Fleet, kept, simulate

pytestmark = pytest.mark.fast

# 4 machines of 2 workers, k = 10 steps of 0.1 s and a 0.2 s exchange: a round of 1.2 s.
FLEET = Fleet(workers=8, per_machine=2, step_s=0.1, cv=0.0, k=10, exchange_s=0.2, hop_s=0.0, state_mb=100.0, link_mbit_s=800.0,
              back_s=1e6, detect_s=2.0, regroup_s=0.5, restart_s=6.0, checkpoint_every=4, checkpoint_s=0.0, stall_s=5.0, hours=1.0)  # fmt: skip


def test_without_faults_every_design_trains_at_the_fleets_pace() -> None:
    for design in DESIGNS:
        run = simulate(FLEET, design, faults=False)
        assert run["steps_per_s"] == pytest.approx(8 * 10 / 1.2) and run["faults"] == 0


def test_one_fault_costs_what_each_design_says() -> None:
    # A machine lost 0.5 s into round 6 (rounds start every 1.2 s), back only after the run.
    at = 5 * 1.2 + 0.5
    runs = {d: simulate(FLEET, d, at=[at]) for d in DESIGNS}
    assert all(r["faults"] == 1 for r in runs.values())
    # redo, a machine that did not host the claims: the 8 workers' round goes on, on 6, until its
    # collective, which fails; the whole round's 80 steps are redone. Where the machine lost hosted
    # them, the survivors see it at their next claim: the 40 steps so far.
    assert simulate(dataclasses.replace(FLEET, rank0_share=0.0), "redo", at=[at])["redone_steps"] == pytest.approx(80)
    assert simulate(dataclasses.replace(FLEET, rank0_share=1.0), "redo", at=[at])["redone_steps"] == pytest.approx(40)
    # resume, either way: the lost machine's 2 x 5 steps again (the 6 workers' 30 steps left before
    # the collective, or after the regroup where they saw it at once).
    for rank0_share in (0.0, 1.0):
        assert simulate(dataclasses.replace(FLEET, rank0_share=rank0_share), "resume", at=[at])["redone_steps"] == pytest.approx(10)
    # restart: the 1 round since the checkpoint after round 4, and the 40 steps of round 6 so far.
    assert runs["restart"]["redone_steps"] == pytest.approx(80 + 40)
    # rollback: the round in flight, on every worker.
    assert runs["rollback"]["redone_steps"] == pytest.approx(40)
    rates = {d: r["steps_per_s"] for d, r in runs.items()}
    assert rates["resume"] > rates["redo"] > rates["rollback"] > rates["restart"]


def test_a_machine_back_within_the_restart_joins_it_and_one_back_later_restarts_everyone_again() -> None:
    quick = simulate(dataclasses.replace(FLEET, back_s=3.0), "restart", at=[6.5])
    late = simulate(dataclasses.replace(FLEET, back_s=30.0), "restart", at=[6.5])
    assert quick["steps_per_s"] > late["steps_per_s"]
    assert late["redone_steps"] > quick["redone_steps"]  # the second restart redoes the rounds since its checkpoint


def test_more_frequent_faults_keep_less() -> None:
    fleet = dataclasses.replace(FLEET, back_s=10.0, hours=0.5)
    for design in DESIGNS:
        assert kept(dataclasses.replace(fleet, every_s=60.0), design) > kept(dataclasses.replace(fleet, every_s=15.0), design)
