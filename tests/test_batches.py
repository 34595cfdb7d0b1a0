"""The one walker over batch structures, and what is built on it: containers keep their types
(named tuples included), tensors are found in order, moved, counted, described and copied."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import pytest
import torch

from parallelwrapper.batches import (
    DESCRIBE_MAX_CHARS,
    batch_size,
    describe,
    leaves,
    map_leaves,
    move_to,
    tensors,
    to_cpu,
)

pytestmark = pytest.mark.fast

Pair = collections.namedtuple("Pair", "a b")


class Sample(NamedTuple):
    image: Any
    label: Any


def _double(leaf: Any) -> Any:
    return leaf * 2 if isinstance(leaf, (int, torch.Tensor)) else leaf


# -- map_leaves -----------------------------------------------------------------------------------


def test_map_leaves_keeps_every_container_type() -> None:
    assert map_leaves((1, 2), _double) == (2, 4) and type(map_leaves((1, 2), _double)) is tuple
    assert map_leaves([1, 2], _double) == [2, 4] and type(map_leaves([1, 2], _double)) is list
    assert map_leaves({"a": 1}, _double) == {"a": 2} and type(map_leaves({"a": 1}, _double)) is dict

    pair = map_leaves(Pair(1, 2), _double)
    assert isinstance(pair, Pair) and pair == Pair(2, 4)
    sample = map_leaves(Sample(image=3, label=4), _double)
    assert isinstance(sample, Sample) and sample.image == 6 and sample.label == 8

    ordered = map_leaves(collections.OrderedDict([("z", 1), ("a", 2)]), _double)
    assert type(ordered) is collections.OrderedDict and list(ordered.items()) == [("z", 2), ("a", 4)]

    default = map_leaves(collections.defaultdict(list, {"k": 5}), _double)
    assert type(default) is collections.defaultdict and default.default_factory is list
    assert default["k"] == 10 and default["missing"] == []

    size = map_leaves(torch.Size([2, 3]), _double)  # a tuple subclass that is no named tuple
    assert type(size) is torch.Size and size == torch.Size([4, 6])


def test_map_leaves_rebuilds_nested_mixes_and_keeps_keys() -> None:
    batch: dict[Any, Any] = {
        0: [Pair((1, [2]), {"deep": 3})],
        ("tuple", "key"): collections.OrderedDict(x=(4,)),
    }
    out = map_leaves(batch, _double)
    assert out == {0: [Pair((2, [4]), {"deep": 6})], ("tuple", "key"): {"x": (8,)}}
    assert list(out) == [0, ("tuple", "key")]  # keys as they were, in order
    inner = out[0][0]
    assert isinstance(out[0], list) and isinstance(inner, Pair)
    assert type(inner.a) is tuple and type(inner.a[1]) is list and type(inner.b) is dict
    assert type(out[("tuple", "key")]) is collections.OrderedDict
    assert out is not batch and out[0] is not batch[0]  # containers are new
    assert batch[0][0].a == (1, [2])  # the input is untouched


def test_map_leaves_calls_fn_on_leaves_only_and_leaves_non_tensors_alone() -> None:
    seen: list[Any] = []
    marker = object()
    text, none, number, a_set = "a label", None, 2.5, {1, 2}

    def record(leaf: Any) -> Any:
        seen.append(leaf)
        return leaf

    out = map_leaves((text, [none, number], {"s": a_set, "o": marker}), record)
    assert seen == [text, none, number, a_set, marker]  # a set is a leaf, not a container
    assert out[0] is text and out[1][1] is number and out[2]["s"] is a_set and out[2]["o"] is marker
    assert map_leaves("abc", lambda leaf: leaf.upper()) == "ABC"  # a string is one leaf
    assert map_leaves((), record) == () and map_leaves({}, record) == {} and map_leaves([], record) == []


def test_leaves_and_tensors_in_order() -> None:
    x, y, z = torch.zeros(1), torch.ones(2), torch.full((3,), 7.0)
    batch = {"first": Pair(x, "a"), "second": [3, (y, None)], "third": {"z": z}}
    assert leaves(batch) == [x, "a", 3, y, None, z]
    found = tensors(batch)
    assert len(found) == 3 and all(f is t for f, t in zip(found, [x, y, z]))
    assert tensors(("no", ["tensors"])) == []
    assert len(tensors(x)) == 1 and tensors(x)[0] is x


# -- move_to --------------------------------------------------------------------------------------


def test_move_to_keeps_the_structure_and_named_tuples() -> None:
    batch = Sample(image=torch.randn(4, 3), label=[torch.arange(4), {"id": "x7", "w": torch.ones(4)}])
    moved = move_to(batch, torch.device("cpu"))
    assert isinstance(moved, Sample) and type(moved.label) is list and type(moved.label[1]) is dict
    assert moved.label[1]["id"] == "x7"
    assert moved.image.device.type == "cpu" and torch.equal(moved.image, batch.image)
    assert torch.equal(moved.label[0], batch.label[0]) and torch.equal(moved.label[1]["w"], batch.label[1]["w"])


def test_move_to_gives_new_tensors_on_the_device() -> None:
    # The meta device has no data, so the move is a real one even on a machine without GPU.
    batch = (torch.randn(4, 3), Pair(torch.arange(4), "label"))
    moved = move_to(batch, torch.device("meta"))
    assert type(moved) is tuple and isinstance(moved[1], Pair) and moved[1].b == "label"
    assert [t.device.type for t in tensors(moved)] == ["meta", "meta"]
    assert [t.shape for t in tensors(moved)] == [(4, 3), (4,)]
    assert [t.dtype for t in tensors(moved)] == [torch.float32, torch.int64]
    assert all(t.device.type == "cpu" for t in tensors(batch))  # the original stays where it was


# -- batch_size -----------------------------------------------------------------------------------


def test_batch_size_is_dim_zero_of_the_first_tensor() -> None:
    assert batch_size(torch.zeros(5, 2)) == 5
    assert batch_size((torch.zeros(128, 1, 28, 28), torch.zeros(99))) == 128  # only the first is looked at
    assert batch_size({"meta": "text", "x": [torch.zeros(7, 3)], "y": torch.zeros(2)}) == 7
    assert batch_size(Sample(image=torch.zeros(0, 3), label=torch.zeros(0))) == 0


@pytest.mark.parametrize(
    ("batch", "shown"),
    [
        (("not", "tensors"), "(str, str)"),
        ({"x": [1, 2]}, "{x: (int, int)}"),
        ((torch.tensor(3.0), torch.zeros(4)), "(float32[], float32[4])"),  # the first tensor has no dim 0
    ],
)
def test_batch_size_without_a_batch_dimension_says_what_the_batch_is(batch: Any, shown: str) -> None:
    with pytest.raises(ValueError) as error:
        batch_size(batch)
    assert str(error.value) == f"cannot count the samples of batch {shown}: it holds no tensor with a batch dimension"


# -- describe -------------------------------------------------------------------------------------


def test_describe_exact_formats() -> None:
    images, labels = torch.zeros(128, 1, 28, 28), torch.zeros(128, dtype=torch.int64)
    assert describe((images, labels)) == "(float32[128, 1, 28, 28], int64[128])"
    assert describe(("not", "tensors")) == "(str, str)"
    assert describe([images, labels]) == "(float32[128, 1, 28, 28], int64[128])"  # a list like a tuple
    assert describe({"x": torch.zeros(3), "y": torch.zeros(3, dtype=torch.int64)}) == "{x: float32[3], y: int64[3]}"
    assert describe(Pair(torch.zeros(2), "b")) == "Pair(a=float32[2], b=str)"
    assert describe(torch.tensor(1.5, dtype=torch.bfloat16)) == "bfloat16[]"
    assert describe(None) == "NoneType" and describe(()) == "()" and describe({}) == "{}"


def test_describe_nested_structures_and_never_values() -> None:
    batch = {
        "inputs": Sample(image=torch.full((2, 3), 12345.0), label=[torch.tensor([678, 901]), 4]),
        "extra": collections.OrderedDict(mask=(torch.ones(2, dtype=torch.bool),)),
    }
    text = describe(batch)
    assert text == "{inputs: Sample(image=float32[2, 3], label=(int64[2], int)), extra: {mask: (bool[2])}}"
    assert "12345" not in text and "678" not in text


def test_describe_is_capped() -> None:
    many = [torch.zeros(3)] * 10_000
    text = describe(many)
    assert len(text) == DESCRIBE_MAX_CHARS + len("...") and text.endswith("...")
    assert text.startswith("(float32[3], float32[3], ")
    short = describe([torch.zeros(3)] * 5)
    assert not short.endswith("...") and len(short) < DESCRIBE_MAX_CHARS


# -- to_cpu ---------------------------------------------------------------------------------------


def test_to_cpu_is_a_copy_even_on_the_cpu() -> None:
    state: dict[str, Any] = {"w": torch.ones(3), "nested": [torch.zeros(2)], "n": 4}
    copy = to_cpu(state)
    assert copy["n"] == 4 and copy is not state and copy["nested"] is not state["nested"]
    copy["w"].add_(5)
    copy["nested"][0].fill_(9)
    copy["nested"].append("more")
    assert torch.equal(state["w"], torch.ones(3)) and torch.equal(state["nested"][0], torch.zeros(2))
    assert len(state["nested"]) == 1
    assert copy["w"].data_ptr() != state["w"].data_ptr()


def test_to_cpu_copies_tensors_inside_tuples_and_named_tuples() -> None:
    state: dict[str, Any] = {"pair": (torch.ones(2), torch.zeros(2)), "sample": Sample(image=torch.ones(3), label=1)}
    copy = to_cpu(state)
    assert type(copy["pair"]) is tuple and isinstance(copy["sample"], Sample) and copy["sample"].label == 1
    copy["pair"][0].add_(1)
    copy["sample"].image.add_(1)
    assert torch.equal(state["pair"][0], torch.ones(2)) and torch.equal(state["sample"].image, torch.ones(3))
    assert torch.equal(copy["pair"][0], torch.full((2,), 2.0))


def test_to_cpu_detaches_tensors_that_require_grad() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    copy = to_cpu({"weight": weight, "grads": (weight * 2,)})
    for t in tensors(copy):
        assert not t.requires_grad and t.grad_fn is None and type(t) is torch.Tensor
    assert torch.equal(copy["grads"][0], torch.full((3,), 2.0))


def test_to_cpu_of_a_model_and_an_adam_state_dict() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()

    state = optimizer.state_dict()
    copy = to_cpu(state)
    assert copy["param_groups"][0]["betas"] == (0.8, 0.9) and type(copy["param_groups"][0]["betas"]) is tuple
    assert copy["param_groups"][0]["params"] == state["param_groups"][0]["params"]
    assert copy["state"].keys() == state["state"].keys()
    for index, entry in state["state"].items():
        assert entry.keys() == copy["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for name, value in entry.items():
            assert torch.equal(copy["state"][index][name], value)
            assert copy["state"][index][name].data_ptr() != value.data_ptr()
    copy["state"][0]["exp_avg"].zero_()
    assert state["state"][0]["exp_avg"].abs().sum() > 0  # the live optimizer state is untouched

    # The copy loads into a fresh optimizer and gives the same next step.
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(to_cpu(model.state_dict()))
    twin_optimizer = torch.optim.Adam(twin.parameters(), lr=0.01)
    twin_optimizer.load_state_dict(to_cpu(state))
    assert twin_optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    batch = torch.randn(4, 3)
    for m, opt in ((model, optimizer), (twin, twin_optimizer)):
        opt.zero_grad()
        m(batch).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))

    model_copy = to_cpu(model.state_dict())
    assert type(model_copy) is collections.OrderedDict and list(model_copy) == ["weight", "bias"]
