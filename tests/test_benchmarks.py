"""Every maintained benchmark still runs, so that a refactor which breaks one fails the suite:
`python -m benchmarks quick` runs each at its smallest size (`--smoke`: real spawned workers, real
gloo, torchrun agents on loopback, only a few steps), and each must write figures that are
numbers: the race reached its target, the ratios are finite, the faults were replaced. About two
to three minutes on this 2-core machine, most of it processes starting; not the fast tier."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.__main__ import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, mnist_dir: Path) -> dict[str, Any]:
    """Each benchmark's results JSON, by name, from one `quick` run."""
    out = tmp_path_factory.mktemp("quick")
    env = {**os.environ, "PW_DATA_DIR": str(mnist_dir), "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-m", "benchmarks", "quick", "--out", str(out), "--jobs", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, f"python -m benchmarks quick failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def figure(value: Any) -> float:
    """A measured figure: a finite positive number."""
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, value
    return float(value)


def throughput(r: dict[str, Any]) -> None:
    for name, run in r["runs"].items():
        figure(run["samples_per_s"])
        if name != "ddp":
            figure(run["vs_ddp"])


def torchft_lenet(r: dict[str, Any]) -> None:
    for run in r["runs"].values():
        assert run["failed"] == 0, run
        figure(run["ms_per_step"])
        figure(run["vs_ceiling"])


def race(vs: str) -> Callable[[dict[str, Any]], None]:
    """comm_bound's and slow_link's summaries: every contender reached the target, and its ratio to
    the best of its group (race.py's `best`) is a number."""

    def check(r: dict[str, Any]) -> None:
        for s in r["summary"].values():
            figure(s["seconds"])
            figure(s["ms_per_step"])
            figure(s[vs])
        if "regret" in r:  # slow_link's: the one fixed setting is its own fastest, to every target it set
            assert r["regret"]["each"]["wrapper:4"] == [[1.0, 1.0, 1.0]], r["regret"]
        if "seeds" in r:  # slow_link's --seed 7 --seed-each: each run trained from its repeat's seed
            assert [[run["result"]["seed"] for run in runs] for runs in r["runs"].values()] == [r["seeds"]] * len(r["runs"]) == [[7], [7]], r["seeds"]

    return check


@pytest.mark.fast
def test_the_three_targets_are_the_best_fixed_settings_scores_at_its_thirds_and_regret_is_over_the_fastest() -> None:
    """race.thirds and race.regret on made-up runs: the best fixed setting ends lowest (b); its
    scores at steps 2, 4 and 6 are the targets; a contender's seconds to each (read between its
    scores: a:8 crosses 2.6 at 2 + 2 * 0.4 / 0.5 = 3.6 s) over the fastest fixed setting's, None
    where it never reached it."""
    from benchmarks.race import regret, thirds

    def run(losses: list[float], step_s: float) -> dict[str, Any]:
        return {"points": [{"seconds": step_s * 2 * (i + 1), "samples": 0, "steps": 2 * (i + 1), "val_loss": v} for i, v in enumerate(losses)]}

    runs = {"a:8": [run([3.0, 2.5, 2.4], 1.0)], "b:32": [run([3.2, 2.6, 2.2], 2.0)], "auto": [run([2.9, 2.5, 2.3], 1.5)]}
    assert thirds(runs, 0, ["a:8", "b:32"]) == ("b:32", [3.2, 2.6, 2.2])
    assert regret(runs, ["a:8", "b:32"]) == ([("b:32", [3.2, 2.6, 2.2])], {"a:8": [[1.0, 1.0, None]], "b:32": [[2.0, 8 / 3.6, 1.0]], "auto": [[1.5, 5.25 / 3.6, None]]})


@pytest.mark.fast
def test_in_a_race_to_a_time_budget_the_targets_are_read_at_equal_time_not_at_each_last_score() -> None:
    """race.thirds where the fixed settings stopped at different steps (each at its first score past
    the budget, the faster with a chunk more): the best is the one lowest at the end of the shortest
    run (a at 30 s: 1.5, against b's 1.7 + 3/9 of its way to 1.2 there), not the one whose extra
    chunk scored lowest (b's 1.2); its targets are its scores at 10, 20 and 30 s, read between points."""
    from benchmarks.race import score_at, thirds

    a = {"points": [{"seconds": s, "steps": n, "val_loss": v} for s, n, v in [(10.0, 8, 3.0), (20.0, 16, 2.0), (30.0, 24, 1.5)]]}
    b = {"points": [{"seconds": s, "steps": n, "val_loss": v} for s, n, v in [(9.0, 8, 3.2), (18.0, 16, 2.2), (27.0, 24, 1.7), (36.0, 32, 1.2)]]}
    assert score_at(b["points"], 30.0) == pytest.approx(1.7 - 0.5 / 3)
    assert score_at(b["points"], 5.0) == 3.2 and score_at(b["points"], 40.0) == 1.2
    assert thirds({"a": [a], "b": [b]}, 0, ["a", "b"]) == ("a", [3.0, 2.0, 1.5])


@pytest.mark.fast
def test_a_race_by_turns_hands_each_repeat_its_rotated_order_and_records_a_failure_as_its_result() -> None:
    """race.race_by_turns (slow_link --interleave) on a made-up run_all: each repeat is one call
    with the order rotated by the repeat; a contender's RuntimeError is its FAILED record, with
    the line that names the error and the whole of it, and the others' times to the target are theirs."""
    from benchmarks.race import race_by_turns

    orders: list[list[str]] = []

    def run_all(order: list[str], repeat: int) -> dict[str, dict[str, Any] | RuntimeError]:
        orders.append(order)
        point = {"seconds": 2.0 + repeat, "samples": 0, "steps": 4, "val_loss": 1.0}
        return {"a:8": {"points": [point]}, "b:32": RuntimeError("b:32: the ranks failed\nValueError: loss is NaN"), "c": {"points": [{**point, "val_loss": 3.0}]}}

    runs = race_by_turns(["a:8", "b:32", "c"], 2, run_all, 2.0)
    assert orders == [["a:8", "b:32", "c"], ["b:32", "c", "a:8"]]
    assert [r["seconds"] for r in runs["a:8"]] == [2.0, 3.0]
    assert [r["error"] for r in runs["b:32"]] == ["ValueError: loss is NaN"] * 2 and runs["b:32"][0]["seconds"] is None
    assert runs["b:32"][0]["log"] == "b:32: the ranks failed\nValueError: loss is NaN"  # all of it, where the line is torchrun's summary alone
    assert [r["seconds"] for r in runs["c"]] == [None, None] and runs["c"][0]["best_accuracy"] == 3.0


@pytest.mark.fast
def test_a_doubling_of_k_costs_the_steps_the_longer_round_took_to_the_shorter_ones_losses() -> None:
    """race.doubling_cost on made-up runs at k and 4k: from a third of the shorter run on, the
    longer run's interpolated steps to each of its losses, as a cost per doubling of k; and
    doubling_costs pairs the fixed settings of one kind at neighbouring k."""
    from benchmarks.race import doubling_cost, doubling_costs

    def points(losses: list[float]) -> list[dict[str, Any]]:
        return [{"steps": 3 * (i + 1), "seconds": float(i + 1), "samples": 0, "val_loss": v} for i, v in enumerate(losses)]

    short, long = points([3.0, 2.0, 1.0]), points([3.5, 2.5, 1.5, 0.5])
    assert doubling_cost(short, long, 4) == pytest.approx([(7.5 / 6) ** 0.5 - 1, (10.5 / 9) ** 0.5 - 1])
    runs = {"w:8": [{"points": short}], "w:32": [{"points": long}], "auto": [{"points": short}]}
    assert doubling_costs(runs, ["w:8", "w:32"]) == {"w:8→32": doubling_cost(short, long, 4)}


@pytest.mark.fast
def test_at_equal_time_every_contender_is_read_at_the_shortest_runs_end() -> None:
    """race.at_equal_time: each contender's score at the end of the repeat's shortest run, read on
    the line between its points; a contender without points is left out."""
    from benchmarks.race import at_equal_time

    def points(*pairs: tuple[float, float]) -> list[dict[str, Any]]:
        return [{"steps": 128 * (i + 1), "seconds": t, "samples": 0, "val_loss": v} for i, (t, v) in enumerate(pairs)]

    runs = {"a": [{"points": points((10.0, 2.0), (20.0, 1.5))}], "b": [{"points": points((8.0, 2.2), (16.0, 1.8), (24.0, 1.4))}], "c": [{"points": []}]}
    assert at_equal_time(runs, 0) == (20.0, {"a": 1.5, "b": pytest.approx(1.6)})
    assert at_equal_time({"c": [{"points": []}]}, 0) is None


@pytest.mark.fast
def test_the_cost_model_weighs_a_doubling_of_ks_steps_against_each_runs_exchange_share() -> None:
    """race.modelled_seconds: each k's seconds to a loss over the shortest k's, (1 + β)^log2 k /
    (1 - s(k)), β the median doubling cost of the pair of ks crossed, s each run's own share; a
    repeat without a share is None, and a kind with no measured doubling is left out."""
    from benchmarks.race import modelled_seconds

    runs = {"w:8": [{"comm_fraction": 0.2}, {"comm_fraction": 0.05}], "w:32": [{"comm_fraction": 0.05}, {"comm_fraction": None}],
            "w:128": [{"comm_fraction": 0.02}, {"comm_fraction": 0.01}], "v:8": [{"comm_fraction": 0.1}], "v:32": [{"comm_fraction": 0.1}]}  # fmt: skip
    costs = {"w:8→32": [0.01, 0.03, 0.05], "w:32→128": [0.02]}
    first = 1.03**2 * 0.8 / 0.95
    assert modelled_seconds(runs, runs, costs) == {
        "w": [{"8": 1.0, "32": pytest.approx(first), "128": pytest.approx(first * 1.02**2 * 0.95 / 0.98)}, None]
    }


@pytest.mark.fast
def test_the_shapers_tcp_counters_are_read_by_group_and_name() -> None:
    """slow_link's reading of /proc/net/snmp and netstat (shaper_counts): each group a line of names
    and a line of values, a value negative where the kernel says so."""
    from benchmarks.slow_link import _counters

    text = "Tcp: RtoMin MaxConn RetransSegs\nTcp: 200 -1 7\nTcpExt: TCPTimeouts TCPLossProbes\nTcpExt: 3 12\n"
    assert _counters(text) == {"Tcp:RtoMin": 200, "Tcp:MaxConn": -1, "Tcp:RetransSegs": 7, "TcpExt:TCPTimeouts": 3, "TcpExt:TCPLossProbes": 12}


@pytest.mark.fast
def test_a_soak_takes_its_fault_free_run_from_an_earlier_result_of_the_same_job_only(tmp_path: Path) -> None:
    """fleet_soak --fault-free: each design's first fault-free, finished run of the earlier result;
    another job's result (its epochs differ, or its payload), or one without that design's
    fault-free run, is refused. A result from before --payload ran float32."""
    from benchmarks.fleet_soak import fault_free_runs

    settings = {"machines": 4, "epochs": 36, "width": 1024, "schedule": "cosine", "rate": "1gbit", "store": "tcp", "loopback": True, "every": 30.0, "payload": "float32"}
    runs = [{"design": "fleet", "faults": [{"at": 3.0}], "seconds": 9.0}, {"design": "fleet", "faults": [], "seconds": 7.0}, {"design": "fleet", "faults": [], "seconds": 8.0}]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"settings": {**settings, "every": 100000.0}, "runs": runs}))
    assert fault_free_runs(str(earlier), settings, ["fleet"]) == {"fleet": runs[1]}
    with pytest.raises(SystemExit, match=r"ran another job \(epochs 36 against 12\)"):
        fault_free_runs(str(earlier), {**settings, "epochs": 12}, ["fleet"])
    with pytest.raises(SystemExit, match="has no fault-free run of restart"):
        fault_free_runs(str(earlier), settings, ["fleet", "restart"])
    before = {k: v for k, v in settings.items() if k != "payload"}
    earlier.write_text(json.dumps({"settings": before, "runs": runs}))
    assert fault_free_runs(str(earlier), settings, ["fleet"]) == {"fleet": runs[1]}
    with pytest.raises(SystemExit, match=r"ran another job \(payload 'float32' against 'int8'\)"):
        fault_free_runs(str(earlier), {**settings, "payload": "int8"}, ["fleet"])


