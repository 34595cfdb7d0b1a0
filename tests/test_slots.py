"""Batches through shared-memory slots: every structure and dtype comes back equal, a dense
tensor with its strides (channels_last and the like), slots grow, are handed back, and a batch the
worker keeps is its own copy."""

from __future__ import annotations

import collections
import multiprocessing
from collections.abc import Iterator

import pytest
import torch

from parallelwrapper.feed.slots import SlotReader, SlotWriter

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


def _images(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape) * 100).to(dtype)


LAYOUTS = {
    "channels_last float32": _images(torch.float32, 4, 3, 5, 6).contiguous(memory_format=torch.channels_last),
    "channels_last float16": _images(torch.float16, 4, 3, 5, 6).contiguous(memory_format=torch.channels_last),
    "channels_last bool": (torch.randn(2, 3, 4, 4) > 0).contiguous(memory_format=torch.channels_last),
    "channels_last one channel": torch.randn(4, 1, 5, 6).contiguous(memory_format=torch.channels_last),
    "channels_last_3d bfloat16": _images(torch.bfloat16, 2, 3, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d),
    "channels_last slice of the batch": torch.randn(6, 3, 4, 4).contiguous(memory_format=torch.channels_last)[1:3],
    "transposed int64": torch.arange(12).view(3, 4).t(),
    "row-major int64": torch.arange(24).view(2, 3, 4),
    "empty channels_last": torch.zeros(0, 3, 2, 2).contiguous(memory_format=torch.channels_last),
    "scalar float16": torch.tensor(2.5, dtype=torch.float16),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_dense_tensor_arrives_with_its_strides_and_dtype(ring: tuple[SlotWriter, SlotReader], name: str) -> None:
    sent = LAYOUTS[name]
    got = roundtrip(ring, {"x": sent, "y": torch.arange(3)})
    assert isinstance(got, dict)
    x = got["x"]
    assert torch.equal(x, sent) and x.dtype == sent.dtype and x.shape == sent.shape
    assert x.stride() == sent.stride(), name
    formats = {4: [torch.channels_last], 5: [torch.channels_last_3d]}.get(x.dim(), [])
    for fmt in [torch.contiguous_format, *formats]:
        assert x.is_contiguous(memory_format=fmt) == sent.is_contiguous(memory_format=fmt), (name, fmt)
    assert x.untyped_storage().nbytes() == sent.numel() * sent.element_size()  # its own storage, no more


@pytest.mark.parametrize(
    "sent",
    [
        torch.randn(4, 6)[:, ::2],  # a strided slice: gaps between its elements
        torch.randn(3, 1).expand(3, 4),  # an expanded view: one element seen four times
        torch.randn(4, 3, 6, 6).contiguous(memory_format=torch.channels_last)[:, :, ::2],  # channels_last with gaps
    ],
    ids=["strided slice", "expanded", "channels_last with gaps"],
)
def test_a_tensor_that_is_not_dense_arrives_contiguous(ring: tuple[SlotWriter, SlotReader], sent: torch.Tensor) -> None:
    got = roundtrip(ring, (sent, "label"))
    assert isinstance(got, tuple) and got[1] == "label"
    assert torch.equal(got[0], sent) and got[0].is_contiguous() and got[0].dtype == sent.dtype


def test_a_batch_keeps_each_tensors_layout_side_by_side(ring: tuple[SlotWriter, SlotReader]) -> None:
    """Several layouts in one slot, each at its own aligned offset."""
    batch = [
        torch.tensor([True, False, True]),
        torch.randn(2, 3, 4, 4, dtype=torch.float16).contiguous(memory_format=torch.channels_last),
        torch.arange(10, dtype=torch.int64)[::3],
        torch.randn(1, 2, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d),
    ]
    got = roundtrip(ring, batch)
    assert isinstance(got, list)
    for mine, theirs in zip(got, batch, strict=True):
        assert torch.equal(mine, theirs) and mine.dtype == theirs.dtype
    assert got[1].stride() == batch[1].stride() and got[3].stride() == batch[3].stride()
    assert got[2].is_contiguous()
