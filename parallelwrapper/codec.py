"""The payload codecs: a flat buffer's change since the last average, encoded with error feedback, decoded and summed.

Every rank's encoding is decoded and summed onto that average.

    bfloat16, float16   the change cast, 2 bytes a number
    int8, int4          block-quantized: a float32 scale per BLOCK numbers (absmax / 127 or / 7,
                        symmetric), then 1 byte a number, or half a byte (two codes a byte)
    sparse[:D]          the largest entries of each block of 4096 numbers (64, 1.56%, or the
                        density D's, payloads.py): their indices in the block (12 bits each, two
                        in 3 bytes), their values at 2 bits (±0.5, ±1.5 steps, a float32 step
                        per block): 116 bytes a block of 16 KiB at 64, 141.2x fewer

Error feedback: what the codes lose stays in `error` and is added to the next round's change, so
over many rounds nothing is lost in total: what was sent plus the error equals the sum of the
true changes. For the sparse codec the error holds most of each change (every entry not among a
block's largest), as in SparseLoCo (arXiv 2508.15706): an entry goes once its accumulated change
is among its block's largest. The sum after the exchange is taken in the buffer's dtype (float32), rank after
rank in rank order, so every rank computes bitwise the same average from the same bytes.

A `DeltaCoder` works on the flat buffer CHUNK numbers at a time: the chunk of the state, its
start, its error and a scratch buffer stay in cache while the codec's vectorized passes run
over them, so each number is read from memory once and written once, however many passes the
codec makes (one pass over the whole buffer per operation cost 2 to 3 times as much). A chunk
of 2^18 numbers (4 MiB for the four buffers: the L3, not a core's 2 MiB L2) makes a quarter of
2^16's calls, whose overhead dominated: with it, and the round's pre-scale carried in the int
codecs' block scales, an int8 averaging of 16.8M numbers went from 1.40x to 0.97-0.99x a float32
averaging's time on this project's 2-core CPU (benchmarks/results/averaging_cost.json). The chunks are grouped into
pieces of about PIECE_BYTES encoded bytes, handed out one by one as they are written, so that
whoever sends them may send each while the rest are encoded, and decode each as it arrives. A
piece's payload is its codes, then its scales.

This module knows nothing of collectives, processes or the protocol.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .payloads import NAMES, SPARSE_BLOCK, is_sparse, sparse_code_bytes, sparse_entries

BLOCK = 256  # numbers per scale, int8 and int4
CHUNK = 1 << 18  # numbers encoded at a time on the CPU (see above)
PIECE_BYTES = 4 << 20  # encoded bytes a piece holds, about (1 MiB to all in one: within noise on loopback)
TINY = 1e-30  # a block's absmax is at least this: a block of zeros gets a finite scale and codes 0
CODECS = tuple(name for name in NAMES if name != "float32")  # and sparse:D (payloads.py)


@dataclass
class Scratch:
    """Working memory for one chunk, shaped as its codec works on it: numbers, and one number per block."""

    numbers: torch.Tensor
    step: torch.Tensor  # (blocks, 1): a block's absmax, then its units per code
    inverse: torch.Tensor  # (blocks, 1)


class Codec:
    """Encodes a chunk of numbers into bytes, and adds what bytes decode to onto a chunk. The
    chunk, its codes and scales come shaped by `view` and `wire`, once, not at every call."""

    name: str
    bits: float  # per number, scales aside (the sparse codec's: its indices' and values' bytes over its block)
    block: int  # the numbers that share a scale (1: no scale); a chunk holds whole blocks

    def nbytes(self, numel: int) -> int:
        """The bytes of `numel` numbers' payload, a tail block padded: codes, then scales."""
        return self.code_bytes(numel) + self.scale_bytes(numel)

    def code_bytes(self, numel: int) -> int:
        """The codes' bytes of `numel` numbers, a tail block padded."""
        return int(-(-numel // self.block) * self.block * self.bits) // 8

    def scale_bytes(self, numel: int) -> int:
        return 0 if self.block == 1 else -(-numel // self.block) * 4

    def view(self, numbers: torch.Tensor) -> torch.Tensor:
        """A chunk of numbers as the codec works on them."""
        return numbers

    def wire(self, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's codes (uint8) and scales (float32) as the codec writes and reads them."""
        return codes, scales

    def encode_(self, delta: torch.Tensor, scale: float, codes: torch.Tensor, scales: torch.Tensor, scratch: Scratch) -> None:
        """Write the codes and scales of scale · delta (scale ≠ 0), and leave in `delta` what they
        lose, in delta's units."""
        raise NotImplementedError

    def decode_add_(self, codes: torch.Tensor, scales: torch.Tensor, total: torch.Tensor, alpha: float, scratch: Scratch) -> None:
        """total += alpha · decode(codes, scales)."""
        raise NotImplementedError


class Cast(Codec):
    """The numbers cast to a 16-bit float (float16: clamped to its range first, the rest carried
    by the error)."""

    bits, block = 16, 1

    def __init__(self, dtype: torch.dtype) -> None:
        self.name, self.dtype = str(dtype).removeprefix("torch."), dtype
        self.limit = torch.finfo(dtype).max if dtype == torch.float16 else None

    def wire(self, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return codes.view(self.dtype), scales

    def encode_(self, delta: torch.Tensor, scale: float, codes: torch.Tensor, scales: torch.Tensor, scratch: Scratch) -> None:
        scaled = delta if scale == 1.0 else torch.mul(delta, scale, out=scratch.numbers)
        if self.limit is not None:
            scaled = torch.clamp(scaled, -self.limit, self.limit, out=scratch.numbers)
        codes.copy_(scaled)
        delta.sub_(scratch.numbers.copy_(codes), alpha=1 / scale)

    def decode_add_(self, codes: torch.Tensor, scales: torch.Tensor, total: torch.Tensor, alpha: float, scratch: Scratch) -> None:
        total.add_(scratch.numbers.copy_(codes), alpha=alpha)  # same-dtype adds are vectorized; a mixed one is 4x slower


class Blocks(Codec):
    """Symmetric absmax quantization per block of BLOCK numbers: code = round(x / scale), scale =
    absmax / (2^(bits-1) - 1). int4 packs a block's codes i and i + 128 into byte i as the int8
    code_i + 16 · code_(i+128)."""

    block = BLOCK

    def __init__(self, bits: int) -> None:
        assert bits in (4, 8)
        self.name, self.bits, self.levels, self.code_width = f"int{bits}", bits, 2 ** (bits - 1) - 1, BLOCK * bits // 8

    def view(self, numbers: torch.Tensor) -> torch.Tensor:
        return numbers.view(-1, BLOCK)

    def wire(self, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return codes.view(torch.int8).view(-1, self.code_width), scales.view(-1, 1)

    def encode_(self, delta: torch.Tensor, scale: float, codes: torch.Tensor, scales: torch.Tensor, scratch: Scratch) -> None:
        # The codes of scale · x are x's (blocks scale alike), so only the scales carry `scale`:
        # no pass over the numbers multiplies them by it and back.
        rounded, step, inverse = scratch.numbers, scratch.step, scratch.inverse
        torch.amax(torch.abs(delta, out=rounded), dim=1, keepdim=True, out=step)
        step.clamp_min_(TINY).div_(self.levels)  # delta's units per code
        torch.reciprocal(step, out=inverse)
        torch.mul(delta, inverse, out=rounded).round_()  # |x| · levels / absmax ≤ levels: no clamp needed
        delta.addcmul_(rounded, step, value=-1)  # the error: x − code · step
        torch.mul(step, scale, out=scales)
        if self.bits == 8:
            codes.copy_(rounded)
        else:
            codes.copy_(rounded[:, : BLOCK // 2].add_(rounded[:, BLOCK // 2 :], alpha=16))  # low + 16 high, in [-119, 119]

    def decode_add_(self, codes: torch.Tensor, scales: torch.Tensor, total: torch.Tensor, alpha: float, scratch: Scratch) -> None:
        decoded = scratch.numbers
        if self.bits == 8:
            decoded.copy_(codes)
        else:  # byte = low + 16 high, |low|, |high| ≤ 7: high = round(byte / 16), as |low / 16| < 1/2
            low, high = decoded[:, : BLOCK // 2], decoded[:, BLOCK // 2 :]
            torch.mul(low.copy_(codes), 1 / 16, out=high).round_()
            low.add_(high, alpha=-16)
        total.addcmul_(decoded, scales, value=alpha)


class Sparse(Codec):
    """The largest `k` entries (by magnitude) of each block of `block` numbers: each block's codes
    are its k indices at 12 bits, a pair (a, b) in 3 bytes (a's low 8 bits; a's high 4 and b's
    low 4; b's high 8), then their values at 2 bits, four to a byte, as levels (q - 1.5) · step,
    q in 0..3, step = the block's largest sent magnitude / 1.5 (3k/2 + k/4 bytes, where int16
    indices took 2k + k/4: 1.27x fewer). Everything else stays in the error. Indices within a
    block are distinct, so decoding scatters without collisions, bitwise the same on every rank."""

    def __init__(self, name: str = "sparse") -> None:
        self.name, self.block, self.k = name, SPARSE_BLOCK, sparse_entries(name)
        self.index_bytes, self.row = 3 * self.k // 2, sparse_code_bytes(self.k)  # a block's indices, and all its codes
        self.bits = 8 * self.row / self.block

    def code_bytes(self, numel: int) -> int:
        return -(-numel // self.block) * self.row

    def view(self, numbers: torch.Tensor) -> torch.Tensor:
        return numbers.view(-1, self.block)

    def wire(self, codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return codes.view(-1, self.row), scales.view(-1, 1)

    def encode_(self, delta: torch.Tensor, scale: float, codes: torch.Tensor, scales: torch.Tensor, scratch: Scratch) -> None:
        index = torch.topk(torch.abs(delta, out=scratch.numbers), self.k, dim=1, sorted=False).indices
        chosen = delta.gather(1, index)
        step = scratch.step
        torch.amax(chosen.abs(), dim=1, keepdim=True, out=step)
        step.clamp_min_(TINY).div_(1.5)
        q = chosen.div_(step).add_(1.5).round_().clamp_(0, 3)  # the nearest of the 4 levels
        delta.scatter_add_(1, index, (q - 1.5).mul_(step).neg_())  # the error: x − (q − 1.5) · step
        torch.mul(step, scale, out=scales)
        pairs = index.to(torch.int32).view(-1, self.k // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        three = codes[:, : self.index_bytes].view(-1, self.k // 2, 3)
        three[..., 0].copy_(a & 0xFF)
        three[..., 1].copy_(a >> 8 | (b & 0xF) << 4)
        three[..., 2].copy_(b >> 4)
        packed = q.to(torch.uint8).view(-1, self.k // 4, 4)
        codes[:, self.index_bytes :].copy_(packed[..., 0] | packed[..., 1] << 2 | packed[..., 2] << 4 | packed[..., 3] << 6)

    def decode_add_(self, codes: torch.Tensor, scales: torch.Tensor, total: torch.Tensor, alpha: float, scratch: Scratch) -> None:
        three = codes[:, : self.index_bytes].view(-1, self.k // 2, 3).long()
        a = three[..., 0] | (three[..., 1] & 0xF) << 8
        b = three[..., 1] >> 4 | three[..., 2] << 4
        index = torch.stack([a, b], dim=2).view(-1, self.k)
        packed = codes[:, self.index_bytes :]
        q = torch.stack([packed & 3, packed >> 2 & 3, packed >> 4 & 3, packed >> 6], dim=2).view(-1, self.k)
        values = (q.to(total.dtype) - 1.5).mul_(scales).mul_(alpha)
        total.scatter_add_(1, index, values)


def uncoded_or(payload: str | torch.dtype | None) -> str | None:
    """A payload dtype's codec name, or None for float32 (and None): what travels uncoded."""
    name = None if payload is None else str(payload).removeprefix("torch.")
    return None if name in (None, "float32") else name


def codec(name: str | torch.dtype) -> Codec:
    """The codec of a payload dtype: "bfloat16", "float16", "int8", "int4", "sparse", "sparse:D" (or the torch dtype)."""
    name = str(name).removeprefix("torch.")
    if is_sparse(name):
        return Sparse(name)
    if name in ("bfloat16", "float16"):
        return Cast(getattr(torch, name))
    if name in ("int8", "int4"):
        return Blocks(int(name[3:]))
    raise ValueError(f"no codec {name!r}; one of {list(CODECS)}")


@dataclass
class _Chunk:
    """Views of one chunk: the state and the first as many numbers of its start and error (the
    tail chunk's state may end before a padded block), then the start, the error, this rank's
    codes and scales and every rank's, and the scratch, shaped for the codec."""

    state: torch.Tensor
    start_head: torch.Tensor
    error_head: torch.Tensor
    start: torch.Tensor
    error: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    scratch: Scratch
    received: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # every rank's codes, scales


@dataclass
class _Piece:
    payload: torch.Tensor  # this rank's bytes: the chunks' codes, then their scales
    chunks: list[_Chunk]


class DeltaCoder:
    """The change of a flat buffer since the last average, encoded piece by piece with error
    feedback, and the pieces every rank sent, summed onto that average.

    `encode(scale)` yields each piece's payload as soon as it is written; whoever sends it puts
    rank r's payload of piece i into `inbox[i][r]` (this rank's is its own); `decode(i, alpha)`
    then sets the piece's part of the start and of the state to start + alpha · Σ_r decode(rank
    r's payload), in rank order. The start is the state when the coder is built (a
    full-precision average), and the error zero.

    `keep`: encode() keeps the error as it found it (`unsent`, one copy more), which a round that
    never lands goes back to: what was sent in it reached no one.
    """

    def __init__(self, name: str | torch.dtype, state: torch.Tensor, ranks: int = 1, rank: int = 0, piece_bytes: int | None = None, keep: bool = False) -> None:
        self.codec, self.state, self.ranks, self.rank = codec(name), state, ranks, rank
        self.seconds = 0.0  # in encode() and decode() so far: the codec's compute (the autopilot's measure)
        self.decoded = 0  # pieces decoded since the last encode(): none until its round lands here
        block, numel, c = self.codec.block, state.numel(), self.codec
        padded = -(-numel // block) * block
        self.start = torch.zeros(padded, dtype=state.dtype, device=state.device)
        self.start[:numel].copy_(state)
        self.error = torch.zeros_like(self.start)
        self.unsent = torch.empty_like(self.error) if keep else None  # the error as the last encode() found it
        chunk = CHUNK if state.device.type == "cpu" else padded  # on a GPU one kernel per pass is faster
        chunk = min(padded, -(-chunk // block) * block)  # whole blocks (the sparse codec's are 4096 numbers)
        per_piece = max(chunk, (piece_bytes or PIECE_BYTES) // max(1, c.code_bytes(chunk)) * chunk)
        numbers = torch.empty(min(chunk, padded), dtype=state.dtype, device=state.device)
        per_block = torch.empty(2, max(1, chunk // max(block, BLOCK)), 1, dtype=state.dtype, device=state.device)  # step, inverse
        self.nbytes = sum(c.nbytes(min(per_piece, padded - lo)) for lo in range(0, padded, per_piece))
        payload = torch.empty(self.nbytes, dtype=torch.uint8, device=state.device)
        self._pieces, offset = [], 0
        for lo in range(0, padded, per_piece):
            hi = min(lo + per_piece, padded)
            size = c.nbytes(hi - lo)
            codes, scales = self._split(payload[offset : offset + size], hi - lo)
            chunks = []
            for a in range(lo, hi, chunk):
                b, n = min(a + chunk, hi), min(a + chunk, hi, numel) - a
                code_range = slice(c.code_bytes(a - lo), c.code_bytes(b - lo))
                scale_range = slice((a - lo) // block, (b - lo) // block) if block > 1 else slice(0, 0)
                blocks = (b - a) // max(block, BLOCK)
                work = Scratch(c.view(numbers[: b - a]), per_block[0, :blocks], per_block[1, :blocks])
                heads = state[a : a + n], self.start[a : a + n], self.error[a : a + n]
                chunks.append(_Chunk(*heads, c.view(self.start[a:b]), c.view(self.error[a:b]), *c.wire(codes[code_range], scales[scale_range]), work))
            self._pieces.append(_Piece(payload[offset : offset + size], chunks))
            offset += size
        received, offset = torch.empty((ranks - 1) * self.nbytes, dtype=torch.uint8, device=state.device), 0
        self.inbox: list[list[torch.Tensor]] = []  # per piece, per rank: where its payload is received (own: sent)
        for piece in self._pieces:
            size, numel = piece.payload.numel(), sum(ch.start.numel() for ch in piece.chunks)
            others = received[offset : offset + (ranks - 1) * size].view(ranks - 1, size)
            self.inbox.append([piece.payload if r == rank else others[r - (r > rank)] for r in range(ranks)])
            offset += (ranks - 1) * size
            rows = [self._split(row, numel) for row in self.inbox[-1]]
            codes_at, scales_at = 0, 0
            for ch in piece.chunks:  # each chunk's codes and scales in every rank's payload
                n_codes, n_scales = ch.codes.numel() * ch.codes.element_size(), ch.scales.numel()
                ch.received = [c.wire(codes[codes_at : codes_at + n_codes], scales[scales_at : scales_at + n_scales]) for codes, scales in rows]
                codes_at, scales_at = codes_at + n_codes, scales_at + n_scales

    def _split(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A piece's payload as its codes (uint8) and its scales (float32)."""
        cut = payload.numel() - self.codec.scale_bytes(numel)
        scales = payload[cut:].view(torch.float32) if cut < payload.numel() else torch.empty(0, device=payload.device)
        return payload[:cut], scales

    @property
    def pieces(self) -> int:
        return len(self._pieces)

    @torch.no_grad()
    def encode(self, scale: float) -> Iterator[torch.Tensor]:
        """Yield each piece's payload: (state − start + error) · scale, encoded; the error keeps
        what the codes lost, in the state's units. scale = 0 sends zeros and keeps the error."""
        self.decoded = 0
        if self.unsent is not None:
            self.unsent.copy_(self.error)
        for piece in self._pieces:
            if scale == 0.0:
                piece.payload.zero_()  # decodes to 0 whatever the codec (a scale of 0)
                yield piece.payload
                continue
            start = time.perf_counter()
            for c in piece.chunks:
                c.error_head.add_(c.state)  # a tail block's padding stays 0
                c.error.sub_(c.start)
                self.codec.encode_(c.error, scale, c.codes, c.scales, c.scratch)
            self.seconds += time.perf_counter() - start
            yield piece.payload

    @torch.no_grad()
    def decode(self, index: int, alpha: float) -> None:
        """Piece `index` of the start and of the state becomes start + alpha · Σ_rank decode(its
        payload), summed in rank order, after every rank's payload is in `inbox`."""
        start = time.perf_counter()
        for c in self._pieces[index].chunks:
            for codes, scales in c.received:
                self.codec.decode_add_(codes, scales, c.start, alpha, c.scratch)
            c.state.copy_(c.start_head)
        self.decoded += 1
        self.seconds += time.perf_counter() - start

    def restart(self) -> None:
        """The state is a full-precision average: the start of the next change."""
        self.start[: self.state.numel()].copy_(self.state)


__all__ = ["BLOCK", "CHUNK", "CODECS", "Blocks", "Cast", "Codec", "DeltaCoder", "Scratch", "Sparse", "codec", "uncoded_or"]
