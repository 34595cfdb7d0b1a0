"""A nanoGPT-style recipe trains through the wrapper as it would in its own loop: a small
decoder-only transformer with tied embeddings, AdamW with decay and no-decay groups, a per-step
warm-up and cosine `LambdaLR` (a `functools.partial`, as command-line values reach it), clipping,
bf16-mixed, validation every few rounds and `EarlyStopping(restore_best=True)`.

Two spawned workers, real gloo. Each worker logs the learning rate of every local step from
`before_step`: local step j of round r must run at the schedule's value at global step r·k + j
(first-come, batch i of the epoch at step i // N, whichever worker takes it)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallelwrapper import EarlyStopping, ParallelWrapper

pytestmark = pytest.mark.timeout(180)

VOCAB, CONTEXT, WIDTH = 48, 16, 32
K, ROUNDS, WORKERS, BATCH = 8, 4, 2, 4
BATCHES = WORKERS * K * ROUNDS  # N·k·m batches: exactly m rounds, whatever the feed
STEPS = BATCHES // WORKERS  # global steps: what each of N synchronous ranks would take
WARMUP, DECAY, PEAK = 6, 2 * STEPS, 3e-3  # the cosine runs past the end, so every step's lr is its own


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.register_buffer("mask", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        h = self.ln1(x)
        t = x.shape[1]
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, two blocks, a head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        self.blocks = nn.Sequential(Block(), Block())
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.tokens(idx) + self.positions[: idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"val_loss": next_token_loss(model(batch[0]), batch[1])}


def adamw_groups(model: nn.Module, weight_decay: float) -> torch.optim.Optimizer:
    """nanoGPT's groups: matrices decay, biases, norms and the positions do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2 and p is not getattr(model, "positions", None)]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=PEAK, betas=(0.9, 0.95))


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


class LrLog:
    """A before_step that appends each local step's learning rate to a file per worker."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        with open(self.directory / f"{dist.get_rank()}.txt", "a") as f:
            f.write(f"{optimizer.param_groups[0]['lr']!r}\n")

    def per_worker(self) -> list[list[float]]:
        return [[float(line) for line in log.read_text().splitlines()] for log in sorted(self.directory.glob("*.txt"))]


def corpus_windows(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of (context, next tokens) windows from a small character corpus."""
    import this  # its source is the Zen of Python, rot13-coded: a corpus every machine has

    text = "".join(chr(c) for c in range(32, 32 + VOCAB)) + this.s * 4
    data = torch.tensor([min(ord(ch) - 32, VOCAB - 1) if ord(ch) >= 32 else 0 for ch in text])
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - CONTEXT - 1, (count, BATCH), generator=g)
    windows = [torch.stack([data[s : s + CONTEXT + 1] for s in row.tolist()]) for row in starts]
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def recipe(directory: Path, deterministic: bool) -> ParallelWrapper:
    torch.manual_seed(0)
    schedule = functools.partial(warmup_cosine, warmup=WARMUP, total=DECAY)
    return (
        ParallelWrapper.builder(TinyGPT()).optimizer(functools.partial(adamw_groups, weight_decay=0.1))
        .loss_fn(next_token_loss).lr_scheduler(torch.optim.lr_scheduler.LambdaLR, interval="step", lr_lambda=schedule)
        .gradient_clipping(1.0).precision("bf16-mixed").workers(WORKERS).threads_per_worker(1).averaging_frequency(K)
        .deterministic(deterministic).feed("queue").before_step(LrLog(directory))
        .validation(corpus_windows(4, seed=9), every=1, step=token_loss)
        .listeners(EarlyStopping(monitor="val_loss", patience=ROUNDS, restore_best=True))
        .build()
    )  # fmt: skip


def reference_lrs() -> list[float]:
    """The learning rates of a one-process loop with the same optimizer and schedule, step by step."""
    model = TinyGPT()
    optimizer = adamw_groups(model, 0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_cosine, warmup=WARMUP, total=DECAY))
    lrs = []
    for _ in range(DECAY):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@torch.no_grad()
