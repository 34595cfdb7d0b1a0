"""The payload codecs (codec.py): each round trip's error is bounded per block, int4 packs exactly,
error feedback loses nothing over 60 rounds, every rank decodes bitwise the same sum; and, with
real gloo exchanges in two processes, an MLP trained with each payload ends close to float32.

The fast tests play several ranks in one process: each rank's DeltaCoder, its payload copied into
the others' inboxes as the exchange would."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from groups import run_group
from parallelwrapper import ParallelWrapper
from parallelwrapper import codec as codec_module
from parallelwrapper.averaging import FlatAverager
from parallelwrapper.codec import BLOCK, CODECS, TINY, DeltaCoder, codec
from parallelwrapper.payloads import SPARSE_BLOCK, SPARSE_ENTRIES, bits, problem
from parallelwrapper.rounds.state import exact_tensors, optimizer_state_tensors
from tiny import make_batches, mlp

CPU = torch.device("cpu")
LEVELS = {"int8": 127, "int4": 7}
DENSE = tuple(name for name in CODECS if name != "sparse")  # every number sent, to within half a step
RELATIVE = {"bfloat16": 2.0**-8, "float16": 2.0**-11}  # half a unit in the last place, relative (normal range)


def exchange(coders: list[DeltaCoder], scales: list[float], alpha: float) -> list[list[torch.Tensor]]:
    """One round among ranks played in one process: each encodes, every payload lands in every
    other rank's inbox, each decodes. Every rank's payloads, by piece."""
    payloads = [[p.clone() for p in c.encode(s)] for c, s in zip(coders, scales, strict=True)]
    for c in coders:
        for i in range(c.pieces):
            for r, sent in enumerate(payloads):
                if r != c.rank:
                    c.inbox[i][r].copy_(sent[i])
            c.decode(i, alpha)
    return payloads


def scales_of(coder: DeltaCoder, payloads: list[torch.Tensor]) -> torch.Tensor:
    """The per-block scales of a payload, in block order."""
    out = []
    for payload in payloads:
        blocks = payload.numel() // (BLOCK * coder.codec.bits // 8 + 4)  # each: its codes and a float32
        out.append(payload[blocks * BLOCK * coder.codec.bits // 8 :].view(torch.float32))
    return torch.cat(out)


def step_bound(coder: DeltaCoder, payloads: list[torch.Tensor], sent: torch.Tensor) -> torch.Tensor:
    """Per number, half a quantization step (int8, int4: scale / 2 of its block; 16-bit floats:
    half a unit in the last place), with float32 rounding's slack."""
    if coder.codec.name in LEVELS:
        step = scales_of(coder, payloads).repeat_interleave(BLOCK)[: sent.numel()]
        return step / 2 * (1 + 1e-5) + 1e-38
    info = torch.finfo(getattr(torch, coder.codec.name))  # half an ulp; below the normal range, of a subnormal
    return (sent.abs() + info.smallest_normal) * info.eps / 2 * (1 + 1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("name", DENSE)
def test_a_round_trip_errs_by_at_most_half_a_step_and_feeds_the_error_back(name: str) -> None:
    numel = 3 * BLOCK + 17  # a partial last block
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)  # blocks of very different sizes
    delta[BLOCK : 2 * BLOCK] = 0.0  # a block of zeros
    state = torch.zeros(numel)
    coder = DeltaCoder(name, state)
    state.copy_(delta)
    (payloads,) = exchange([coder], [1.0], 1.0)
    error = coder.error[:numel]
    assert torch.equal(state, coder.start[:numel])  # the state is the start: what was decoded
    torch.testing.assert_close(state + error, delta, rtol=1e-6, atol=1e-12)  # what was sent plus the error, to a few ulp
    assert (error.abs() <= step_bound(coder, payloads, delta)).all()
    assert torch.equal(state[BLOCK : 2 * BLOCK], torch.zeros(BLOCK))  # zeros go as zeros, no NaN
    assert sum(p.numel() for p in payloads) == coder.nbytes == codec(name).nbytes(numel)


