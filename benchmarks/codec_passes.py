"""What a coded payload's passes over memory cost alone, in one process and one thread: encoding
a buffer's change (codec.DeltaCoder.encode) and decoding two ranks' payloads onto the last average
(decode), for 16.8M numbers, the parameters and momentum of averaging_cost.py's 8.4M MLP.

    python benchmarks/codec_passes.py

Set beside `averaging_cost.py`'s float32 averaging of the same state (55 ms on 2026-11-26): a coded
averaging pays these passes and sends half (bfloat16, float16), a quarter (int8) or an eighth
(int4) of float32's bytes. Medians of `--repeats` rounds, after one untimed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import table, write_results
from parallelwrapper.codec import CODECS, DeltaCoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16_800_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/codec_passes.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = torch.randn(args.numel)
    results = {}
    for name in CODECS:
        coder = DeltaCoder(name, state, ranks=2, rank=0)
        encode, decode = [], []
        for _ in range(args.repeats + 1):
            state.add_(torch.randn(args.numel), alpha=1e-3)  # a round's change
            start = time.perf_counter()
            for _ in coder.encode(1.0):
                pass
            encode.append(time.perf_counter() - start)
            for piece in coder.inbox:
                piece[1].copy_(piece[0])  # the other rank's payload: this one's, off the clock
            start = time.perf_counter()
            for i in range(coder.pieces):
                coder.decode(i, 0.5)
            decode.append(time.perf_counter() - start)
        results[name] = {"encode_ms": 1000 * statistics.median(encode[1:]), "decode_ms": 1000 * statistics.median(decode[1:])}
    print(f"{args.numel:,} numbers, one thread, medians of {args.repeats}")
    print(table(["codec", "encode ms", "decode ms (2 ranks)"], [(n, r["encode_ms"], r["decode_ms"]) for n, r in results.items()]))
    write_results(args.out, {"numel": args.numel, "repeats": args.repeats, "codecs": results})


if __name__ == "__main__":
    main()