def gpt_arena(r: dict[str, Any]) -> None:
    float32, int8 = r["rows"]
    for row in r["rows"]:
        figure(row["val_loss"])
    assert figure(int8["bytes_per_worker"]) < figure(float32["bytes_per_worker"]), r["rows"]


def fault_soak(r: dict[str, Any]) -> None:
    faulted = r["faulted"]
    assert faulted["faults"] and faulted["replacements"] == len(faulted["faults"]), faulted
    assert all(run["epochs_right"] and not run["left_processes"] for run in (r["fault_free"], faulted, r["fault_free_after"]))
    figure(r["kept"])


def memory(r: dict[str, Any]) -> None:
    for size in r["runs"].values():
        assert all(figure(rank["rss_peak_mib"]) for rank in size["ddp_ranks"])
        figure(size["after"]["main_peak_mib"])
        figure(size["after"]["worker_over_ddp"])
    (fleet,) = r["fleet"].values()  # a fleet's averager beside the plain one, each payload: their peaks
    for run in ("float32", "float32 intact", "int8", "int8 intact"):
        assert [figure(rank["peak_mib"]) for rank in fleet[run]["ranks"]] and math.isfinite(fleet[run]["above_in_models"]), fleet[run]
    assert math.isfinite(fleet["int8 intact"]["intact_costs_in_models"]), fleet


