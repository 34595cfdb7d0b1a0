"""The comparison's arithmetic, without processes: the communication accounting against the real
flat-buffer layout and header, the evaluation pieces, the table, the options' validation."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from parallelwrapper import TrainingMode, averaging, rounds
from parallelwrapper.app.communication import HEADER_BYTES, Communication, estimated_communication
from parallelwrapper.app.compare import (
    CompareOptions,
    Point,
    RunResult,
    RunSpec,
    chunks,
    figure,
    markdown,
    run_specs,
)
from parallelwrapper.app.options import RunOptions
from parallelwrapper.evaluation import classification_metrics, metric_sums

pytestmark = pytest.mark.fast

LENET_PARAMS = 431_080  # 8 tensors
SG = RunSpec(TrainingMode.SHARED_GRADIENTS, 1)
AVG = RunSpec(TrainingMode.AVERAGING, 4)


def test_header_bytes_match_the_real_header(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: sent.append(t.clone()))
    header = rounds.make_header(samples=1, loss_sum=1.0, batches=1, finished=False, skipped=False, layout=0)
    averaging.all_reduce_values(header, torch.device("cpu"))
    assert [t.numel() * t.element_size() for t in sent] == [HEADER_BYTES]


@pytest.mark.parametrize(
    ("spec", "optimizer", "average_updaters", "numbers", "collectives"),
    [
        (SG, "nesterov", True, LENET_PARAMS, 1),  # gradients
        (AVG, "nesterov", True, 2 * LENET_PARAMS, 2),  # params, then momentum in a collective of its own
        (AVG, "nesterov", False, LENET_PARAMS, 1),  # params only
        (AVG, "sgd", True, LENET_PARAMS, 1),  # plain SGD keeps no state
        (AVG, "adam", True, 3 * LENET_PARAMS + 8, 2),  # params, then two moments and a step per tensor
    ],
)
def test_payload_follows_the_optimizer_state(spec: RunSpec, optimizer: str, average_updaters: bool, numbers: int, collectives: int) -> None:
    options = spec.options(RunOptions.of(optimizer=optimizer, average_updaters=average_updaters))
    cost = estimated_communication(options)
    assert cost.payload_bytes == 4 * (numbers + rounds.HEADER_LEN) and cost.payload_collectives == collectives


@pytest.mark.parametrize(("workers", "ratio"), [(2, 0.5), (4, 1.0)])
def test_a_16_bit_payload_is_gathered_after_each_fits_first_round(workers: int, ratio: float) -> None:
    """bfloat16 deltas of params and momentum, all-gathered: (N-1) casts per worker, half a float32
    ring all-reduce's bytes for 2 workers and as many for 4; the first fit()'s first round goes in
    float32 (the momentum does not exist before it), and the header travels beside the casts in a
    float64 all-reduce of its own."""
    base = RunOptions.of(workers=workers)
    full = estimated_communication(AVG.options(base))
    cast = estimated_communication(AVG.options(RunOptions.of(workers=workers, payload_dtype="bfloat16")))
    assert full.wire_bytes is None and cast.wire_bytes == 2 * (2 * LENET_PARAMS)
    for dtype, per_block in (("int8", 256 + 4), ("int4", 128 + 4)):  # a quarter, an eighth, and a float32 scale per 256
        coded = estimated_communication(AVG.options(RunOptions.of(workers=workers, payload_dtype=dtype)))
        assert coded.wire_bytes == -(-2 * LENET_PARAMS // 256) * per_block
    assert cast.payload_bytes == full.payload_bytes  # the float32 first round
    header = cast.ring_bytes(HEADER_BYTES)
    wired_round = cast.bytes_per_worker(11, 1) - cast.bytes_per_worker(10, 1)
    assert wired_round - header == pytest.approx(ratio * (full.bytes_per_worker(11, 1) - full.bytes_per_worker(10, 1) - header), rel=1e-4)
    assert cast.bytes_per_worker(1, 1) == full.bytes_per_worker(1, 1)  # the first fit()'s one round
    assert cast.bytes_per_worker(3, 3) == full.bytes_per_worker(1, 1) + 2 * wired_round + 2 * header  # later fits: coded, the header alone first
    # float32 lands the momentum after the parameters, in a collective of its own; coded, it goes with them
    assert (full.payload_collectives, cast.payload_collectives) == (2, 1)
    assert cast.collectives(10, 2) == 2 + 10 + 9  # the fits' headers alone, a payload a round, a coded round's header
    # Shared gradients never send a 16-bit payload.
    assert estimated_communication(SG.options(RunOptions.of(payload_dtype="bfloat16"))).wire_bytes is None


@pytest.mark.parametrize(
    ("optimizer", "average_updaters", "overlap", "full_fits"),
    [
        ("nesterov", False, False, 0),  # parameters only: every worker starts each fit() from the same ones
        ("nesterov", True, False, 1),  # the momentum exists once the first fit() has stepped
        ("sgd", True, False, None),  # plain SGD keeps no state: nothing to average it into
        ("nesterov", False, True, None),  # overlap's rounds start coding from a landed average
    ],
)
def test_which_fits_first_round_goes_in_float32(optimizer: str, average_updaters: bool, overlap: bool, full_fits: int | None) -> None:
    options = AVG.options(RunOptions.of(optimizer=optimizer, average_updaters=average_updaters, overlap_averaging=overlap, payload_dtype="int8"))
    cost = estimated_communication(options)
    assert cost.full_fits == full_fits
    full, coded = cost.ring_bytes(cost.payload_bytes), cost.gather_bytes(cost.wire_bytes or 0) + cost.ring_bytes(HEADER_BYTES)
    float32_rounds = 3 if full_fits is None else min(3, full_fits)
    assert cost.bytes_per_worker(6, 3) == pytest.approx(3 * cost.ring_bytes(HEADER_BYTES) + float32_rounds * full + (6 - float32_rounds) * coded)


def test_an_outer_optimizer_sends_nothing_more() -> None:
    base = RunOptions.of(outer_lr=1.0, outer_momentum=0.5)
    outer, plain = RunSpec(TrainingMode.AVERAGING, 4, outer=True).options(base), AVG.options(base)
    assert (outer.outer_lr, outer.outer_momentum, plain.outer_lr, plain.outer_momentum) == (1.0, 0.5, None, 0.0)
    assert estimated_communication(outer) == estimated_communication(plain)


def test_fragments_overlap_the_averaging_runs_and_add_a_collective_each_and_a_closing_average() -> None:
    base = RunOptions.of(fragments=3, overlap_averaging=True)  # pw-fit compare --fragments 3 overlaps its averaging runs
    plain, fragmented, sg = AVG.options(RunOptions.of()), AVG.options(base).config, SG.options(base).config
    assert (fragmented.fragments, fragmented.overlap_averaging, sg.fragments, sg.overlap_averaging) == (3, True, 1, False)
    one, three = estimated_communication(plain), estimated_communication(AVG.options(base))
    assert three.payload_bytes == one.payload_bytes and three.fragments == 3
    # 10 rounds in 2 fit() calls: 2 more collectives a round, and a full average at each fit()'s end.
    assert three.collectives(10, 2) == one.collectives(10, 2) + 2 * 10 + 2
    assert three.bytes_per_worker(10, 2) == one.bytes_per_worker(10, 2) + 2 * three.ring_bytes(three.payload_bytes)


def test_ring_all_reduce_volume() -> None:
    one, two, four = (Communication(1000, 1, n) for n in (1, 2, 4))
    assert one.ring_bytes(1000) == 0.0  # a group of one sends nothing
    assert two.ring_bytes(1000) == 1000.0 and four.ring_bytes(1000) == 1500.0
    # 10 rounds in 2 fit() calls: 10 payloads, with their headers, and a fit()'s first header.
    assert two.collectives(10, 2) == 12
    assert two.bytes_per_worker(10, 2) == 2 * HEADER_BYTES + 10 * 1000


def test_chunks_end_on_round_boundaries() -> None:
    batches = list(range(469))
    pieces = chunks(batches, 8, 32)
    assert [len(p) for p in pieces] == [64] * 7 + [21]
    assert sum(pieces, []) == batches
    assert [len(p) for p in chunks(list(range(8)), 5, 4)] == [4, 4]


def test_run_specs_order() -> None:
    specs = run_specs(CompareOptions(frequencies=(16, 1, 4)))
    assert [s.label for s in specs] == ["shared gradients", "averaging k=1", "averaging k=4", "averaging k=16"]
    assert [s.label for s in run_specs(CompareOptions(frequencies=(2,), shared_gradients=False))] == ["averaging k=2"]
    auto = run_specs(CompareOptions(frequencies=("auto", 8), shared_gradients=False))
    assert [s.label for s in auto] == ["averaging k=8", "averaging k=auto"]
    assert auto[0].options(RunOptions.of()).config.deterministic and not auto[1].options(RunOptions.of()).config.deterministic  # auto steers by times
    outer = run_specs(CompareOptions(RunOptions.of(outer_lr=0.7), frequencies=(64, 16)))
    assert [s.label for s in outer] == ["shared gradients", "averaging k=16", "outer k=16", "averaging k=64", "outer k=64"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frequencies": (0, 4)}, "distinct ints >= 1"),
        ({"frequencies": (4, 4)}, "distinct ints >= 1"),
        ({"frequencies": (), "shared_gradients": False}, "nothing to compare"),
        ({"evals_per_epoch": 0}, "evals_per_epoch"),
        ({"target_accuracy": 97.0}, "fraction"),
        ({"base": RunOptions.of(warmup_sync_steps=10)}, "drop --warmup-sync-steps"),
        ({"base": RunOptions.of(outer_lr=1.0), "frequencies": ()}, "give averaging frequencies with --outer-lr"),
    ],
)
def test_options_are_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompareOptions(**kwargs)


def point(samples: int, seconds: float, accuracy: float) -> Point:
    return Point(samples, seconds, accuracy, 0.1, math.nan, samples // 256, samples // 128, samples * 1000.0, 0.05)


def test_table_reports_the_first_evaluation_at_the_target() -> None:
    fast = RunResult(AVG, [point(0, 0.0, 0.1), point(1000, 1.0, 0.96), point(2000, 2.0, 0.975)])
    slow = RunResult(SG, [point(0, 0.0, 0.1), point(1000, 1.5, 0.9), point(2000, 3.0, 0.95)])
    assert fast.first_reaching(0.97) == fast.points[2] and slow.first_reaching(0.97) is None
    table = markdown([fast, slow], CompareOptions(target_accuracy=0.97, out=Path("x")), wall_seconds=10.0)
    rows = [line for line in table.splitlines() if line.startswith("| averaging") or line.startswith("| shared")]
    assert rows[0] == "| averaging k=4 | 0.9750 | 0.1000 | 2.0 | 1,000 | 2,000 | 2.0 | 15 | 2.0 | 5.0% |"
    assert rows[1].count("not reached") == 2
    assert "| training seconds | training samples/s |" in table
    assert "Wall time 10.0 s, of which 5.0 s (50%) training; the rest is reading MNIST, starting the workers" in table
    assert "of the 2 runs and 6 test-set evaluations" in table


@pytest.mark.fast
def test_an_accuracy_of_exactly_the_target_reaches_it() -> None:
    """9,700 right of 10,000 test images, in batches of 1,000, is 0.97: the default metrics count
    in float64 (in float32, 0.97 per batch summed to 0.96999999, and pw-fit compare's table put the
    autopilot's crossing of 97% an evaluation later)."""
    outputs = torch.zeros(1000, 2)
    outputs[970:, 1] = 1.0
    batches = [(outputs, torch.zeros(1000, dtype=torch.long))] * 10
    sums, n = metric_sums(torch.nn.Identity(), batches, functools.partial(classification_metrics, loss_fn=None), torch.device("cpu"))
    assert sums["accuracy"] / n == 0.97
    assert RunResult(AVG, [point(0, 0.0, 0.1), point(1000, 1.0, sums["accuracy"] / n)]).first_reaching(0.97) is not None


def test_figure_plots_the_autopilots_k_over_the_run() -> None:
    k4 = RunResult(AVG, [point(0, 0.0, 0.1), point(1000, 1.0, 0.9)])
    auto = RunResult(RunSpec(TrainingMode.AVERAGING, "auto"), [point(0, 0.0, 0.1), point(1000, 1.0, 0.92)], [(256, 1), (512, 1), (768, 8)])
    fig = figure([k4, auto], CompareOptions(frequencies=(4, "auto"), out=Path("x")))
    try:
        assert len(fig.axes) == 3 and fig.axes[2].get_title() == "the autopilot's k"
        (line,) = fig.axes[2].get_lines()
        assert list(line.get_ydata()) == [1, 1, 8]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_figure_shows_every_point_and_tells_shared_gradients_from_k1() -> None:
    """The 0-sample points (an untrained model, near chance) lie inside the logit axis; shared
    gradients and averaging with k=1, the same training, differ in line, marker and fill."""
    sg = RunResult(SG, [point(0, 0.0, 0.08), point(1000, 1.0, 0.97), point(2000, 2.0, 0.985)])
    k1 = RunResult(RunSpec(TrainingMode.AVERAGING, 1), [point(0, 0.0, 0.08), point(1000, 1.2, 0.97), point(2000, 2.4, 0.985)])
    fig = figure([sg, k1], CompareOptions(frequencies=(1,), out=Path("x")))
    try:
        low, high = fig.axes[0].get_ylim()
        assert low < 0.08 and high > 0.985
        a, b = fig.axes[0].get_lines()[:2]
        assert (a.get_linestyle(), a.get_marker(), a.get_markerfacecolor()) == ("--", "s", "none")
        assert (b.get_linestyle(), b.get_marker()) == ("-", "o") and b.get_markerfacecolor() != "none"
        assert a.get_zorder() > b.get_zorder()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
