"""The GPT arena of benchmarks/slow_link.py (`--arena gpt`): a small GPT-style byte-level character
model and a corpus every machine has.

Corpus: the Python standard library's top-level .py sources (`sysconfig.get_paths()["stdlib"]`),
concatenated in sorted file-name order, the first `CORPUS_BYTES` bytes; the last `VAL_BYTES` of
that slice are the validation split, the rest is training text. Vocabulary: the 256 byte values.
The slice differs between Python versions' standard libraries, so compare figures taken on one
Python only (the results JSON records the version and the corpus's length).

Model: pre-norm decoder-only Transformer (GPT-2 shape, tied input/output embeddings, learned
positions), `forward(x)` returns logits flattened to (B * T, 256) so that `F.cross_entropy(model(x),
y)` with targets flattened to (B * T,) is the loss: every contender and the wrapper's default loss
use it unchanged. The default size (7 layers, width 256, 8 heads, context 128) has 5.6M
parameters (`parameter_count()`); `python benchmarks/gpt_arena.py` prints it and the corpus size.
"""

from __future__ import annotations

import glob
import math
import os
import sysconfig
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

CORPUS_BYTES = 4 * 2**20  # a fixed slice of a few MB
VAL_BYTES = 256 * 2**10
CONTEXT = 128
VOCAB = 256

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (B, T) int64, targets (B * T,) int64


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) as uint8 tensors of bytes."""
    stdlib = sysconfig.get_paths()["stdlib"]
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= CORPUS_BYTES:
            break
    data = data[:CORPUS_BYTES]
    t = torch.frombuffer(data, dtype=torch.uint8).clone()
    return t[:-VAL_BYTES], t[-VAL_BYTES:]


def _windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> Batch:
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    w = text[idx].long()
    return w[:, :-1], w[:, 1:].reshape(-1)


def train_batches(text: torch.Tensor, batch: int, steps: int, seed: int, context: int = CONTEXT) -> Iterator[Batch]:
    """`steps` batches of random windows, the same for every contender (one generator seeded by `seed`)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield _windows(text, torch.randint(0, len(text) - context - 1, (batch,), generator=g), context)


def val_batches(text: torch.Tensor, batch: int = 64, context: int = CONTEXT, limit: int = 16) -> list[Batch]:
    """Fixed, non-overlapping windows of the validation split (at most `limit` batches)."""
    starts = torch.arange(0, len(text) - context - 1, context)[: batch * limit]
    return [_windows(text, starts[i : i + batch], context) for i in range(0, len(starts), batch)]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, layers: int = 7, width: int = 256, heads: int = 8, context: int = CONTEXT) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if name.endswith("proj.weight") or name.endswith("mlp.2.weight") else 1))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(self.ln(self.blocks(h))).reshape(-1, VOCAB)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def val_loss(model: nn.Module, val: list[Batch]) -> float:
    """Mean per-byte cross-entropy (nats) over the validation windows."""
    was = model.training
    model.eval()
    total = sum(float(F.cross_entropy(model(x), y, reduction="sum")) for x, y in val)
    model.train(was)
    return total / sum(len(y) for _, y in val)


if __name__ == "__main__":
    train, val = corpus()
    m = CharGPT()
    print(f"corpus: {len(train)} training bytes, {len(val)} validation bytes; CharGPT: {parameter_count(m):,} parameters")