def pipeline(r: dict[str, Any]) -> None:
    assert r["rows"], r
    for row in r["rows"]:
        assert all(figure(v) for v in row if isinstance(v, float)), row


def inference(r: dict[str, Any]) -> None:
    assert r["contenders"], r
    figure(r["offline"]["requests_per_s"])


def gpu_checks(r: dict[str, Any]) -> None:
    checks = {name: c for name, c in r.items() if isinstance(c, dict)}
    assert checks and all(c["ok"] for c in checks.values()), checks


def fleet_sim(r: dict[str, Any]) -> None:
    """The model's predictions of this machine's measured runs, from their parts, within 5%
    (benchmarks/README.md's bar); every kept share a fraction."""
    assert r["calibration"], r
    for c in r["calibration"]:
        assert abs(figure(c["predicted"]) / figure(c["measured"]) - 1) < 0.05, c
    assert all(0 < row[d] <= 1 for row in r["rows"] for d in ("resume", "redo", "restart", "rollback")), r["rows"]


def fleet_soak(r: dict[str, Any]) -> None:
    """Each design ran without faults and with machines lost, no process was left and every
    finished process trained every batch once (the benchmark's own checks: `problems`)."""
    assert r["table"] and not r["problems"], r
    clean, faulted = r["runs"]
    assert not clean["faults"] and faulted["faults"], r["runs"]
    assert any("goes on without" in e["line"] for e in faulted["events"]), faulted["events"]
    figure(clean["seconds"] / faulted["seconds"])
    for run in r["runs"]:  # the model's end, on the images it trained on and on the test set's
        figure(run["train_loss"])
        figure(run["test_loss"])


