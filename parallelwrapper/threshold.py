"""Threshold encoding's maths on a flat buffer (Strom, 2015; DL4J): encode, decode, the adaptive threshold, the residual.

After Strom (2015, "Scalable distributed DNN training using commodity GPU cloud computing") and
DL4J's `EncodingHandler`, `AdaptiveThresholdAlgorithm` and `ResidualClippingPostProcessor`:
vectorized torch on one worker's flat buffers; rounds/encoded.py sends the messages.

    residual   what a worker has not sent yet: each step's update (lr × gradient) is added to it
    encode     every entry with |r| >= τ goes as ±τ, and ±τ leaves the residual; the message is
               int32: ±(index + 1) per entry sent (the sign is the entry's), or, when that would
               not be shorter, a 2-bit bitmap (00 nothing, 01 +τ, 10 −τ; 16 entries a word): a
               message of bitmap_words(n) words is a bitmap, any shorter one is sparse
    decode     out += alpha · (±1 at each entry sent), in the message's order: every worker decodes
               the same messages in the same order into the same floats
    adaptive   τ moves by a factor FACTOR = 0.5^(1/20) a step at most (halved in 20 steps): down
               when fewer than min_density of the entries went, up when more than max_density
    clipping   every CLIP_EVERY steps the residual is clipped to ±residual_clip·τ

Nothing is lost but what clipping drops: what was sent plus the residual is what was added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import GradientEncoding

FACTOR = 0.5 ** (1 / 20)  # the most τ changes in a step (DL4J's decay rate)
CLIP_EVERY = 5  # steps between two clippings of the residual
MAX_ENTRIES = 2**31 - 2  # an index + 1 must fit an int32


def bitmap_words(n: int) -> int:
    """int32 words of a bitmap of n entries: 2 bits each, 16 to a word."""
    return -(-n // 16)


def is_bitmap(message: torch.Tensor, n: int) -> bool:
    """Whether a message of a buffer of n entries is a bitmap (else: ±(index + 1) entries)."""
    return n > 0 and message.numel() == bitmap_words(n)


def scratch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Working memory for `encode_` on n entries, to keep from step to step (fresh buffers cost a
    page fault per page at every step): magnitudes, and flags padded with False to whole words."""
    return torch.empty(n, device=device), torch.zeros(-(-n // 8) * 8, dtype=torch.bool, device=device)


def _above(residual: torch.Tensor, tau: float, magnitude: torch.Tensor, flags: torch.Tensor) -> torch.Tensor | None:
    """Flags in flags[:n] the entries with |r| >= τ and returns their indices (int64, ascending),
    or None when a bitmap is no longer (bitmap_words(n) entries or more). The flags are scanned 8 to
    an int64 word first: nonzero() over n / 8 words and then over the 8 flags of each word hit
    takes a quarter of the time of nonzero() over n flags at low density."""
    n = residual.numel()
    torch.ge(torch.abs(residual, out=magnitude), tau, out=flags[:n])
    hit = (flags.view(torch.int64) != 0).nonzero().squeeze(1)  # (words hit,)
    if hit.numel() >= bitmap_words(n):  # as many entries at least
        return None
    candidates = (hit.unsqueeze(1) * 8 + torch.arange(8, device=residual.device)).view(-1)  # (8 · words hit,)
    index = candidates[flags[candidates]]
    return index if index.numel() < bitmap_words(n) else None


@torch.no_grad()
def encode_(residual: torch.Tensor, tau: float, buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """The message of `residual`'s entries past τ (int32, on the residual's device), and how many
    they are; ±τ leaves each of them. `buffers`: `scratch(n)`'s, or made here."""
    n = residual.numel()
    magnitude, flags = buffers or scratch(n, residual.device)
    index = _above(residual, tau, magnitude, flags)
    if index is not None:  # sparse: ±(index + 1)
        positive = residual[index] > 0
        residual.index_add_(0, index, torch.where(positive, -tau, tau).to(residual.dtype))
        return torch.where(positive, index + 1, -(index + 1)).to(torch.int32), index.numel()
    positive = torch.logical_and(flags[:n], residual > 0)  # (n,) bool
    negative = torch.logical_xor(flags[:n], positive)
    sign = torch.sub(positive.view(torch.int8), negative.view(torch.int8))  # (n,) in {-1, 0, 1}
    residual.sub_(magnitude.copy_(sign), alpha=tau)  # a same-dtype sub: a mixed one is 8 times slower
    codes = torch.zeros(bitmap_words(n) * 16, dtype=torch.uint8, device=residual.device)
    codes[:n].copy_(positive).add_(negative.view(torch.uint8), alpha=2)
    four = codes.view(-1, 4)  # four codes to a byte, the first in the low bits
    packed = four[:, 0] | (four[:, 1] << 2) | (four[:, 2] << 4) | (four[:, 3] << 6)  # (n/4,) bytes
    return packed.view(torch.int32), int(torch.count_nonzero(flags))  # 20 times faster than flags.sum()


def sparse_entries(message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse message's entries: their indices (int64, ascending) and signs (±1, float32)."""
    return message.abs().long() - 1, message.sign().float()


@torch.no_grad()
def decode_add_(message: torch.Tensor, out: torch.Tensor, alpha: float, buffer: torch.Tensor | None = None) -> None:
    """out += alpha · (±1 at each entry of the message). `buffer`: float scratch of out's size,
    for a bitmap's signs (made here when None)."""
    n = out.numel()
    if not is_bitmap(message, n):
        index, sign = sparse_entries(message)
        out.index_add_(0, index, sign.to(out.dtype), alpha=alpha)
        return
    packed = message.view(torch.uint8)  # (words · 4,)
    codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).view(-1)[:n]  # (n,) uint8
    sign = torch.sub((codes & 1).view(torch.int8), (codes >> 1).view(torch.int8))  # 01: +1, 10: −1
    out.add_((torch.empty_like(out) if buffer is None else buffer).copy_(sign), alpha=alpha)


def next_threshold(tau: float, density: float, settings: GradientEncoding) -> float:
    """τ for the next step, given the share of entries the last one sent (NaN: nobody sent)."""
    if not settings.adaptive or math.isnan(density):
        return tau
    if density < settings.min_density:
        return tau * FACTOR
    if density > settings.max_density:
        return tau / FACTOR
    return tau


@dataclass
class Residual:
    """One worker's residual and the encoding's state every worker shares: τ and the steps taken
    (a checkpoint keeps all three, in the worker's own state)."""

    values: torch.Tensor  # (n,) float32: lr × gradient not sent yet
    threshold: float
    steps: int = 0  # encoded steps over the wrapper's life: when to clip

    @classmethod
    def zeros(cls, n: int, device: torch.device, settings: GradientEncoding) -> Residual:
        if n > MAX_ENTRIES:
            raise ValueError(
                f"gradient_encoding: the model trains {n:,} parameters, more than the {MAX_ENTRIES:,} an int32 index "
                f"reaches; train it densely (drop .gradient_encoding())"
            )
        return cls(torch.zeros(n, dtype=torch.float32, device=device), settings.threshold)

    def stepped(self, density: float, settings: GradientEncoding) -> None:
        """After a step that sent `density` of the entries: τ moves; every CLIP_EVERY steps the
        residual is clipped to ±residual_clip·τ."""
        self.threshold = next_threshold(self.threshold, density, settings)
        self.steps += 1
        if settings.residual_clip is not None and self.steps % CLIP_EVERY == 0:
            bound = settings.residual_clip * self.threshold
            self.values.clamp_(-bound, bound)

    def state_dict(self) -> dict[str, object]:
        return {"residual": self.values.cpu(), "threshold": self.threshold, "steps": self.steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        values = state["residual"]
        assert isinstance(values, torch.Tensor) and values.shape == self.values.shape, "a residual of another model"
        self.values.copy_(values)
        self.threshold, self.steps = float(state["threshold"]), int(state["steps"])  # type: ignore[arg-type, call-overload]


__all__ = ["CLIP_EVERY", "FACTOR", "Residual", "bitmap_words", "decode_add_", "encode_", "is_bitmap", "next_threshold", "scratch", "sparse_entries"]
