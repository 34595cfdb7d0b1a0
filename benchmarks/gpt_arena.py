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
parameters (`parameter_count()`); `python -m benchmarks gpt_arena` prints it and the corpus size.
With `--des-loc 1,4,0` it races `.average_updaters(every=m)` for each m (0: never, the parameters alone) on 2 spawned workers (loopback),
with `--payloads float32-params-diloco,sparse-params-average,...` the payloads (`contender`), and tables each run's bytes sent per worker,
measured, seconds and final validation loss (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import write_results

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


def _descendants() -> set[int]:
    """This process's descendants' pids (spawned workers are the forkserver's children)."""
    parents: dict[int, int] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone since the listing
        parents[int(stat.split("/")[2])] = int(fields[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _written(pids: set[int]) -> int:
    """Bytes the processes wrote by write syscalls (/proc/PID/io wchar): a worker's gloo socket
    writes, which are nearly all it writes (its batches and state come through shared memory)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/io") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("wchar"))
        except OSError:
            continue
    return total


def race(contenders: dict[str, dict[str, object]], layers: int, width: int, context: int, steps: int, k: int, batch: int, seed: int = 0) -> list[dict[str, object]]:
    """Each contender (a name and its builder changes: `average_updaters` True, False or every=m,
    `payload_dtype`, `outer` as (lr, momentum)) trains with AdamW lr 1e-3 on 2 spawned workers,
    k local steps a round, `steps` steps a worker on the same batches (dealt:
    `.deterministic(True)`). Each run's bytes written per worker (wchar of its worker processes,
    measured), seconds and final validation loss."""
    import time

    from parallelwrapper import ParallelWrapper

    train, val_text = corpus()
    val = val_batches(val_text, 64, context, limit=8)
    data = list(train_batches(train, batch, 2 * steps, seed, context))
    rows: list[dict[str, object]] = []
    for name, change in contenders.items():
        torch.manual_seed(seed)
        model = CharGPT(layers, width, max(1, width // 32), context)
        builder = (
            ParallelWrapper.builder(model).optimizer(torch.optim.AdamW, lr=1e-3).workers(2).threads_per_worker(1)
            .averaging_frequency(k).deterministic(True).payload_dtype(str(change.get("payload_dtype", "float32")))
        )  # fmt: skip
        every = change.get("average_updaters", True)
        builder = builder.average_updaters(every=every) if isinstance(every, int) and not isinstance(every, bool) else builder.average_updaters(bool(every))
        if "outer" in change:
            lr, momentum = change["outer"]  # type: ignore[misc]
            builder = builder.outer_optimizer(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)
        before, start = _descendants(), time.perf_counter()
        with builder.build() as w:
            w.fit(data, epochs=1)
            workers = _descendants() - before
            sent = _written(workers) / 2
            rows.append({"name": name, "rounds": w.counters.rounds, "bytes_per_worker": sent, "seconds": time.perf_counter() - start,
                         "val_loss": val_loss(w.model, val), "parameters": parameter_count(model)})  # fmt: skip
    return rows


def codec_cost(payloads: Sequence[str], layers: int, width: int, context: int, k: int, batch: int, seed: int = 0, repeats: int = 5) -> list[dict[str, object]]:
    """Each payload's codec work in a round of 2 workers against the round's compute, in one
    process on one thread (as a worker runs): k AdamW steps of the arena's model, then one
    worker's side of a coded exchange of its parameters (its encode, and the decode of its own
    and the other worker's payloads), the median of `repeats` of each."""
    import statistics
    import time

    from parallelwrapper.codec import DeltaCoder

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    train, _ = corpus()
    model = CharGPT(layers, width, max(1, width // 32), context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = list(train_batches(train, batch, k * repeats, seed, context))
    rounds = []
    for r in range(repeats):
        start = time.perf_counter()
        for x, y in data[r * k : (r + 1) * k]:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        rounds.append(time.perf_counter() - start)
    compute = statistics.median(rounds)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    rows: list[dict[str, object]] = []
    for name in payloads:
        mine, other = DeltaCoder(name, flat.clone(), 2, 0), DeltaCoder(name, flat.clone(), 2, 1)
        g = torch.Generator().manual_seed(seed)
        encode, decode = [], []
        for _ in range(repeats):
            for c in (mine, other):
                c.state.add_(torch.randn(flat.numel(), generator=g) * 1e-3)  # a round's change
            before = mine.seconds  # the coder's own clock: its encode and decode passes alone
            sent = [p.clone() for p in mine.encode(0.5)]
            encode.append(mine.seconds - before)
            for i, payload in enumerate(other.encode(0.5)):
                mine.inbox[i][1].copy_(payload)
                other.inbox[i][0].copy_(sent[i])
            before = mine.seconds
            for i in range(mine.pieces):
                mine.decode(i, 1.0)
            decode.append(mine.seconds - before)
            for i in range(other.pieces):
                other.decode(i, 1.0)
        rows.append({"payload": name, "numbers": flat.numel(), "bytes": mine.nbytes, "encode_s": statistics.median(encode), "decode_s": statistics.median(decode)})
    return [{"compute_s": compute, "k": k, **row} for row in rows]


# --payloads: each contender is named PAYLOAD-STATE-ROUND: a payload dtype ("float32", "int8",
# "sparse", "sparse:0.03125", ...), "params" for the parameters alone (DiLoCo's own: each worker
# keeps its AdamW state) or "state" for the whole state, and "diloco" (the outer Nesterov SGD of
# --outer) or "average" (plain averaging, PeriodicModelAverager's rounds; sparse's error feedback
# standing in for outer momentum, as in SparseLoCo). E.g. float32-params-diloco, sparse-params-average.
ROUNDS = ("diloco", "average")
STATES = ("params", "state")


def contender(name: str, outer: tuple[float, float]) -> dict[str, object]:
    """The builder changes of a contender named PAYLOAD-STATE-ROUND (see above)."""
    payload, state, rounds = (name.rsplit("-", 2) + ["", ""])[:3]
    if state not in STATES or rounds not in ROUNDS:
        raise SystemExit(f"gpt_arena: contender {name!r} is not PAYLOAD-STATE-ROUND, STATE one of {STATES}, ROUND one of {ROUNDS}; e.g. sparse-params-average")
    change: dict[str, object] = {"payload_dtype": payload, "average_updaters": state == "state"}
    return {**change, "outer": outer} if rounds == "diloco" else change


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the arena's sizes, or race .average_updaters(every=m) for each m given (--des-loc), or payloads (--payloads).")
    parser.add_argument("--des-loc", default=None, help="comma-separated m, e.g. 1,4,0 (0: never)")
    parser.add_argument("--payloads", default=None, help="comma-separated contenders PAYLOAD-STATE-ROUND, e.g. float32-params-diloco,sparse-params-average; the first the reference")
    parser.add_argument("--codec-cost", default=None, metavar="PAYLOADS", help="comma-separated payloads, e.g. int8,sparse: each one's encode and decode in a round against k steps' compute")
    parser.add_argument("--outer", default="0.7,0.9", help="the diloco contenders' outer SGD: learning rate, Nesterov momentum (DiLoCo's: 0.7,0.9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--steps", type=int, default=256, help="steps a worker")
    parser.add_argument("--k", type=int, default=8, help="local steps a round")
    parser.add_argument("--batch", type=int, default=16, help="windows a step")
    parser.add_argument("--out", default=None, help="a race's rows and settings, as JSON (default: benchmarks/results/gpt_arena.json)")
    args = parser.parse_args(argv)
    if args.codec_cost is not None:
        cost = codec_cost(args.codec_cost.split(","), args.layers, args.width, args.context, args.k, args.batch, args.seed)
        print(f"| payload | bytes a worker a round | encode ms | decode ms (2 workers) | / {args.k} steps' compute |")
        print("| --- | --- | --- | --- | --- |")
        for r in cost:
            codec_s, compute = float(r["encode_s"]) + float(r["decode_s"]), float(r["compute_s"])  # type: ignore[arg-type]
            print(f"| {r['payload']} | {r['bytes']:,} | {float(r['encode_s']) * 1e3:.1f} | {float(r['decode_s']) * 1e3:.1f} | {codec_s / compute:.2%} |")  # type: ignore[arg-type]
        print(f"CharGPT {args.layers} layers, width {args.width}: {cost[0]['numbers']:,} parameters; {args.k} AdamW steps of {args.batch} windows on one thread: {float(cost[0]['compute_s']):.2f} s")  # type: ignore[arg-type]
        write_results(args.out or "benchmarks/results/gpt_arena_codec_cost.json", {"settings": vars(args), "python": sys.version.split()[0], "rows": cost})
        return
    if args.des_loc is None and args.payloads is None:
        train, val = corpus()
        m = CharGPT()
        print(f"corpus: {len(train)} training bytes, {len(val)} validation bytes; CharGPT: {parameter_count(m):,} parameters")
        return
    if args.des_loc is not None:
        contenders: dict[str, dict[str, object]] = {f"every={m}": {"average_updaters": int(m) or False} for m in args.des_loc.split(",")}
    else:
        lr, momentum = (float(x) for x in args.outer.split(","))
        contenders = {name: contender(name, (lr, momentum)) for name in args.payloads.split(",")}
    rows = race(contenders, args.layers, args.width, args.context, args.steps, args.k, args.batch, args.seed)
    base = rows[0]
    print("| contender | rounds | MB sent per worker | / first row's | seconds | final validation loss (nats/byte) | / first row's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        fewer, loss = float(base["bytes_per_worker"]) / float(r["bytes_per_worker"]), float(r["val_loss"]) / float(base["val_loss"])  # type: ignore[arg-type]
        print(f"| {r['name']} | {r['rounds']} | {float(r['bytes_per_worker']) / 1e6:.2f} | {fewer:.2f}x fewer | {float(r['seconds']):.1f} | {r['val_loss']:.4f} | {loss:.4f} |")  # type: ignore[arg-type]
    size = f"CharGPT {args.layers} layers, width {args.width}, context {args.context}: {base['parameters']:,} parameters"
    print(f"{size}; 2 workers, k = {args.k}, {args.steps} steps a worker of {args.batch} windows")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_results(args.out or "benchmarks/results/gpt_arena.json", {"settings": settings, "python": sys.version.split()[0], "rows": rows})


if __name__ == "__main__":
    main()