def validation_loss(model: nn.Module) -> float:
    """The returned model's val_loss over the validation batches, scored as the workers do."""
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [float(token_loss(model, batch)["val_loss"]) for batch in corpus_windows(4, seed=9)]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("deterministic", [True, False], ids=["dealt", "first-come"])
def test_a_nanogpt_recipe_trains_as_in_its_own_loop(tmp_path: Path, deterministic: bool) -> None:
    train = corpus_windows(BATCHES, seed=1)
    reference = reference_lrs()
    step_of = {lr: step for step, lr in enumerate(reference)}
    assert len(step_of) == len(reference)
    runs = 1 if deterministic else 2  # the first-come feed: the same rounds on every run
    for run in range(runs):
        log = LrLog(tmp_path / f"lr{run}")
        log.directory.mkdir()
        with recipe(log.directory, deterministic) as w:
            before = [p.detach().clone() for p in w.model.parameters()]
            history = w.fit(train)
            # Exactly m rounds of N·k batches: never a spurious short round at the end.
            assert [s.iteration for s in history.scores] == [WORKERS * K * (r + 1) for r in range(ROUNDS)]
            assert w.model.head.weight is w.model.tokens.weight  # still tied
            assert any(not torch.equal(a, b) for a, b in zip(before, w.model.parameters(), strict=True))
            # restore_best: the model holds the best validation's state, and History says which.
            best = min(history.validations, key=lambda v: v.metrics["val_loss"])
            assert history.best_round == best.round
            assert validation_loss(w.model) == pytest.approx(best.metrics["val_loss"], rel=1e-3)
            assert w.lr_scheduler.last_epoch == best.round * K  # the schedule at the best round
        lrs = log.per_worker()
        assert len(lrs) == WORKERS and sum(map(len, lrs)) == BATCHES
        if deterministic:  # k each: local step j of round r runs at r·k + j
            expected = [reference[r * K + j] for r in range(ROUNDS) for j in range(K)]
            assert lrs == [pytest.approx(expected, rel=1e-12)] * WORKERS
        else:  # first-come: batch i runs at step i // N whoever takes it: every step twice in all
            steps = [[step_of[lr] for lr in worker] for worker in lrs]
            assert all(a <= b for worker in steps for a, b in zip(worker, worker[1:]))
            assert sorted(steps[0] + steps[1]) == [s for s in range(STEPS) for _ in range(WORKERS)]


VALIDATIONS = [0]  # per process: each spawned worker scores one validation batch per validation


def best_at_the_second_validation(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    VALIDATIONS[0] += 1
    return {"val_loss": float(abs(VALIDATIONS[0] - 2))}  # 1, 0, 1, 2: the best is the second


def momentum_groups(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_restore_best_leaves_the_best_state_when_training_does_not_stop() -> None:
    """2 workers, k = 1, 8 batches: validations after rounds 1-4, the second the best; patience 5
    never stops. The fit returns model, momentum and schedule bitwise as a fit of the first two
    rounds leaves them, and History says round 2."""
    import tiny

    data = tiny.make_batches(8)

    def builder(model: nn.Module) -> Any:
        return (
            ParallelWrapper.builder(model).optimizer(momentum_groups).workers(2).threads_per_worker(1).deterministic(True)
            .lr_scheduler(torch.optim.lr_scheduler.StepLR, interval="step", step_size=1, gamma=0.5)
        )  # fmt: skip

    best = tiny.mlp()
    with builder(best).build() as w:
        w.fit(data[:4])
        best_optimizer, best_schedule = w.optimizer.state_dict(), w.lr_scheduler.state_dict()
    model = tiny.mlp()
    stopper = EarlyStopping(patience=5, restore_best=True)
    with builder(model).validation(data[:2], every=1, step=best_at_the_second_validation).listeners(stopper).build() as w:
        history = w.fit(data)
        assert [v.metrics["val_loss"] for v in history.validations] == [1.0, 0.0, 1.0, 2.0]
        assert history.best_round == 2 and stopper.stopped_round is None and w.rounds == 4
        optimizer, schedule = w.optimizer.state_dict(), w.lr_scheduler.state_dict()
    for key, value in best.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    for i, state in best_optimizer["state"].items():
        assert torch.equal(optimizer["state"][i]["momentum_buffer"], state["momentum_buffer"])
    assert schedule == best_schedule and schedule["last_epoch"] == 2