def outer_rescale(r: dict[str, Any]) -> None:
    """Every schedule trained, and each that changes k under every rule, to a finite loss."""
    rows = {(row["schedule"], row["rule"]) for row in r["rows"]}
    assert {("k = 2", "-"), ("k = 4", "-")} <= rows, rows
    assert {(s, rule) for s in ("2 to 4", "4 to 2") for rule in ("kept", "units", "shrink", "horizon")} <= rows, rows
    assert all(math.isfinite(v) for row in r["rows"] for v in row["losses"]), r["rows"]


def loss_side(r: dict[str, Any]) -> None:
    """Each job's (the GPT arena's, an MLP on MNIST) runs at each k probed every round (finite
    gains) and scored; a row for the pair of k."""
    assert list(r["runs"]) == ["1x16", "mlp16"], list(r["runs"])
    for (runs,) in r["runs"].values():  # one seed
        assert [run["k"] for run in runs] == [2, 4], runs
        assert all(len(run["probes"]) == 16 // run["k"] and all(math.isfinite(p[g]) for p in run["probes"] for g in ("gain", "fresh", "disagreement")) for run in runs), runs
        assert all(len(run["points"]) == 5 for run in runs), runs  # at 0, 4, 8, 12, 16 steps
    assert [row[:2] for row in r["table"]] == [["1x16", "2 to 4"], ["mlp16", "2 to 4"]], r["table"]


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "throughput": throughput,
    "torchft_lenet": torchft_lenet,
    "comm_bound": race("vs_best_pma"),
    "slow_link": race("vs_best_peer"),
    "gpt_arena": gpt_arena,
    "fault_soak": fault_soak,
    "memory": memory,
    "pipeline": pipeline,
    "inference": inference,
    "gpu_checks": gpu_checks,
    "fleet_sim": fleet_sim,
    "fleet_soak": fleet_soak,
    "outer_rescale": outer_rescale,
    "loss_side": loss_side,
}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_runs_at_its_smallest_size_and_writes_its_figures(results: dict[str, Any], name: str) -> None:
    assert name in CHECKS, f"tests/test_benchmarks.py has no check of benchmark {name!r}'s results: add one to CHECKS"
    assert name in results, f"`python -m benchmarks {name} --smoke` wrote no results JSON"
    CHECKS[name](results[name])
