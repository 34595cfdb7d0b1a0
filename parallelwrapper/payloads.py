"""Payload names: what an averaging round may send, and what each costs in bits a number.

    float32             the state itself (no codec)
    bfloat16, float16   the change since the last average, cast
    int8, int4          the change block-quantized
    sparse              the largest 1.56% of each block of the change (64 of 4096)
    sparse:D            the same at density D, a fraction in (0, 0.25]: D · 4096 entries a block,
                        rounded to a multiple of 16 (sparse:0.03125 sends 128 of each 4096)

A name is the whole of a payload's wire format: the config, the autopilot's choices, a round's
score and a checkpoint's error feedback all carry it as it is, and codec.py builds its codec from
it. Imports nothing of the package, and not torch.
"""

from __future__ import annotations

NAMES = ("float32", "bfloat16", "float16", "int8", "int4", "sparse")  # sparse:D besides (above)
SPARSE_BLOCK = 4096  # numbers a sparse block holds (an index fits 12 bits)
SPARSE_ENTRIES = 64  # entries "sparse" sends of each block: 1.56%, as SparseLoCo's 1-3%
MAX_DENSITY = 0.25  # at it sparse sends 3.5 bits a number, near int4's 4.125 with its scales: denser, code it all
FORMS = "float32, bfloat16, float16, int8, int4, sparse or sparse:D (D a density in (0, 0.25], e.g. sparse:0.03125)"


def problem(name: object) -> str | None:
    """What is wrong with a payload name, as the end of "must be ...", or None when it is right."""
    if name in NAMES:
        return None
    density = name.removeprefix("sparse:") if isinstance(name, str) and name.startswith("sparse:") else None
    try:
        ok = density is not None and 0 < float(density) <= MAX_DENSITY
    except ValueError:
        ok = False
    return None if ok else f"one of {FORMS}"


def is_sparse(name: str) -> bool:
    return name == "sparse" or name.startswith("sparse:")


def sparse_entries(name: str) -> int:
    """The entries a sparse payload sends of each block: its density's share of SPARSE_BLOCK, a
    multiple of 16, at least 16. Then a block's codes (two 12-bit indices in 3 bytes, four 2-bit
    values in one: 28 bytes a 16 entries) end on a 4-byte boundary, where the float32 steps that
    follow a piece's codes must start (88 entries, 154 bytes a block, failed to view them)."""
    if name == "sparse":
        return SPARSE_ENTRIES
    exact = float(name.removeprefix("sparse:")) * SPARSE_BLOCK
    return max(16, round(exact / 16) * 16)


def sparse_name(density: float) -> str:
    """The payload name of a sparse payload at `density` ("sparse" at the default's)."""
    name = f"sparse:{density:g}"
    if problem(name) is not None:
        raise ValueError(f"payload_dtype('sparse', density={density!r}): the density must be a number in (0, {MAX_DENSITY:g}], e.g. density=0.03125")
    return "sparse" if sparse_entries(name) == SPARSE_ENTRIES else name


def sparse_code_bytes(entries: int) -> int:
    """A sparse block's codes: its indices at 12 bits (two in 3 bytes), its values at 2 (four a byte)."""
    return 3 * entries // 2 + entries // 4


def sparse_block_bytes(entries: int) -> int:
    """A sparse block's bytes: its codes, and a float32 step."""
    return sparse_code_bytes(entries) + 4


def bits(name: str) -> float:
    """Bits a number on the wire: a cast's or a code's, scales aside (int8 8, int4 4); a sparse
    payload's, its block's every byte over the block's numbers (0.2265625 for "sparse": 116 bytes
    where float32 sends 16,384)."""
    if is_sparse(name):
        return 8 * sparse_block_bytes(sparse_entries(name)) / SPARSE_BLOCK
    return {"float32": 32, "bfloat16": 16, "float16": 16, "int8": 8, "int4": 4}[name]


__all__ = ["FORMS", "MAX_DENSITY", "NAMES", "SPARSE_BLOCK", "SPARSE_ENTRIES", "bits", "is_sparse", "problem", "sparse_block_bytes", "sparse_code_bytes", "sparse_entries", "sparse_name"]
