"""on_worker_failure("replace"): the fault matrix with real spawned processes and real gloo. A
fault (a stall, a SIGKILL, a raise) strikes once, on one batch; fit() completes, every batch counts
once in the final model (the model counts them itself), and with the deterministic feed the model
equals the fault-free run's. A batch that fails two workers, and more failures than allowed, raise;
the conftest fixture checks that no process is left."""

from __future__ import annotations

import collections
import datetime
import multiprocessing
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import HashStore, PrefixStore, Store, distributed_c10d  # type: ignore[attr-defined]

from parallelwrapper import ParallelWrapper, WorkerError
from parallelwrapper.feed.queue import END_SLOT, EndMark, Feeder
from parallelwrapper.feed.slots import SlotReader, SlotWriter
from parallelwrapper.hosts.supervisor import STOPPED_S
from parallelwrapper.replacement import regroup
from parallelwrapper.replacement.ledger import Entry, Ledger, split
from parallelwrapper.replacement.refeed import refeed
from parallelwrapper.types import Counters
from tiny import mlp

pytestmark = pytest.mark.timeout(120)

BATCHES, SIZE, LR = 12, 8, 0.1


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(inputs, targets, batch id): the id lets a step name the batch it trains on."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(SIZE, 10, generator=g), torch.randint(0, 3, (SIZE,), generator=g), torch.tensor([i])) for i in range(BATCHES)]


