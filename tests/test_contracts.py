"""Module contracts that need no process (the fast tier): the averaging algebra over a fake
two-worker all-reduce, the header's encoding, the score windows, the checkpoint format, the
shape of a WorkerError, and where a worker puts its state. The same contracts run with real processes and real gloo in test_round_protocol.py and test_faults.py."""

from __future__ import annotations

import dataclasses
import pickle
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch import nn

from parallelwrapper import ParallelWrapper, checkpoint
from parallelwrapper.app import cli
from parallelwrapper.averaging import FlatAverager
from parallelwrapper.config import Config, describe_config
from parallelwrapper.delta_averaging import DeltaAverager
from parallelwrapper.env import Placement
from parallelwrapper.errors import Where, WorkerError
from parallelwrapper.hosts.runtime import Worker
from parallelwrapper.job import Job
from parallelwrapper.listeners import Recorder
from parallelwrapper.rounds import HEADER_LEN, RoundTotals, make_header, read_header
from parallelwrapper.rounds.scores import ScoreBook
from parallelwrapper.types import Counters, EpochEnd, Replacement, Report, Score, TrainingState, Validation

pytestmark = pytest.mark.fast
CPU = torch.device("cpu")


class FakeAllReduce:
    """`dist.all_reduce` for two workers that live in this process: each worker's n-th call is
    summed with the other's n-th, in float64, when the first of them waits."""

    def __init__(self, world: int = 2) -> None:
        self.world, self.rank = world, 0
        self.calls: list[list[torch.Tensor]] = [[] for _ in range(world)]
        self.summed: set[int] = set()  # the call indices summed already (a buffer is sent again in the next round)

    def __call__(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        self.calls[self.rank].append(tensor)
        fake, index = self, len(self.calls[self.rank]) - 1

        class Work:
            def wait(self) -> None:
                if index in fake.summed:
                    return
                buffers = [fake.calls[r][index] for r in range(fake.world)]
                total = sum(b.double() for b in buffers)
                for b in buffers:
                    b.copy_(total.to(b.dtype))
                fake.summed.add(index)

        work = Work()
        if not async_op:
            work.wait()
            return None
        return work


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllReduce:
    f = FakeAllReduce()
    monkeypatch.setattr(dist, "all_reduce", f)
    return f


def state(rank: int) -> list[torch.Tensor]:
    return [
        torch.full((3, 2), float(rank + 1)),
        torch.full((4,), 10.0 * rank, dtype=torch.float16),  # copied in and out, reduced in float32
        torch.tensor([7 * rank], dtype=torch.int64),  # reduced in float64, rounded back
    ]


@pytest.mark.parametrize("reference", [10.0, 7.0], ids=["reference-holds", "reference-stale"])
def test_prescaled_send_then_apply_is_the_sample_weighted_mean(fake: FakeAllReduce, reference: float) -> None:
    """w_i / ref on the way out, ref / Σw on the way back: Σ w_i x_i / Σw whatever the ref."""
    weights = [6.0, 4.0]  # Σw = 10
    tensors = [state(0), state(1)]
    averagers = [FlatAverager(t, CPU, trailer=3) for t in tensors]
    for rank in (0, 1):
        fake.rank = rank
        averagers[rank].send(weights[rank] / reference, [weights[rank], 1.0, float(rank)])
    trailers = []
    for rank in (0, 1):
        fake.rank = rank
        trailers.append(averagers[rank].wait())
        averagers[rank].apply(reference / sum(weights))
    assert trailers[0] == trailers[1] == [10.0, 2.0, 1.0]
    expected = [0.6 * 1.0 + 0.4 * 2.0, 0.4 * 10.0, round(0.4 * 7)]
    for rank in (0, 1):
        floats, halves, ints = tensors[rank]
        torch.testing.assert_close(floats, torch.full((3, 2), expected[0]))
        assert halves.dtype == torch.float16 and torch.equal(halves, torch.full((4,), expected[1], dtype=torch.float16))
        assert ints.dtype == torch.int64 and int(ints) == expected[2]
    assert all(torch.equal(a, b) for a, b in zip(tensors[0], tensors[1]))  # bitwise the same on both


def test_the_optimizers_state_lands_later_and_bitwise_as_at_once(fake: FakeAllReduce) -> None:
    """`later` tensors (an optimizer's state) start their all-reduce once the others' sums are in,
    and land at settle(), with apply()'s scale: the same bits as averaging them with the rest. The
    next send() and release() settle a round that no step settled."""
    weights, reference = [6.0, 4.0], 7.0  # a stale reference: apply() scales by 7 / 10

    def pair() -> list[list[torch.Tensor]]:  # (params, momentum) of two workers
        return [[torch.randn(5, generator=torch.Generator().manual_seed(r)), torch.randn(3, generator=torch.Generator().manual_seed(10 + r))] for r in (0, 1)]

    def round_of(averagers: list[FlatAverager], settle: bool) -> None:
        for rank in (0, 1):
            fake.rank = rank
            averagers[rank].send(weights[rank] / reference, [weights[rank]])
        for rank in (0, 1):
            fake.rank = rank
            assert averagers[rank].wait() == [10.0]
            averagers[rank].apply(reference / sum(weights))
        for rank in (0, 1) if settle else ():
            fake.rank = rank
            averagers[rank].settle()

    at_once, later = pair(), pair()
    round_of([FlatAverager(t, CPU, trailer=1) for t in at_once], settle=False)
    averagers = [FlatAverager(t, CPU, trailer=1, later=[t[1]]) for t in later]
    fake.rank = 0
    averagers[0].send(weights[0] / reference, [weights[0]])
    assert len(fake.calls[0]) == 2  # 1 for the at-once averagers above, 1 now: the parameters' and the trailer
    fake.rank = 1
    averagers[1].send(weights[1] / reference, [weights[1]])
    for rank in (0, 1):
        fake.rank = rank
        averagers[rank].wait()
        assert len(fake.calls[rank]) == 3  # the momentum's, once the parameters' sums are in
        averagers[rank].apply(reference / sum(weights))
    assert torch.equal(later[0][0], at_once[0][0]) and not torch.equal(later[0][1], at_once[0][1])  # not landed yet
    for rank in (0, 1):
        fake.rank = rank
        averagers[rank].settle()
    assert all(torch.equal(a, b) for r in (0, 1) for a, b in zip(at_once[r], later[r], strict=True))
    assert averagers[0].collectives == 2
    round_of([FlatAverager(t, CPU, trailer=1) for t in at_once], settle=False)
    round_of(averagers, settle=False)  # a round landed, its momentum not settled: release() settles it
    for rank in (0, 1):
        fake.rank = rank
        averagers[rank].release()
    assert all(torch.equal(a, b) for r in (0, 1) for a, b in zip(at_once[r], later[r], strict=True))


def test_intact_buffers_leave_the_tensors_as_they_were_until_apply_and_land_the_same_bits(fake: FakeAllReduce) -> None:
    """`intact` (a fleet's): the sums go in spare buffers, so after send() and wait(), and after a
    wait() that never comes (a peer lost), each worker still holds its own tensors, later ones too,
    from which its fleet resumes the round; apply() and settle() land the same bits as in place."""
    weights, reference = [6.0, 4.0], 7.0
    in_place, intact = [state(r) for r in (0, 1)], [state(r) for r in (0, 1)]
    own = [[t.clone() for t in state(r)] for r in (0, 1)]
    plain = [FlatAverager(t, CPU, trailer=1, later=[t[0]]) for t in in_place]
    spare = [FlatAverager(t, CPU, trailer=1, later=[t[0]], intact=True) for t in intact]
    for averagers in (plain, spare):
        for rank in (0, 1):
            fake.rank = rank
            averagers[rank].send(weights[rank] / reference, [weights[rank]])
    assert all(torch.equal(a, b) for r in (0, 1) for a, b in zip(intact[r], own[r], strict=True))  # sent: not scaled
    for averagers in (plain, spare):
        for rank in (0, 1):
            fake.rank = rank
            assert averagers[rank].wait() == [10.0]
    assert all(torch.equal(a, b) for r in (0, 1) for a, b in zip(intact[r], own[r], strict=True))  # summed: not written
    for averagers in (plain, spare):
        for rank in (0, 1):
            fake.rank = rank
            averagers[rank].apply(reference / sum(weights))
            averagers[rank].settle()
    assert all(torch.equal(a, b) for r in (0, 1) for a, b in zip(in_place[r], intact[r], strict=True))
    assert not torch.equal(intact[0][0], own[0][0])


def test_a_worker_sending_scale_zero_contributes_nothing_not_even_nan(fake: FakeAllReduce) -> None:
    tensors = [[torch.full((2,), 5.0)], [torch.full((2,), float("nan"))]]
    averagers = [FlatAverager(t, CPU) for t in tensors]
    for rank, share in ((0, 1.0), (1, 0.0)):
        fake.rank = rank
        averagers[rank].send(share)
    for rank in (0, 1):
        fake.rank = rank
        averagers[rank].wait()
        averagers[rank].apply(1.0)
    assert torch.equal(tensors[0][0], torch.full((2,), 5.0)) and torch.equal(tensors[1][0], tensors[0][0])


def test_release_gives_the_tensors_their_own_storage_without_holding_the_state_twice() -> None:
    """At a fit's end the tensors leave the flat buffer; each one's pages of it go back as it
    leaves, so the process does not hold the buffer and the copies whole at once (a pipeline's
    memory budget counts the peak)."""

    def rss_mib() -> float:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    tensors = [torch.full((4 * 2**20,), float(i)) for i in range(8)]  # 8 x 16 MiB
    averager = FlatAverager(tensors, CPU)
    before = rss_mib()
    averager.release()
    grown = rss_mib() - before
    assert all(torch.equal(t, torch.full((4 * 2**20,), float(i))) for i, t in enumerate(tensors))
    assert all(t.untyped_storage().nbytes() == 16 * 2**20 for t in tensors)  # their own storage again
    assert grown < 40, f"release grew the process by {grown:.0f} MiB: the buffer's 128 MiB stayed resident beside the copies"


def test_a_states_digest_changes_with_any_bit_or_key_and_nothing_else() -> None:
    """Under torchrun the first fit() compares digests before it sends rank 0's state (hosts/torchrun.py)."""
    from parallelwrapper.hosts.torchrun import _digest

    def state(weight: torch.Tensor, key: str = "w") -> TrainingState:
        return TrainingState({key: weight}, {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}, None, None)

    weight = torch.randn(4, 3).to(torch.bfloat16)
    assert _digest(state(weight)) == _digest(state(weight.clone()))
    flipped = weight.clone()
    flipped.view(torch.int16)[2, 1] ^= 1  # one bit
    assert _digest(state(flipped)) != _digest(state(weight))
    assert _digest(state(weight, key="v")) != _digest(state(weight))
    assert _digest(state(weight.t().contiguous().t())) == _digest(state(weight))  # the bits, not the layout


def test_delta_averager_keeps_the_steps_taken_since_the_snapshot(fake: FakeAllReduce) -> None:
    tensors = [[torch.full((2,), 1.0)], [torch.full((2,), 3.0)]]
    deltas = [DeltaAverager(t, CPU, trailer=1) for t in tensors]
    for rank in (0, 1):
        fake.rank = rank
        deltas[rank].launch(1.0, [1.0])
    tensors[0][0].add_(0.5)  # rank 0 steps while the averaging is in flight; rank 1 does not
    for rank in (0, 1):
        fake.rank = rank
        assert deltas[rank].wait() == [2.0]
        deltas[rank].land(2.0, adopt=rank == 1)
    assert torch.equal(tensors[0][0], torch.full((2,), 2.5))  # the average (2.0) plus its own step
    assert torch.equal(tensors[1][0], torch.full((2,), 2.0))  # no step since: exactly the average


def test_delta_averager_shows_at_average_the_average_then_puts_the_steps_back(fake: FakeAllReduce) -> None:
    """What a replaceable worker keeps when an overlapped round lands (hosts/runtime.py)."""
    tensors = [[torch.full((2,), 1.0), torch.tensor(4)], [torch.full((2,), 3.0), torch.tensor(6)]]
    deltas = [DeltaAverager(t, CPU, trailer=1) for t in tensors]
    for rank in (0, 1):
        fake.rank = rank
        deltas[rank].launch(1.0, [1.0])
    tensors[0][0].add_(0.5)  # rank 0 steps while the averaging is in flight
    tensors[0][1].add_(1)
    seen: list[list[torch.Tensor]] = []
    for rank in (0, 1):
        fake.rank = rank
        deltas[rank].wait()
        deltas[rank].land(2.0, adopt=rank == 1, at_average=lambda r=rank: seen.append([t.clone() for t in tensors[r]]))
    for held in seen:  # both held exactly the average
        assert torch.equal(held[0], torch.full((2,), 2.0)) and int(held[1]) == 5
    assert torch.equal(tensors[0][0], torch.full((2,), 2.5)) and int(tensors[0][1]) == 6  # then their steps again
    assert torch.equal(tensors[1][0], torch.full((2,), 2.0)) and int(tensors[1][1]) == 5


def test_header_round_trip_and_layout_agreement() -> None:
    headers = [
        make_header(samples=5000, loss_sum=2.5, batches=2, finished=True, skipped=False, layout=0xBEEF),
        make_header(samples=0, loss_sum=0.0, batches=0, finished=True, skipped=True, layout=0xBEEF, stop=True),
    ]
    assert all(len(h) == HEADER_LEN for h in headers)
    summed = [a + b for a, b in zip(*headers)]
    totals = read_header(summed, 0xBEEF, 2)
    assert totals == RoundTotals(5000.0, 2.5, 2, 2, 1, 1, True, 2) and totals.score == 2.5 / 5000 and totals.epoch_done
    assert not read_header(summed, 0xBEEE, 2).layouts_agree  # another layout
    stale = make_header(samples=1, loss_sum=0.0, batches=1, finished=False, skipped=False, layout=None)
    assert not read_header([a + b for a, b in zip(headers[0], stale)], 0xBEEF, 2).layouts_agree
    nobody = read_header(make_header(samples=0, loss_sum=0.0, batches=0, finished=True, skipped=False, layout=0), 0, 1)
    assert nobody.samples == 0 and nobody.score != nobody.score  # NaN: nobody trained


def totals(samples: float, loss_sum: float, skipped: int = 0) -> RoundTotals:
    return RoundTotals(samples, loss_sum, 1, 0, skipped, 0, True, 1)


def test_score_windows_report_every_k_rounds_and_at_the_epochs_end() -> None:
    reports: list[Report] = []
    book = ScoreBook(reports.append, every=2, rounds=True, started=time.monotonic())
    counters = Counters()
    for i, (n, loss) in enumerate([(10, 10.0), (30, 0.0), (20, 4.0)]):
        counters.rounds += 1
        book.add(totals(n, loss, skipped=i == 2), counters, end_of_epoch=i == 2, seconds=(1.0 + i, 0.25 * i))
    assert [r.counters.rounds for r in reports] == [2, 3]
    assert [r.score for r in reports] == [10.0 / 40, 4.0 / 20] and [r.skipped for r in reports] == [0, 1]  # type: ignore[union-attr]
    # each report: this worker's seconds in local work and in exchanges over its rounds
    assert [(r.training_s, r.exchange_s) for r in reports] == [(3.0, 0.25), (3.0, 0.5)]  # type: ignore[union-attr]
    assert book.whole.score == 14.0 / 60  # the epoch's: sample-weighted over every round
    assert reports[0].counters is not counters  # a snapshot, not the live counters


def test_a_workers_records_are_the_public_ones_with_the_counters_after_them() -> None:
    """The worker makes Score, Validation and EpochEnd itself, each with its seconds since the
    fit's start and the counters the wrapper takes on after it; they pickle, as a spawned worker's
    travel to the main process."""
    reports: list[Report] = []
    book = ScoreBook(reports.append, every=1, rounds=True, started=time.monotonic() - 100.0)
    counters = Counters(rounds=4, iterations=8, samples=128, epoch=0, position=8)
    book.add(totals(16, 8.0), counters, end_of_epoch=True, seconds=(1.0, 0.5))
    counters.epoch, counters.position = 1, 0  # the epoch ended with that round
    book.validated(counters, {"val_loss": 0.25})
    book.ended(counters, 0, complete=True)
    score, validation, end = reports
    assert isinstance(score, Score) and isinstance(validation, Validation) and isinstance(end, EpochEnd)
    assert score.counters == Counters(4, 8, 128, 0, 8) and (score.round, score.iteration, score.samples, score.position) == (4, 8, 128, 8)
    assert validation.epoch == 0 and validation.counters == counters and validation.counters is not counters  # at an epoch's end: the one that ended
    assert (end.epoch, end.score, end.complete, end.counters) == (0, 0.5, True, counters) and end.counters is not counters
    assert all(100.0 <= r.seconds < 200.0 for r in reports)
    assert repr(pickle.loads(pickle.dumps(reports))) == repr(reports)  # NaN fields: equal by repr, not ==


def test_the_recorder_keeps_each_record_in_its_history_list_and_calls_its_listener_method() -> None:
    heard: list[tuple[str, tuple[object, ...]]] = []

    class Listener:
        def __getattr__(self, method: str) -> Any:
            return lambda *args: heard.append((method, args))

    scores: list[Score] = []
    recorder = Recorder([Listener(), scores.append])  # a plain callable hears the scores
    counters = Counters(2, 4, 64, 1, 0)
    reason = WorkerError(1, "killed by SIGKILL")
    records: list[Report] = [
        Score(2, 4, 64, 0, 0.5, 1.0),
        Validation(2, 4, 64, 0, {"val_loss": 0.5}, 1.5, counters=counters),
        EpochEnd(0, 4, 64, 0.5, 2.0, counters=counters),
        Replacement(1, reason, 3, 2.5, counters=counters),
    ]
    for record in records:
        recorder(record)
    h = recorder.history
    assert (h.scores, h.validations, h.epochs, h.replacements) == ([records[0]], [records[1]], [records[2]], [records[3]])
    assert heard == [("on_score", (records[0],)), ("on_validation", (records[1],)), ("on_epoch_end", (records[2],)), ("on_worker_replaced", (1, reason, 3))]
    assert scores == [records[0]]


def test_checkpoint_format_round_trip_and_refusal(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    job = Job(model, torch.optim.SGD, {"lr": 0.1}, nn.functional.mse_loss, None)
    config = Config(workers=2, averaging_frequency=3)
    writer = checkpoint.Checkpointer(str(tmp_path), 5, checkpoint.fingerprint(config, job, 2), describe_config(config))
    assert writer.due(10) and not writer.due(11)
    counters = Counters(rounds=10, iterations=30, samples=300, epoch=1, position=4)
    state = TrainingState(model.state_dict(), {"state": {}, "param_groups": []})
    writer.save(state, counters, [{"torch": torch.get_rng_state()}] * 2)
    payload = torch.load(tmp_path / checkpoint.FILENAME, weights_only=True)  # tensors and plain values only
    assert set(payload) == {"format", "fingerprint", "config", "model", "optimizer", "lr_scheduler", "outer_optimizer", "counters", "rng"}
    assert payload["format"] == checkpoint.FORMAT and payload["config"]["averaging_frequency"] == 3
    assert checkpoint.checkpoint_counters(tmp_path) == dataclasses.asdict(counters)
    assert checkpoint.load(tmp_path, checkpoint.fingerprint(config, job, 2))["counters"]["position"] == 4
    other = checkpoint.fingerprint(Config(workers=2, averaging_frequency=4), job, 3)
    with pytest.raises(checkpoint.CheckpointError) as error:
        checkpoint.load(tmp_path, other)
    assert "workers: checkpoint has 2, this run has 3" in str(error.value)
    assert "averaging_frequency: checkpoint has 3, this run has 4" in str(error.value)
    # An option at its default is left out of a fingerprint (as in checkpoints from before it):
    # a checkpoint of a non-default value is refused by a run at the default, and the other way.
    warm = checkpoint.fingerprint(Config(workers=2, averaging_frequency=3, warmup_sync_steps=5), job, 2)
    assert "warmup_sync_steps" in warm and "warmup_sync_steps" not in checkpoint.fingerprint(config, job, 2)
    writer = checkpoint.Checkpointer(str(tmp_path / "warm"), 5, warm, describe_config(config))
    writer.save(state, counters, [{"torch": torch.get_rng_state()}] * 2)
    with pytest.raises(checkpoint.CheckpointError, match=r"warmup_sync_steps: checkpoint has 5, this run has the default"):
        checkpoint.load(tmp_path / "warm", checkpoint.fingerprint(config, job, 2))
    with pytest.raises(checkpoint.CheckpointError, match=r"warmup_sync_steps: checkpoint has the default, this run has 5"):
        checkpoint.load(tmp_path, warm)
    assert not list(tmp_path.glob(".checkpoint-*"))  # no temporary file left


class _Payload:
    """What a hostile checkpoint could carry: unpickling it would write a file."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.target, "ran"))


REFUSED = r"holds more than tensors and plain values, .* not resumed"


@pytest.mark.parametrize("reader", ["checkpoint_counters", "fit(resume=...)", "pw-fit --resume"])
def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(reader: str, tmp_path: Path, mnist_dir: Path) -> None:
    """Each way a checkpoint is read refuses it with a CheckpointError, and the payload never runs.
    One worker on the CPU trains in this process: fit() spawns nothing."""
    ran, checkpoints = tmp_path / "ran.txt", tmp_path / "ckpt"
    checkpoints.mkdir()
    torch.save({"format": checkpoint.FORMAT, "counters": {}, "model": _Payload(ran)}, checkpoints / checkpoint.FILENAME)
    if reader == "checkpoint_counters":
        with pytest.raises(checkpoint.CheckpointError, match=REFUSED):
            checkpoint.checkpoint_counters(checkpoints)
    elif reader == "fit(resume=...)":
        with ParallelWrapper.builder(nn.Linear(4, 2)).workers(1).build() as wrapper, pytest.raises(checkpoint.CheckpointError, match=REFUSED):
            wrapper.fit([(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))], resume=checkpoints)
    else:
        args = ["--workers", "1", "--data-dir", str(mnist_dir), "--train-samples", "128", "--test-samples", "128", "--resume", str(checkpoints)]
        result = CliRunner().invoke(cli.main, args, prog_name="pw-fit")
        assert result.exit_code == 1 and re.search(REFUSED, result.output), result.output
        assert "Traceback" not in result.output
    assert not ran.exists()


def test_worker_error_says_who_where_and_what_in_its_first_line_and_travels() -> None:
    error = WorkerError(1, "RuntimeError: boom", "Traceback (most recent call last):\n  ...", Where(0, 9, 4, "(float32[16, 7])"))
    first = str(error).splitlines()[0]
    assert first == "worker 1 failed while training on batch 9 of epoch 0 (float32[16, 7]) (local step 4): RuntimeError: boom"
    assert (error.rank, error.epoch, error.batch, error.local_step) == (1, 0, 9, 4)
    gloo = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    echoed = error.with_echoes({1: "ignored: the error itself", 0: gloo})
    # First things first: who failed where and why, a line for each peer's echo, then the worker's traceback.
    assert str(echoed).splitlines()[:4] == [first, "(also worker 0: RuntimeError: Connection closed by peer)", "", "Traceback in worker 1 (most recent call last):"]
    assert str(echoed).count("also worker") == 1
    copy = pickle.loads(pickle.dumps(echoed))
    assert str(copy) == str(echoed) and copy.where == error.where
    between = WorkerError(0, "FloatingPointError: diverged", where=Where(2, -1, 7))
    assert str(between) == "worker 0 failed in epoch 2 (local step 7): FloatingPointError: diverged"
    assert between.batch is None and WorkerError(3, "killed").where is None


def test_a_worker_trains_a_copy_on_its_device_and_loads_state_there() -> None:
    """By construction, on any host: the model is copied and moved before state is loaded, so the
    optimizer's state lands on the worker's device ('meta' stands in for a GPU here)."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    job = Job(model, torch.optim.Adam, {"lr": 0.1}, nn.functional.mse_loss, None)
    worker = Worker(job, Config(workers=1), Placement(1, ("meta",), "gloo", 1, None), 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # loading into meta tensors is a no-op, and torch says so
        worker.replica.load_state(TrainingState(model.state_dict(), optimizer.state_dict()))
    assert all(p.device.type == "meta" for p in worker.replica.model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())  # the user's model stays
    moments = [v for st in worker.replica.optimizer.state.values() for k, v in st.items() if k != "step"]
    assert len(moments) == 4 and all(v.device.type == "meta" for v in moments)