@pytest.mark.fast
@pytest.mark.parametrize(("name", "k"), [("sparse", 64), ("sparse:0.03125", 128), ("sparse:0.001", 16), ("sparse:0.021484375", 96), ("sparse:0.25", 1024)])
def test_sparse_sends_the_largest_entries_of_each_block_at_2_bits_and_keeps_the_rest(name: str, k: int) -> None:
    numel = 3 * SPARSE_BLOCK + 17  # a partial last block
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)
    delta[SPARSE_BLOCK : 2 * SPARSE_BLOCK] = 0.0  # a block of zeros
    state = torch.zeros(numel)
    coder = DeltaCoder(name, state)
    state.copy_(delta)
    (payloads,) = exchange([coder], [1.0], 1.0)
    error = coder.error[:numel]
    torch.testing.assert_close(state + error, delta, rtol=1e-6, atol=1e-7)  # sent plus kept: the change
    for b in (0, 2):  # a full block: its k largest entries went, each as one of 4 levels of its step
        block = slice(b * SPARSE_BLOCK, (b + 1) * SPARSE_BLOCK)
        sent = state[block].nonzero().flatten()
        largest = delta[block].abs().topk(k).indices
        assert len(sent) == k and set(sent.tolist()) == set(largest.tolist())
        step = delta[block].abs().max() / 1.5
        levels = (state[block][sent] / step + 1.5).double()
        torch.testing.assert_close(levels, levels.round().clamp(0, 3), rtol=0, atol=1e-4)
    assert torch.equal(state[SPARSE_BLOCK : 2 * SPARSE_BLOCK].abs().sort().values[:-k], torch.zeros(SPARSE_BLOCK - k))
    assert not state.isnan().any()  # a block of zeros: a finite step
    assert sum(p.numel() for p in payloads) == coder.nbytes == codec(name).nbytes(numel) == 4 * (3 * k // 2 + k // 4 + 4)
    assert bits(name) == 8 * codec(name).nbytes(SPARSE_BLOCK) / SPARSE_BLOCK  # what the autopilot counts
    assert (k == SPARSE_ENTRIES) == (name == "sparse") and round(32 / bits(name), 1) == {64: 141.2, 128: 71.9, 16: 512.0, 96: 95.3, 1024: 9.1}[k]  # x fewer than float32
    # An odd number of blocks: the float32 steps after the codes start on a 4-byte boundary (88
    # entries a block, 154 bytes of codes, could not view them).
    odd = DeltaCoder(name, torch.ones(4 * SPARSE_BLOCK + 5))
    assert codec(name).code_bytes(5 * SPARSE_BLOCK) % 4 == 0 and sum(p.numel() for p in odd.encode(1.0)) == odd.nbytes


@pytest.mark.fast
def test_payload_names_take_a_sparse_density_and_refuse_what_is_not_one() -> None:
    """sparse:D for D in (0, 0.25]; the builder's density keyword says the same, and refuses a
    density for another payload or out of range, saying what to write."""
    assert problem("sparse:0.03125") is None and problem("int8") is None
    for bad in ("sparse:0", "sparse:0.3", "sparse:x", "sparse:", "int16", 8):
        assert "sparse:D (D a density in (0, 0.25]" in str(problem(bad))
    build = ParallelWrapper.builder(nn.Linear(2, 2)).optimizer(torch.optim.SGD, lr=0.1).average_updaters(False)
    with build.payload_dtype("sparse", density=0.03125).build() as w:
        assert w.config.payload_dtype == "sparse:0.03125"
    with build.payload_dtype("sparse", density=64 / 4096).build() as w:
        assert w.config.payload_dtype == "sparse"  # the default's name
    with pytest.raises(ValueError, match=r"payload_dtype\('int8', density=0.1\): a density is the sparse payload's alone; use .payload_dtype\('sparse', density=0.1\)"):
        build.payload_dtype("int8", density=0.1)
    with pytest.raises(ValueError, match=r"the density must be a number in \(0, 0.25\], e.g. density=0.03125"):
        build.payload_dtype("sparse", density=0.5)
    with pytest.raises(ValueError, match=r"payload_dtype must be one of float32, .* sparse or sparse:D"):
        build.payload_dtype("sparse:2").build()


@pytest.mark.fast
def test_sparse_error_feedback_loses_nothing_and_every_rank_decodes_the_same() -> None:
    """Three ranks, unequal weights, 40 rounds: every rank holds bitwise the same state, and for
    each rank what it sent plus its error is the sum of its true changes (the one-process
    reference of the codec's rounds)."""
    numel, ranks, weights = 2 * SPARSE_BLOCK + 3, 3, [1.0, 2.0, 5.0]
    g = torch.Generator().manual_seed(1)
    start = torch.randn(numel, generator=g)
    states = [start.clone() for _ in range(ranks)]
    coders = [DeltaCoder("sparse", s, ranks, r) for r, s in enumerate(states)]
    true = [torch.zeros(numel, dtype=torch.float64) for _ in range(ranks)]
    sent = [torch.zeros(numel, dtype=torch.float64) for _ in range(ranks)]
    for _ in range(40):
        for r in range(ranks):
            delta = torch.randn(numel, generator=g) * 1e-2
            states[r].add_(delta)
            true[r] += delta.double()
        payloads = exchange(coders, [w / 4.0 for w in weights], 4.0 / sum(weights))
        for r in range(ranks):  # what rank r sent, decoded alone, in its own units
            alone = DeltaCoder("sparse", torch.zeros(numel))
            for i in range(alone.pieces):
                alone._pieces[i].payload.copy_(payloads[r][i])
                alone.decode(i, 1.0)
            sent[r] += alone.state.double() * 4.0 / weights[r]
        assert all(torch.equal(s, states[0]) for s in states)
    for r in range(ranks):
        torch.testing.assert_close(sent[r] + coders[r].error[:numel].double(), true[r], rtol=0, atol=1e-5)


@pytest.mark.fast
def test_int4_packs_two_codes_a_byte_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-7, 8, (4, BLOCK), generator=g).float()
    codes[:, 0] = 7  # absmax 7 in every block: the scale is 1, and every number a code
    state = torch.zeros(codes.numel())
    coder = DeltaCoder("int4", state)
    state.copy_(codes.view(-1))
    ((payload,),) = exchange([coder], [1.0], 1.0)
    packed = payload[: codes.numel() // 2].view(torch.int8).view(4, BLOCK // 2)
    assert torch.equal(packed, (codes[:, : BLOCK // 2] + 16 * codes[:, BLOCK // 2 :]).to(torch.int8))
    assert torch.equal(scales_of(coder, [payload]), torch.ones(4))
    assert torch.equal(state, codes.view(-1)) and torch.equal(coder.error, torch.zeros_like(coder.error))
    assert payload.numel() == codes.numel() // 2 + 4 * 4  # half a byte a number, a float32 a block


@pytest.mark.fast
@pytest.mark.parametrize("name", DENSE)
def test_error_feedback_stays_within_a_step_over_60_rounds_and_every_rank_decodes_the_same(name: str) -> None:
    """Three ranks, unequal weights (send scale w_r / ref, apply ref / Σw), 60 rounds: every rank
    holds bitwise the same state; for each rank, what it sent plus its error is its true deltas'
    sum (error feedback loses nothing), and its error is within half a step of the last round."""
    numel, ranks, weights = 5 * BLOCK + 3, 3, [1.0, 2.0, 5.0]
    g = torch.Generator().manual_seed(1)
    start = torch.randn(numel, generator=g)
    states = [start.clone() for _ in range(ranks)]
    coders = [DeltaCoder(name, s, ranks, r) for r, s in enumerate(states)]
    true = [torch.zeros(numel, dtype=torch.float64) for _ in range(ranks)]
    sent = [torch.zeros(numel, dtype=torch.float64) for _ in range(ranks)]
    average = start.double()
    for _ in range(60):
        deltas = [torch.randn(numel, generator=g) * 1e-2 for _ in range(ranks)]
        for r in range(ranks):
            states[r].add_(deltas[r])
            true[r] += deltas[r].double()
        payloads = exchange(coders, [w / 4.0 for w in weights], 4.0 / sum(weights))
        for r in range(ranks):  # what rank r sent, decoded alone: (its delta + its error) · w_r / 4
            alone = DeltaCoder(name, torch.zeros(numel))
            for i in range(alone.pieces):
                alone._pieces[i].payload.copy_(payloads[r][i])
                alone.decode(i, 1.0)
            sent[r] += alone.state.double() * 4.0 / weights[r]
            bound = step_bound(coders[r], payloads[r], alone.state) * 4.0 / weights[r]  # in the state's units
            assert (coders[r].error[:numel].abs() <= bound).all()
        average += sum(w * d.double() for w, d in zip(weights, deltas, strict=True)) / sum(weights)
        assert all(torch.equal(s, states[0]) for s in states)
    for r in range(ranks):
        torch.testing.assert_close(sent[r] + coders[r].error[:numel].double(), true[r], rtol=0, atol=1e-5)
    step = max(LEVELS.get(name, 1) ** -1, RELATIVE.get(name, 0.0)) * 3e-2  # a step of the largest change
    assert (states[0].double() - average).abs().max() < step


@pytest.mark.fast
@pytest.mark.parametrize("name", CODECS)
def test_how_the_buffer_is_cut_into_chunks_and_pieces_changes_no_bit(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of one block and pieces of one chunk, or one chunk for all (as on a GPU), give what
    the default cut gives, bitwise: every operation is per number or per block."""
    numel, g = 7 * BLOCK + 5, torch.Generator().manual_seed(2)
    rounds = [[torch.randn(numel, generator=g) for _ in range(2)] for _ in range(3)]

    def run() -> tuple[torch.Tensor, ...]:
        states = [torch.ones(numel) for _ in range(2)]
        coders = [DeltaCoder(name, s, 2, r) for r, s in enumerate(states)]
        for deltas in rounds:
            for s, d in zip(states, deltas, strict=True):
                s.add_(d)
            exchange(coders, [0.25, 0.75], 1.0)
        return states[0], coders[0].error, coders[1].error

    default = run()
    for chunk, piece_bytes in ((BLOCK, 1), (1 << 30, 1 << 30)):
        monkeypatch.setattr(codec_module, "CHUNK", chunk)
        monkeypatch.setattr(codec_module, "PIECE_BYTES", piece_bytes)
        assert all(torch.equal(a, b) for a, b in zip(run(), default, strict=True)), (chunk, piece_bytes)


@pytest.mark.fast
@pytest.mark.parametrize("name", CODECS)
def test_a_round_that_never_lands_resumed_from_its_start_and_unsent_error_lands_as_one_never_cut(name: str) -> None:
    """A fleet's coded round whose sends reach no one (a peer lost): with `keep`, each coder kept
    the error as the send found it, and nothing was decoded. The survivors' new coders, taking
    their change from the lost round's start with that error, each rank's own state trained on
    since, land bitwise what the round landed where nothing was lost."""
    numel, g = 3 * BLOCK + 5, torch.Generator().manual_seed(4)
    start = torch.randn(numel, generator=g)
    rounds = [[torch.randn(numel, generator=g) * 1e-2 for _ in range(2)] for _ in range(3)]  # the third: trained after the loss

    def played(cut: bool) -> list[torch.Tensor]:
        states = [start.clone() for _ in range(2)]
        coders = [DeltaCoder(name, s, 2, r, keep=True) for r, s in enumerate(states)]
        for s, d in zip(states, rounds[0], strict=True):
            s.add_(d)
        exchange(coders, [0.25, 0.75], 1.0)  # a round that lands
        for s, d in zip(states, rounds[1], strict=True):
            s.add_(d)
        if cut:  # sent, and lost before anything came back
            errors = [c.error.clone() for c in coders]
            for c in coders:
                list(c.encode(0.5))
            assert all(c.decoded == 0 and c.unsent is not None and torch.equal(c.unsent, e) for c, e in zip(coders, errors, strict=True))
            kept = [(c.start.clone(), c.unsent.clone()) for c in coders]  # type: ignore[union-attr]
            coders = [DeltaCoder(name, s, 2, r, keep=True) for r, s in enumerate(states)]  # the survivors' new group
            for c, (begun, unsent) in zip(coders, kept, strict=True):
                c.start.copy_(begun)
                c.error.copy_(unsent)
        for s, d in zip(states, rounds[2], strict=True):
            s.add_(d)
        exchange(coders, [0.25, 0.75], 1.0)
        assert all(c.decoded == c.pieces for c in coders)
        return [states[0], *(c.error for c in coders)]

    assert all(torch.equal(a, b) for a, b in zip(played(cut=True), played(cut=False), strict=True))


@pytest.mark.fast
def test_a_rank_that_sends_zeros_keeps_its_error_and_float16_clamps_to_its_range() -> None:
    state = torch.zeros(BLOCK)
    coder = DeltaCoder("int8", state)
    state.add_(torch.linspace(-1, 1, BLOCK))
    exchange([coder], [1.0], 1.0)
    error = coder.error.clone()
    state.fill_(float("nan"))  # a rank that did not train may hold anything
    ((payload,),) = exchange([coder], [0.0], 1.0)
    assert torch.equal(payload, torch.zeros_like(payload)) and torch.equal(coder.error, error)
    big = torch.zeros(4)
    wide = DeltaCoder("float16", big)
    big.copy_(torch.tensor([1e6, -1e6, 1.0, 0.0]))
    exchange([wide], [1.0], 1.0)
    assert torch.equal(big, torch.tensor([65504.0, -65504.0, 1.0, 0.0]))
    assert torch.equal(wide.error, torch.tensor([1e6 - 65504, 65504 - 1e6, 0.0, 0.0]))  # sent next round


@pytest.mark.fast
def test_the_bytes_are_a_half_a_quarter_an_eighth_plus_scales_and_trailer() -> None:
    tensors = [torch.zeros(1000, 100), torch.zeros(300), torch.zeros(7, dtype=torch.int64)]
    full = FlatAverager([t.clone() for t in tensors], CPU, trailer=5)
    assert full.nbytes == (100_300 + 5) * 4 + 7 * 8
    blocks = -(-100_300 // BLOCK)
    sparse_blocks = -(-100_300 // SPARSE_BLOCK)
    expected = {
        "bfloat16": 100_300 * 2, "float16": 100_300 * 2, "int8": blocks * (BLOCK + 4), "int4": blocks * (BLOCK // 2 + 4),
        "sparse": sparse_blocks * (3 * SPARSE_ENTRIES // 2 + SPARSE_ENTRIES // 4 + 4),  # 12-bit indices, 2-bit values, a float32 step
    }  # fmt: skip
    for name in CODECS:
        wired = FlatAverager([t.clone() for t in tensors], CPU, trailer=5, wire=name)
        # The trailer in float64; the integers, averaged in float64 and rounded back, coded in their own group.
        assert wired.nbytes == expected[name] + 5 * 8 + codec(name).nbytes(7)
        moment = torch.zeros(300)  # a second moment: in full precision beside the codes
        exact = FlatAverager([torch.zeros(1000, 100), moment, torch.zeros(7, dtype=torch.int64)], CPU, trailer=5, wire=name, exact=[moment])
        assert exact.nbytes == wired.nbytes - codec(name).nbytes(100_300) + codec(name).nbytes(100_000) + 300 * 4
    assert 127 / TINY < torch.finfo(torch.float32).max  # a block of zeros: a finite inverse scale


# -- an MLP trained with each payload, two processes ------------------------------------------------

ROUNDS, K = 12, 3


def _train(rank: int, world: int) -> dict[str, Any]:
    """Each payload trains the same MLP on the same batches: K local SGD steps, then an averaging,
    ROUNDS times (the first in full precision). The float32 run keeps its state at every round.
    And `_adam_rounds`'s, under "adamw" (one group of processes for both tests)."""
    batches = make_batches(ROUNDS * K * world)
    out: dict[str, Any] = {"adamw": _adam_rounds(rank, world)}
    for name in ("float32", *CODECS):
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for p in model.parameters():  # the momentum buffers, zero, so that they are averaged from the start
            p.grad = torch.zeros_like(p)
        optimizer.step()
        tensors = list(model.parameters()) + [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
        averager = FlatAverager(tensors, CPU, trailer=1, wire=None if name == "float32" else name)
        out[name] = _rounds(model, optimizer, averager, batches, rank, world, K, anew_first=True)
    return out


def _rounds(model: nn.Module, optimizer: torch.optim.Optimizer, averager: FlatAverager, batches: list[Any], rank: int, world: int, k: int, anew_first: bool) -> list[torch.Tensor]:
    """k local steps on this rank's share of `batches`, then an averaging (with `anew_first` the
    first in full precision), until the batches run out: the parameters after each round."""
    history = []
    for r in range(len(batches) // (k * world)):
        for j in range(k):
            x, y = batches[(r * k + j) * world + rank]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        if r == 0 and anew_first:
            averager.average(1.0 / world)
        else:
            averager.send(1.0 / world, [1.0])
            assert averager.wait() == [float(world)]
            averager.apply(1.0)
        history.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))
    return history


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    """`_train` in two processes, by rank."""
    return run_group(_train, 2, timeout=120)


def test_an_mlp_trained_with_each_payload_ends_close_to_float32(trained: list[dict[str, Any]]) -> None:
    """Every replica holds bitwise the same state after every round; and after ROUNDS rounds each
    payload's model is nearer float32's than float32's own state one round earlier: compression
    costs less than a round of progress. int4, whose step is 1/7 of a block's largest change, gets
    two. (Measured here: the gaps are 5e-4 (bfloat16), 6e-5 (float16), 0.03 (int8) and 0.11
    (int4), against 0.20 for one round of float32's progress and 0.31 for two.)"""
    results = [{k: v for k, v in rank.items() if k != "adamw"} for rank in trained]
    for name in results[0]:
        for mine, theirs in zip(results[0][name], results[1][name], strict=True):
            assert torch.equal(mine, theirs), name
    reference = results[0]["float32"]
    for name in DENSE:  # sparse sends 64 of each 4096: its rounds are another algorithm (test_sparse_*)
        apart = (reference[-1] - reference[-1 - (2 if name == "int4" else 1)]).norm()
        gap = (results[0][name][-1] - reference[-1]).norm()
        assert gap < apart, (name, gap.item(), apart.item())


def _adam_rounds(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """AdamW on the MLP, ROUNDS int8 rounds of its parameters and its state, as a round with
    `.payload_dtype("int8").average_updaters(True)` builds them: after each, the second moments
    and steps as they landed and their float32 average (each worker's halves, summed), and the
    parameters as they landed and their float32 average."""
    batches = make_batches(ROUNDS * K * world)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for p in model.parameters():  # the state, as after a first step on zero gradients
        p.grad = torch.zeros_like(p)
    optimizer.step()
    params = list(model.parameters())
    averager = FlatAverager(params + optimizer_state_tensors(optimizer), CPU, trailer=1, wire="int8", exact=exact_tensors(optimizer))
    averager.start_coding()
    out = []
    for r in range(ROUNDS):
        for j in range(K):
            x, y = batches[(r * K + j) * world + rank]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        expected = {}
        for name, tensors in (("moments", exact_tensors(optimizer)), ("params", params)):
            halves = torch.cat([t.detach().flatten() for t in tensors]) * (1.0 / world)
            dist.all_reduce(halves)
            expected[name] = halves
        averager.send(1.0 / world, [1.0])
        averager.wait()
        averager.apply(1.0)
        landed = {name: torch.cat([t.detach().flatten() for t in tensors]) for name, tensors in (("moments", exact_tensors(optimizer)), ("params", params))}
        out.append({"moments": landed["moments"], "moments_f32": expected["moments"], "params": landed["params"], "params_f32": expected["params"]})
    return out


def test_int8_rounds_send_adams_second_moments_and_steps_exactly_beside_the_codes(trained: list[dict[str, Any]]) -> None:
    """A coded change errs by up to half its block's step, so a small second moment could land
    below zero, and Adam's square root of it is NaN (2 workers, AdamW, int8 with the state: NaN
    at step 33 before they went exactly). Every round, the second moments and steps land bitwise
    at their float32 average, on both workers, while the parameters land coded: near it, not at it."""
    for mine, theirs in zip(trained[0]["adamw"], trained[1]["adamw"], strict=True):
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name
        assert torch.equal(mine["moments"], mine["moments_f32"])
        assert not torch.equal(mine["params"], mine["params_f32"])
        assert torch.allclose(mine["params"], mine["params_f32"], atol=1e-2)


@pytest.mark.fast
def test_the_state_sent_exactly_is_the_second_moments_and_steps_of_each_optimizer() -> None:
    """state.EXACT_STATE by optimizer: what goes in full precision beside a coded payload's codes."""
    expected = {
        torch.optim.SGD: set(), torch.optim.Adam: {"exp_avg_sq", "step"}, torch.optim.AdamW: {"exp_avg_sq", "step"},
        torch.optim.RMSprop: {"square_avg", "step"}, torch.optim.Adagrad: {"sum", "step"}, torch.optim.Adamax: {"exp_inf", "step"},
        torch.optim.Adadelta: {"square_avg", "acc_delta", "step"}, torch.optim.Rprop: {"step_size", "step"},
    }  # fmt: skip
    for kind, keys in expected.items():
        model = mlp()
        optimizer = kind(model.parameters(), lr=0.1, **({"momentum": 0.9} if kind is torch.optim.SGD else {}))
        nn.functional.cross_entropy(model(torch.randn(4, 10)), torch.tensor([0, 1, 2, 0])).backward()
        optimizer.step()
        exact = {id(t) for t in exact_tensors(optimizer)}
        named = {k for state in optimizer.state.values() for k, v in state.items() if isinstance(v, torch.Tensor) and id(v) in exact}
        assert named == keys, kind


# -- a fit()'s first round, through the wrapper ------------------------------------------------------


def _fits(payload: str, average_updaters: bool) -> list[torch.Tensor]:
    """Two fit() calls of one round each (2 workers, 2 dealt steps each): the weights after each."""
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.05, momentum=0.9).workers(2).threads_per_worker(1)
        .averaging_frequency(2).deterministic(True).payload_dtype(payload).average_updaters(average_updaters)
    )  # fmt: skip
    with builder.build() as w:
        out = []
        for _ in range(2):
            w.fit(make_batches(4), epochs=1)
            out.append(torch.cat([p.detach().flatten().clone() for p in w.model.parameters()]))
    return out


@pytest.mark.timeout(180)
def test_a_fits_first_round_goes_coded_where_every_worker_starts_from_the_same_state() -> None:
    """Every worker starts a fit() from the same state, so its first round's deltas can be taken
    from there: with parameters only, and once the optimizer's state exists (a second fit()),
    that round goes int8 and a fit of one round ends near, not at, float32's average. The first
    fit() that averages momentum, which the first step creates, goes in float32: bitwise float32's."""
    start = torch.cat([p.detach().flatten() for p in mlp().parameters()])
    full, coded = _fits("float32", True), _fits("int8", True)
    assert torch.equal(coded[0], full[0])
    params_full, params_coded = _fits("float32", False), _fits("int8", False)
    for mine, exact, before in ((coded[1], full[1], full[0]), (params_coded[0], params_full[0], start)):
        gap, progress = (mine - exact).norm(), (exact - before).norm()
        assert 0 < gap < progress / 20, (gap.item(), progress.item())


def _sent_unlanded(rank: int, world: int) -> dict[str, Any]:
    """An intact (a fleet's) int8 averager over an MLP's parameters: a round lands, the next is
    trained and sent; before it lands, what a survivor would resume from. Then it lands."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = FlatAverager(list(model.parameters()), CPU, trailer=1, wire="int8", intact=True)
    averager.start_coding()
    landed = _rounds(model, optimizer, averager, make_batches(2 * world), rank, world, 1, anew_first=False)[-1]
    x, y = make_batches(3 * world)[2 * world + rank]
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    before, own = averager.errors(), torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    unsent = {"untouched": averager.untouched(), "failed": averager.errors(failed=True)}  # lost as it trained: before its send
    averager.send(1.0 / world, [1.0])
    out = {"landed": landed, "own": own, "before": before, "failed": averager.errors(failed=True), "sent": averager.errors(), "untouched": averager.untouched(), "unsent": unsent}
    starts = averager.starts()
    assert starts is not None
    out["held"], out["starts"] = torch.cat([p.detach().flatten().clone() for p in model.parameters()]), [t.clone() for t in starts.tensors if t is not None]
    averager.wait()
    averager.apply(1.0)
    out["after"] = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    return out


def test_a_fleets_coded_round_sent_and_not_landed_leaves_its_state_its_error_and_start() -> None:
    """What a fleet's survivors resume a coded round from, with real gloo sends: until it lands
    (here: sent, not waited for), each worker's tensors are its own, `errors(failed=True)` gives
    the error as the send found it (the send has fed it back: `errors()` differs), and `starts()`
    the last average, the same on both ranks; so before the send (a loss seen as it trains, a
    round after one landed). Once it has landed, the tensors are the average's."""
    results = run_group(_sent_unlanded, 2, timeout=120)
    for out in results:
        assert out["untouched"] and out["unsent"]["untouched"]
        assert torch.equal(out["unsent"]["failed"].tensors[0], out["before"].tensors[0])
        assert torch.equal(out["held"], out["own"]) and not torch.equal(out["own"], out["landed"])
        (before,), (failed,), (sent,) = out["before"].tensors, out["failed"].tensors, out["sent"].tensors
        assert torch.equal(failed, before) and not torch.equal(sent, before)
        (start,) = out["starts"]
        assert torch.equal(start[: out["landed"].numel()], out["landed"])
    assert not torch.equal(results[0]["own"], results[1]["own"]) and torch.equal(results[0]["after"], results[1]["after"])


# -- through a copy on the host, as gloo's sends need for GPU tensors --------------------------------


def _via_host_rounds(rank: int, world: int) -> dict[bool, list[torch.Tensor]]:
    """int8 rounds of an MLP's parameters, sent directly and through host copies (wire.via_host
    forced, as for CUDA tensors on gloo): the parameters after each round, by whether forced."""
    from parallelwrapper import wire

    batches, out = make_batches(6 * world), {}
    for forced in (False, True):
        wire.via_host = lambda t, g, forced=forced: forced  # type: ignore[misc]
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        averager = FlatAverager(list(model.parameters()), CPU, trailer=1, wire="int8")
        averager.start_coding()
        out[forced] = _rounds(model, optimizer, averager, batches, rank, world, 1, anew_first=False)
    return out


def test_sends_through_host_copies_land_bitwise_as_direct_ones() -> None:
    """Gloo's sends and receives read and write host memory only (a CUDA tensor's failed with
    "writev: Bad address" on a GPU shared by two workers), so there they go through copies on the
    host (wire.point_to_point). Forced on the CPU, every round lands bitwise as sent directly, the
    same on both ranks."""
    results = run_group(_via_host_rounds, 2, timeout=120)
    for rank in results:
        for direct, via in zip(rank[False], rank[True], strict=True):
            assert torch.equal(direct, via)
    assert all(torch.equal(a, b) for a, b in zip(results[0][True], results[1][True], strict=True))
    assert not torch.equal(results[0][True][0], results[0][True][-1])  # it trained


# -- the error fed back goes on across fits and through a checkpoint ---------------------------------


class _Stop(RuntimeError):
    pass


def _stop_at_round_3(score: Any) -> None:
    if score.round == 3:
        raise _Stop("stopped by the test")


def _sparse(directory: Any, *listeners: Any) -> Any:
    """2 dealt workers, plain SGD, the parameters alone in sparse; checkpoints in `directory` (None: none)."""
    builder = (
        ParallelWrapper.builder(mlp()).optimizer(torch.optim.SGD, lr=0.1).workers(2).threads_per_worker(1)
        .averaging_frequency(2).deterministic(True).payload_dtype("sparse").average_updaters(False).listeners(*listeners)
    )  # fmt: skip
    return builder if directory is None else builder.checkpoint(directory, every=1)


def test_a_sparse_run_resumed_from_its_checkpoint_ends_bitwise_as_one_never_stopped(tmp_path: Any) -> None:
    """Sparse sends 64 of each 4096 numbers: most of each worker's change waits in its error. The
    checkpoint keeps every worker's error, so a run stopped at round 3 and resumed ends bitwise
    as one that never stopped (without it, the resumed workers dropped what they had yet to send).
    Plain SGD: with average_updaters(False) a checkpoint holds worker 0's optimizer state alone."""
    data = make_batches(24)
    with _sparse(tmp_path / "whole").build() as whole:
        whole.fit(data, epochs=2)
    with _sparse(tmp_path / "cut", _stop_at_round_3).build() as cut, pytest.raises(Exception, match="stopped by the test"):
        cut.fit(data, epochs=2)
    with _sparse(tmp_path / "cut").build() as resumed:
        resumed.fit(data, epochs=2, resume=tmp_path / "cut")
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("payload", ["int8", "sparse"])
def test_fit_after_fit_feeds_the_error_back_as_one_fit_does(payload: str) -> None:
    """Two fit() calls of an epoch each end bitwise as one fit() of two epochs: each worker's
    error goes on from fit to fit (it was dropped at each fit's start: 2e-4 apart with int8, 1e-2
    with sparse, on this job)."""
    data = make_batches(24)

    def builder() -> Any:
        return _sparse(None).payload_dtype(payload)

    with builder().build() as w:
        w.fit(data, epochs=2)
        one = [p.detach().clone() for p in w.model.parameters()]
    with builder().build() as w:
        w.fit(data)
        w.fit(data)
        two = [p.detach().clone() for p in w.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