class Counting(nn.Module):
    """The tiny MLP, and a parameter that counts each batch's trainings that reached the average:
    a step adds LR to `seen[id]` (the loss has a term -seen[id]), and an average of W workers that
    trained a batch each, or k each, weighs every worker's steps by 1/W. So without momentum,
    seen · W / LR counts how often each batch is in the final model."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.seen = nn.Parameter(torch.zeros(BATCHES))


def counts(model: Counting, workers: int) -> list[int]:
    return [round(v) for v in (model.seen.detach() * workers / LR).tolist()]


# -- the training step and its faults (module level: spawned workers import it) ---------------------


def _strike(fault: str) -> None:
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    elif fault == "raise":
        raise RuntimeError("boom on a marked batch")
    elif fault == "stall":
        time.sleep(600)
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # as a frozen machine, or a debugger's Ctrl-Z, would


def step(model: Counting, batch: Any) -> torch.Tensor:
    """Strikes on the batch ids of $PW_TEST_FAULTS ("5:kill,8:raise"): once per id (the first
    time: a flag file in $PW_TEST_DIR), or on every take with $PW_TEST_EVERY_TIME."""
    x, y, ids = batch
    batch_id = int(ids[0])
    faults = dict(item.split(":") for item in os.environ["PW_TEST_FAULTS"].split(",") if item)
    if str(batch_id) in faults:
        flag = Path(os.environ["PW_TEST_DIR"]) / f"struck-{batch_id}"
        if os.environ["PW_TEST_EVERY_TIME"] or not flag.exists():
            flag.touch()
            _strike(faults[str(batch_id)])
    return nn.functional.cross_entropy(model.net(x), y) - model.seen[batch_id]


class RegroupFaults:
    """`step`, and faults in the regroups that follow a replacement, armed in each worker as it
    unpickles the job (a fresh process too): at generation g, the member whose process name ends
    with a given word ("worker-0"; a standby taken for a rank keeps "standby") kills itself
    before it comes ("before": the others wait for it) or once the group has formed, before the
    kept state is sent ("formed": the others' broadcast breaks). `spec`: "1:worker-0:before,2:standby:formed".
    And "end0:worker-0:report": it kills itself as it reports epoch 0's end, before the report leaves."""

    def __init__(self, spec: str) -> None:
        self.spec = spec

    def __call__(self, model: Counting, batch: Any) -> torch.Tensor:
        return step(model, batch)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if multiprocessing.parent_process() is not None:  # a worker: not the main process's deep copies
            _arm({g: (name, fault) for g, name, fault in (item.split(":") for item in self.spec.split(","))})


_armed: list[str] = []  # in a worker: the fault due once the group has formed


def _arm(faults: dict[str, tuple[str, str]]) -> None:
    import torch.distributed as dist

    from parallelwrapper.hosts import process
    from parallelwrapper.replacement import regroup

    if getattr(regroup.assemble, "striking", False):
        return
    assemble, broadcast = regroup.assemble, dist.broadcast_object_list

    def striking_assemble(store: Any, members: int, generation: int) -> None:
        name, fault = faults.get(str(generation), ("", ""))
        if name and multiprocessing.current_process().name.endswith(name) and _first(f"regroup-{generation}"):
            if fault == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            _armed.append(fault)
        assemble(store, members, generation)

    def striking_broadcast(*args: Any, **kwargs: Any) -> None:
        if _armed:
            os.kill(os.getpid(), signal.SIGKILL)
        broadcast(*args, **kwargs)

    striking_assemble.striking = True
    regroup.assemble, dist.broadcast_object_list = striking_assemble, striking_broadcast
    reports = process._Reports.__call__

    def striking_report(self: Any, report: Any) -> None:
        name, _ = faults.get(f"end{getattr(report, 'complete', None) and report.epoch}", ("", ""))
        if name and multiprocessing.current_process().name.endswith(name) and _first(f"end-{report.epoch}"):
            os.kill(os.getpid(), signal.SIGKILL)
        reports(self, report)

    process._Reports.__call__ = striking_report  # type: ignore[method-assign]


def _first(name: str) -> bool:
    """Whether this process is the first to claim `name` (a file in $PW_TEST_DIR)."""
    try:
        os.close(os.open(Path(os.environ["PW_TEST_DIR"]) / name, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class Heard:
    """A listener that keeps what on_worker_replaced hears."""

    def __init__(self) -> None:
        self.replaced: list[tuple[int, WorkerError, int]] = []

    def on_worker_replaced(self, rank: int, reason: WorkerError, lost_round: int) -> None:
        self.replaced.append((rank, reason, lost_round))


def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, faults: str = "", k: int = 2, deterministic: bool = True,
          max_replacements: int = 3, epochs: int = 2, every_time: bool = False, fits: int = 1, workers: int = 2,
          mode: str = "averaging", momentum: float = 0.0, overlap: bool = False, stall: float = 2,
          training_step: Any = step, auto: bool = False) -> tuple[Counting, Any, Heard]:  # fmt: skip
    monkeypatch.setenv("PW_TEST_DIR", str(tmp_path))
    monkeypatch.setenv("PW_TEST_FAULTS", faults)
    monkeypatch.setenv("PW_TEST_EVERY_TIME", "1" if every_time else "")
    heard = Heard()
    model = Counting()
    b = (
        ParallelWrapper.builder(model).workers(workers).threads_per_worker(1).deterministic(deterministic)
        .optimizer(torch.optim.SGD, lr=LR, momentum=momentum).training_step(training_step).averaging_frequency(k).training_mode(mode)
        .stall_timeout(stall).on_worker_failure("replace", max_replacements=max_replacements).listeners(heard)
        .overlap_averaging(overlap)
    )  # fmt: skip
    if auto:  # exchanges allowed 90% of the time: k = 1 from the first decision on, whatever the timings
        b = b.averaging_frequency("auto", k_min=1, k_max=4, exchange_share=0.9).payload_dtype("float32")
    with b.build() as wrapper:
        for _ in range(fits):  # a fit() ends holding no slot, whatever it took
            history = wrapper.fit(batches(), epochs=epochs // fits)
        assert wrapper.samples == epochs * BATCHES * SIZE  # every batch landed once, by the counters
    return model, history, heard


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Counting:
    with pytest.MonkeyPatch.context() as mp:
        model, _, heard = train(tmp_path_factory.mktemp("fault-free"), mp, fits=2)
    assert not heard.replaced and counts(model, 2) == [2] * BATCHES
    return model


def test_a_stall_a_kill_and_a_raise_each_replace_a_worker_and_the_run_ends_as_the_fault_free_one(
    fault_free: Counting, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # k = 2 on 2 workers: round r trains batches 4(r - 1) to 4r - 1 of epoch 0, batch i on worker i mod 2.
    model, history, heard = train(tmp_path, monkeypatch, faults="3:stall,5:kill,8:raise")
    assert [(rank, lost_round) for rank, _, lost_round in heard.replaced] == [(1, 1), (1, 2), (0, 3)]
    stalled, killed, raised = (reason for _, reason, _ in heard.replaced)
    assert [(e.rank, e.epoch, e.batch) for e in (stalled, killed, raised)] == [(1, 0, 3), (1, 0, 5), (0, 0, 8)]
    assert "stalled: no progress for 2 s" in stalled.summary and "killed by SIGKILL" in killed.summary
    assert "boom on a marked batch" in str(raised) and "Traceback" in raised.details
    assert [(r.rank, r.lost_round) for r in history.replacements] == [(1, 1), (1, 2), (0, 3)]
    # Every record's seconds count from the fit's start: the fresh rank 0's too (Regroup.start).
    seconds = [s.seconds for s in history.scores]
    assert seconds == sorted(seconds) and 2.0 <= history.replacements[0].seconds <= history.replacements[-1].seconds <= history.epochs[-1].seconds
    assert history.replacements[-1].counters.rounds == 2  # the workers went back to the average before round 3
    assert counts(model, 2) == [2] * BATCHES  # two epochs, each batch once in each
    assert_same_model(model, fault_free)


def test_a_worker_stopped_by_sigstop_is_lost_after_a_bounded_wait_and_replaced(
    fault_free: Counting, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stall timeout is long (60 s): the supervisor sees the stopped process itself (STOPPED_S),
    # kills it, so that a late SIGCONT finds nothing, and a replacement redoes its round.
    start = time.monotonic()
    model, history, heard = train(tmp_path, monkeypatch, faults="5:stop", stall=60)
    assert time.monotonic() - start < 45
    [(rank, reason, lost_round)] = heard.replaced
    assert (rank, lost_round, reason.batch) == (1, 2, 5)
    assert re.search(rf"stopped by a signal \(SIGSTOP\) for 0\.\d s.*send SIGCONT within {STOPPED_S:g} s", reason.summary)
    assert counts(model, 2) == [2] * BATCHES
    assert_same_model(model, fault_free)


@pytest.mark.filterwarnings("ignore:3 workers on 2 CPU cores")
def test_three_workers_sharing_gradients_with_momentum_end_bitwise_equal_to_the_fault_free_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batch 7 is worker 1's (7 mod 3) in step 3 (batches 6-8) of epoch 0.
    run = {"workers": 3, "mode": "shared-gradients", "k": 1, "momentum": 0.9}
    model, _, heard = train(tmp_path, monkeypatch, faults="7:kill", **run)  # type: ignore[arg-type]
    reference, _, _ = train(tmp_path, monkeypatch, **run)  # type: ignore[arg-type]
    assert [(rank, lost_round) for rank, _, lost_round in heard.replaced] == [(1, 3)]
    for name, x in model.state_dict().items():
        assert torch.equal(x, reference.state_dict()[name]), name


def test_overlapped_rounds_go_back_to_the_last_landed_average_and_count_every_batch_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # k = 2 on 2 workers, each round landing during the next: batch 9 is worker 1's in round 3,
    # while round 2 is in flight. The redo starts from round 1's or 2's landed average, whichever
    # a survivor holds, and every batch after it is trained again.
    model, history, heard = train(tmp_path, monkeypatch, faults="9:kill", overlap=True, epochs=1)
    assert [(rank, reason.batch) for rank, reason, _ in heard.replaced] == [(1, 9)]
    assert history.scores[-1].iteration == BATCHES
    assert counts(model, 2) == [1] * BATCHES  # not one batch lost or counted twice


def test_the_autopilot_goes_on_after_a_kill_with_the_choices_of_the_round_it_redoes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pilot has left its start (k = 2) for k = 1 by batch 9: a replacement that began there
    # would run another k than the survivors, and the round would fail as the workers' choices differ.
    model, history, heard = train(tmp_path, monkeypatch, faults="9:kill", deterministic=False, auto=True)
    assert [reason.batch for _, reason, _ in heard.replaced] == [9]
    # First-come batches: an average weighs each worker by the batches it took, so a batch's count
    # is not a whole number; every one reached the model, and the counters took each once (train).
    assert bool((model.seen > 0).all())
    assert 1 in {s.k for s in history.scores} and history.scores[-1].iteration == 2 * BATCHES


def test_first_come_feed_counts_every_batch_once_after_a_kill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Shared gradients: every step, each worker trains one batch, whichever it takes.
    model, history, heard = train(tmp_path, monkeypatch, faults="5:kill", deterministic=False, epochs=1, mode="shared-gradients", k=1)
    assert len(heard.replaced) == 1 and heard.replaced[0][1].batch == 5
    assert history.scores[-1].iteration == BATCHES
    assert counts(model, 2) == [1] * BATCHES


@pytest.mark.filterwarnings("ignore:3 workers on 2 CPU cores")
def test_a_member_lost_while_the_new_group_forms_is_replaced_too_and_every_batch_counts_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kill on batch 5 (worker 2's) starts generation 1. Worker 0 kills itself before it comes,
    # so the others wait for it until the main process gives generation 1 up (not for the 90 s of
    # the store's timeout). In generation 2 the standby that took rank 2 kills itself once the
    # group has formed, so the others' broadcast of the kept state breaks (gloo's error, a
    # RuntimeError, parks them). Worker 1 keeps the state throughout; generation 3 has no fault.
    # All three losses are replacements, the regroups' at no batch.
    start = time.monotonic()
    model, history, heard = train(
        tmp_path, monkeypatch, faults="5:kill", workers=3, epochs=1, stall=60, max_replacements=3,
        training_step=RegroupFaults("1:worker-0:before,2:standby:formed"),
    )  # fmt: skip
    assert time.monotonic() - start < 45
    reasons = [reason for _, reason, _ in heard.replaced]
    assert [(rank, r.batch) for rank, r, _ in heard.replaced] == [(2, 5), (0, None), (2, None)]
    assert all("killed by SIGKILL" in r.summary for r in reasons)
    assert len(history.replacements) == 3
    assert history.scores[-1].iteration == BATCHES
    assert counts(model, 3) == [1] * BATCHES  # not one batch lost or counted twice


def test_an_epochs_end_that_rank_0_took_with_it_is_reported_from_another_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 lands epoch 0's last round and is killed as it reports its end: the others, in
    # epoch 1 already, redo its first round, and epoch 0 is not redone. Its end comes from worker 1.
    model, history, heard = train(tmp_path, monkeypatch, training_step=RegroupFaults("end0:worker-0:report"))
    assert [(rank, reason.batch) for rank, reason, _ in heard.replaced] == [(0, None)]
    assert [(e.epoch, e.samples) for e in history.epochs] == [(0, BATCHES * SIZE), (1, 2 * BATCHES * SIZE)]
    assert counts(model, 2) == [2] * BATCHES


def test_a_poison_batch_raises_naming_it_after_two_workers_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(WorkerError, match=r"batch 5 of epoch 0 failed on two workers in turn") as raised:
        train(tmp_path, monkeypatch, faults="5:raise", every_time=True)
    assert raised.value.batch == 5 and "fix or drop that batch" in str(raised.value).splitlines()[0]


def test_more_failures_than_allowed_raise_the_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(WorkerError, match=r"worker 0 failed while training on batch 8 of epoch 0") as raised:
        train(tmp_path, monkeypatch, faults="5:raise,8:raise", max_replacements=1)
    assert "boom on a marked batch" in str(raised.value)


# -- the fast tier: the ledger's bookkeeping ------------------------------------------------------


@pytest.mark.fast
def test_the_ledger_frees_landed_rounds_and_keeps_the_round_taken_ahead_and_the_epochs_end() -> None:
    import multiprocessing

    ledger = Ledger(multiprocessing.get_context("spawn"), 6)
    ledger.cut(1, 0, finished=False, landed=0)
    for slot in (10, 11):
        ledger.take(slot)
    ledger.take(12)
    ledger.retag_last(2)  # the batch looked ahead at, for round 2
    assert ledger.cut(2, 0, finished=False, landed=1) == [10, 11]
    ledger.take(END_SLOT)
    assert ledger.entries() == [Entry(2, 12, 0), Entry(2, END_SLOT, 0)]
    assert ledger.cut(3, 0, finished=True, landed=2) == [12]
    assert ledger.entries() == [Entry(2, END_SLOT, 0)]  # the end stays while the epoch lasts
    assert ledger.cut(4, 1, finished=False, landed=3) == [] and ledger.entries() == []
    # overlap_averaging: round 5 starts while round 4 is averaged; its batches stay until it lands
    for slot in (20, 21):
        ledger.take(slot)
    assert ledger.cut(5, 1, finished=False, landed=3) == [] and len(ledger.entries()) == 2
    assert ledger.cut(6, 1, finished=False, landed=4) == [20, 21]


@pytest.mark.fast
def test_a_redo_feeds_again_what_was_taken_for_its_round_or_later() -> None:
    entries = [Entry(3, 1, 0), Entry(3, 2, 0), Entry(4, 5, 0), Entry(3, END_SLOT, 0), Entry(1, END_SLOT, -1)]
    # A survivor whose round 3 landed for the others: round 4 is redone.
    again, free = split(entries, 4, 0)
    assert again == [Entry(4, 5, 0), Entry(3, END_SLOT, 0)] and free == [1, 2]
    assert split(entries, 3, 0) == ([Entry(3, 1, 0), Entry(3, 2, 0), Entry(4, 5, 0), Entry(3, END_SLOT, 0)], [])


class WaitingWriter(SlotWriter):
    """A SlotWriter that says when its caller first waited for a slot: it is then told to keep
    waiting (`pack`'s keep_waiting), which a test waits for instead of sleeping."""

    def __init__(self, free: Any, slots: int) -> None:
        super().__init__(free, slots=slots)
        self.waiting = threading.Event()

    def pack(self, batch: Any, keep_waiting: Any) -> tuple[int, str, object] | None:
        def told() -> bool:
            self.waiting.set()
            return bool(keep_waiting())

        return super().pack(batch, told)


@pytest.mark.fast
def test_a_feeder_waiting_for_a_slot_puts_back_a_lost_round_that_holds_every_slot() -> None:
    """pw-fit --max-replacements once hung here: the feeder waited for a free slot before putting
    anything, and the lost round it was to put back in front held every slot there was."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    free, q = ctx.Queue(), ctx.Queue(maxsize=4)
    writer, reader = WaitingWriter(free, slots=2), SlotReader(free)
    feeder = Feeder([torch.full((2,), float(i)) for i in range(4)], 0, 1, 0, [q], 1, writer).start()
    try:
        lost = [q.get(timeout=10) for _ in range(2)]  # a worker took both slots' batches, then died
        assert writer.waiting.wait(10)  # the feeder is waiting for a slot
        feeder.pause()
        feeder.resume(front=[(q, item) for item in lost])
        again = [q.get(timeout=10) for _ in range(2)]
        assert [index for index, _ in again] == [0, 1]
        assert [float(reader.unpack(*packed)[0]) for _, packed in again] == [0.0, 1.0]  # and hands the slots back
        rest = [q.get(timeout=10) for _ in range(3)]
        assert [item[0] if isinstance(item, tuple) else item for item in rest] == [2, 3, EndMark(0)]
    finally:
        feeder.stop()
        reader.close()
        writer.close()


class _FedQueue:
    """A feeder of 6 batches into a queue of 2 for one worker with a ledger, and the worker's and
    the main process's moves in a replacement, by hand."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.free, self.q = ctx.Queue(), ctx.Queue(maxsize=2)
        self.writer, self.reader = SlotWriter(self.free, slots=8), SlotReader(self.free)
        self.ledger = Ledger(ctx, 10)
        self.feeder = Feeder([torch.full((2,), float(i)) for i in range(6)], 0, 1, 0, [self.q], 1, self.writer).start()
        self.ledger.cut(1, 0, finished=False, landed=0)

    def take(self, record: bool = True) -> int:
        """The next batch's index; with `record` false, the worker is killed before its ledger
        records the take."""
        index, (slot, _, _) = self.q.get(timeout=10)
        if record:
            self.ledger.take(slot)
        return int(index)

    def lose(self, full: bool = True) -> None:
        """A worker is lost: the feed pauses and round 1 (from batch 0 of epoch 0) is fed again.
        `full`: once the feeder has filled the queue."""
        deadline = time.monotonic() + 10
        while full and self.q.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.feeder.pause()
        self.feeder.resume(refeed([self.ledger], 1, Counters(), self.feeder.take_back(), [self.q], self.free))

    def rest(self) -> list[Any]:
        return [item[0] if isinstance(item, tuple) else item for item in (self.q.get(timeout=10) for _ in range(7))]

    def close(self) -> None:
        self.feeder.stop()
        self.reader.close()
        self.writer.close()


@pytest.mark.fast
def test_a_loss_soon_after_a_replacement_feeds_its_round_again_before_what_the_first_refeed_had_still_to_put() -> None:
    """A 300-epoch soak once ended an epoch short: a second loss came while the feeder still held
    part of the first loss's refeed, and the new refeed went in behind it. Here the worker takes
    batches 0 and 1 and is lost; its replacement takes batch 0 (the queue holds 1 and 2, and
    batch 3 still waits in the feeder) and is lost too. The queue then gives every batch once, in
    the order the feeder read them, and the end of the epoch."""
    fed = _FedQueue()
    try:
        assert [fed.take(), fed.take()] == [0, 1]
        fed.lose()
        assert fed.take() == 0
        fed.lose()
        assert fed.rest() == [0, 1, 2, 3, 4, 5, EndMark(0)]
    finally:
        fed.close()


@pytest.mark.fast
def test_a_batch_taken_by_a_worker_killed_before_its_ledger_recorded_it_is_fed_again() -> None:
    """An 80-epoch soak at a fault every 2 s ended one batch short: a worker killed after its take
    from the queue and before its ledger's record of it. What goes back comes from what the
    feeder put, not from the ledgers; the end of the epoch, taken unrecorded too, goes back also."""
    fed = _FedQueue()
    try:
        assert [fed.take(), fed.take(record=False)] == [0, 1]
        fed.lose()
        assert [fed.take() for _ in range(6)] == [0, 1, 2, 3, 4, 5]
        fed.q.get(timeout=10)  # the end of the epoch, unrecorded
        fed.lose(full=False)  # the feeder has put everything
        assert fed.rest() == [0, 1, 2, 3, 4, 5, EndMark(0)]
    finally:
        fed.close()


@pytest.mark.fast
def test_a_worker_killed_in_the_middle_of_a_take_leaves_a_queue_that_reads_again_after_a_refeed() -> None:
    """A soak of SIGSTOPs ended in EOFError at the refeed's read of the queue: a worker stopped,
    then killed, after it had read a message's length and not its bytes (holding the queue's read
    lock). The refeed reads the pipe's bytes off as they are, and feeds everything again."""
    fed = _FedQueue()
    try:
        assert fed.take() == 0
        deadline = time.monotonic() + 10
        while fed.q.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        fed.q._rlock.acquire()  # the worker's get, up to its death: the lock, and the length
        os.read(fed.q._reader.fileno(), 4)
        fed.lose(full=False)
        assert fed.rest() == [0, 1, 2, 3, 4, 5, EndMark(0)]
    finally:
        fed.close()


@pytest.mark.fast
def test_a_worker_waiting_for_a_batch_is_called_away_at_once_and_refeed_drops_the_marks_no_one_took() -> None:
    """A failure puts a CallAway in the queue for each worker that reads it: one waiting for a
    batch leaves at once (Aborted, its ledger untouched), not at its next look at the abort event
    (a second later); refeed drains the marks no one took."""
    import multiprocessing

    from parallelwrapper.feed.queue import Aborted, CallAway, QueueSource, Unput

    ctx = multiprocessing.get_context("spawn")
    free, q = ctx.Queue(), ctx.Queue()
    reader, ledger = SlotReader(free), Ledger(ctx, 4)
    source = QueueSource(q, reader, ctx.Event(), ledger)
    try:
        q.put(CallAway())
        q.put(CallAway())
        start = time.monotonic()
        with pytest.raises(Aborted, match="called away from its wait for a batch"):
            source.next_batch()
        assert time.monotonic() - start < 0.5 and ledger.entries() == []
        unput = Unput({}, collections.Counter(), None)
        assert refeed([ledger], 1, Counters(), unput, [q], free) == []  # the second mark: drained, not fed
    finally:
        reader.close()


def test_a_member_whose_join_failed_half_way_joins_the_next_generation_under_a_fresh_processs_group_name() -> None:
    # torch names the default group by its count of groups made: a join that failed half-way (a
    # member lost as gloo connected) left it one up, and the member then waited under another name
    # than the fresh process's, until the timeout.
    store = HashStore()
    with pytest.raises(Exception, match="[Tt]imeout"):
        dist.init_process_group("gloo", store=PrefixStore("generation-1", store), rank=0, world_size=2, timeout=datetime.timedelta(seconds=1))
    assert not dist.is_initialized() and distributed_c10d._world.group_count == 1

    def into(prefixed: Store, timeout: datetime.timedelta) -> None:
        dist.init_process_group("gloo", store=prefixed, rank=0, world_size=1, timeout=timeout)

    try:
        regroup.join(store, 2, 1, datetime.timedelta(seconds=5), into)
        assert distributed_c10d._get_default_group().group_name == "0"  # a fresh process's
    finally:
        dist.destroy_process_group()


class _NoCompareSet(Store):
    """A store with only add, set, get and wait, as torch's EtcdStore (its compare_set is not
    implemented): the replicated store a fleet's groups may form in."""

    def __init__(self) -> None:
        super().__init__()
        self._store = HashStore()

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        raise RuntimeError("compare_set is not implemented (as in EtcdStore)")


@pytest.mark.fast
def test_a_generation_forms_or_is_given_up_over_a_store_without_compare_set() -> None:
    """The first word stays whoever says it, decided by add alone: every member of a generation
    that all reached passes, and after the main process gave one up its members fail, the one
    that came last too."""
    import threading

    store = _NoCompareSet()
    failed: list[int] = []

    def member(generation: int, i: int) -> None:
        try:
            regroup.assemble(PrefixStore(f"generation-{generation}", store), 3, generation)
        except RuntimeError:
            failed.append(i)

    threads = [threading.Thread(target=member, args=(1, i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert failed == [] and not any(t.is_alive() for t in threads)
    regroup.abandon(store, 1)  # too late: the generation formed, its word stays
    member(1, 9)  # a late reader sees the same word
    assert failed == []

    waiting = [threading.Thread(target=member, args=(2, i)) for i in range(2)]
    for t in waiting:
        t.start()
    regroup.abandon(store, 2)  # a member was lost before the third came
    for t in waiting:
        t.join(10)
    member(2, 2)  # the third comes after the word: it fails too, at once
    assert sorted(failed) == [0, 1, 2] and not any(t.is_alive() for t in waiting)
