"""Batches through shared-memory slots: every structure and dtype comes back equal, slots grow,
are handed back, and a batch the worker keeps is its own copy."""

from __future__ import annotations

import collections
import multiprocessing
from collections.abc import Iterator

import pytest
import torch

from parallelwrapper.slots import SlotReader, SlotWriter

pytestmark = pytest.mark.fast

Pair = collections.namedtuple("Pair", "a b")


@pytest.fixture()
def ring() -> Iterator[tuple[SlotWriter, SlotReader]]:
    free = multiprocessing.get_context("spawn").Queue()
    writer, reader = SlotWriter(free, slots=2), SlotReader(free)
    yield writer, reader
    reader.close()
    writer.close()


def roundtrip(ring: tuple[SlotWriter, SlotReader], batch: object) -> object:
    writer, reader = ring
    packed = writer.pack(batch, lambda: True)
    assert packed is not None
    return reader.unpack(*packed)


def test_structures_dtypes_and_layouts_round_trip(ring: tuple[SlotWriter, SlotReader]) -> None:
    batch = {
        "x": torch.randn(3, 4),
        "t": torch.randn(4, 3).t(),  # not contiguous
        "y": (torch.arange(5), "a label", Pair(torch.zeros(0, 2), torch.tensor(3.5, dtype=torch.bfloat16))),
        "mask": [torch.tensor([True, False]), torch.tensor(7, dtype=torch.int8)],
    }
    out = roundtrip(ring, batch)
    assert isinstance(out, dict) and out.keys() == batch.keys()
    for key in ("x", "t"):
        assert torch.equal(out[key], batch[key])
    assert out["y"][1] == "a label" and isinstance(out["y"][2], Pair)
    assert torch.equal(out["y"][0], batch["y"][0]) and out["y"][2].a.shape == (0, 2)
    assert out["y"][2].b.dtype == torch.bfloat16 and float(out["y"][2].b) == 3.5
    assert torch.equal(out["mask"][0], batch["mask"][0]) and int(out["mask"][1]) == 7


def test_slots_grow_are_reused_and_copies_are_independent(ring: tuple[SlotWriter, SlotReader]) -> None:
    small = roundtrip(ring, (torch.ones(4), torch.zeros(4)))
    kept = roundtrip(ring, torch.full((10,), 3.0))
    for size in (10, 10_000, 100, 200_000):  # more batches than slots, of growing and shrinking size
        batch = torch.randn(size)
        assert torch.equal(roundtrip(ring, batch), batch)  # type: ignore[arg-type]
    assert torch.equal(kept, torch.full((10,), 3.0))  # type: ignore[arg-type]
    assert torch.equal(small[0], torch.ones(4))  # type: ignore[index]


def test_pack_gives_up_when_told_while_no_slot_is_free(ring: tuple[SlotWriter, SlotReader]) -> None:
    writer, _ = ring
    assert writer.pack(torch.ones(2), lambda: True) is not None
    assert writer.pack(torch.ones(2), lambda: True) is not None  # both slots now in flight
    asked = []
    assert writer.pack(torch.ones(2), lambda: asked.append(1) or len(asked) < 3) is None
    assert len(asked) == 3  # asked at every poll until it said no
