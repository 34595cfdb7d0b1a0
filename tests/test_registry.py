"""Each option is declared once (config.Config's fields, registry.option): the builder's setters,
the docs' options table and the checkpoint's fingerprint agree with the declarations, and every
row of config.CONFLICTS is refused at build() with its message. Fast tier: builds, trains nothing."""

from __future__ import annotations

import enum
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parallelwrapper import ParallelWrapper
from parallelwrapper.config import CONFLICTS, Config, GradientEncoding, Pipeline
from parallelwrapper.job import PARTS
from parallelwrapper.registry import declared
from parallelwrapper.settings import Settings

pytestmark = pytest.mark.fast

OPTIONS = list(declared(Config))
OPTIONS_MD = Path(__file__).resolve().parents[1] / "docs" / "guides" / "options.md"
# What a setter that takes more than its option needs first, to be called at all.
BATCHES = [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))]
FIRST_ARGUMENTS: dict[str, tuple[Any, ...]] = {"average_updaters": (), "checkpoint": ("ckpt",), "on_worker_failure": ("replace",), "validation": (BATCHES,), "fleet": ("tcp://127.0.0.1:29400",)}


def builder() -> Any:
    return ParallelWrapper.builder(nn.Linear(3, 2)).workers(1)


def test_every_config_field_is_a_declared_option() -> None:
    assert [d.name for d in OPTIONS] == [f for f in Config.__dataclass_fields__]
    for d in OPTIONS:
        assert d.option.help.strip() and d.option.check.problem(d.default) is None, d.name
        assert d.option.example != d.default and d.option.check.problem(d.option.example) is None or d.name == "autopilot", d.name


def test_every_setter_sets_a_declared_option_or_a_part_of_the_job() -> None:
    setters = {name for name, member in inspect.getmembers(Settings, inspect.isfunction) if not name.startswith("_")}
    declared_setters = {d.option.setter for d in OPTIONS}
    assert setters == declared_setters | set(PARTS), "a setter without a declaration, or a declaration without a setter"
    for d in OPTIONS:
        if d.option.keyword is not None:
            assert d.option.keyword in inspect.signature(getattr(Settings, d.option.setter)).parameters, d.name


@pytest.mark.parametrize("d", [d for d in OPTIONS if d.name not in ("autopilot", "gradient_encoding", "pipeline")], ids=lambda d: d.name)
def test_a_setter_given_the_example_builds_a_config_holding_it(d: Any) -> None:
    setter = getattr(builder(), d.option.setter)
    example = d.option.example
    b = setter(*FIRST_ARGUMENTS[d.option.setter], **{d.option.keyword: example}) if d.option.keyword else setter(example)
    if d.name == "devices":
        b = b.workers(2)
    got = b._options[d.name]
    assert got == example, (d.name, got)
    if d.name not in ("hierarchy", "training_mode", "validation_every", "on_worker_failure", "max_replacements", "devices", "fragments", "fleet", "fleet_processes", "fleet_rescale"):
        with b.build() as w:  # the rest need torchrun, spawned workers, two devices, a fleet's store or another option: their values are checked above
            assert getattr(w.config, d.name) == example


@pytest.mark.parametrize("conflict", CONFLICTS, ids=lambda c: "-".join(c.options))
def test_each_conflict_is_refused_at_build_with_its_message(conflict: Any) -> None:
    def fn(*args: Any) -> Any:
        return None

    b = eval("b" + conflict.example, {"b": builder(), "torch": torch, "data": BATCHES, "fn": fn})
    head = re.escape(conflict.message.split("{")[0][:60])
    with pytest.raises(ValueError, match=f"^{head}"):
        b.build()


def test_the_docs_options_table_has_each_option_with_its_default() -> None:
    rows = [line.split(" | ")[:2] for line in OPTIONS_MD.read_text().splitlines() if line.startswith("| `.")]
    calls = [(call.strip("| `"), default) for call, default in rows]
    documented = {call.split("(")[0].lstrip(".") for call, _ in calls}
    assert documented == {d.option.setter for d in OPTIONS} | set(PARTS)
    for d in OPTIONS:
        row = [(call, default) for call, default in calls if call.startswith(f".{d.option.setter}(")]
        assert row, f"no row for .{d.option.setter}(...) in {OPTIONS_MD.name}"
        if d.option.keyword is not None:
            assert any(f"{d.option.keyword}={_shown(d.default)}" in call for call, _ in row), (d.name, row)
        elif d.default is not None and d.name != "autopilot":
            cells = {default.strip("` ") for _, default in row}
            assert cells & {_shown(d.default), f"torch.{d.default}"}, (d.name, cells)


def _shown(value: Any) -> str:
    """A default as the docs' table writes it: an enum as Class.MEMBER, a string in double quotes."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def test_the_fingerprint_holds_the_declared_options_away_from_their_defaults() -> None:
    from parallelwrapper.checkpoint import fingerprint

    with builder().build() as w:
        plain = fingerprint(w.config, w._job, 1)
    with builder().deterministic(True).averaging_frequency(4).build() as w:
        changed = fingerprint(w.config, w._job, 1)
    assert {k: v for k, v in changed.items() if plain.get(k) != v} == {"deterministic": True, "averaging_frequency": 4}
    assert {d.name for d in OPTIONS if d.option.fingerprint} >= {"workers", "averaging_frequency", "training_mode", "average_updaters"}
    assert plain["workers"] == 1


def test_pw_fits_flags_for_the_builders_options_are_their_declarations() -> None:
    """Each option declared with a pw-fit flag is that flag of `pw-fit`, with its help first and
    its values; pw-fit has no other flag for a builder option under another name."""
    from parallelwrapper.app.cli import main

    params = {opt: p for p in main.params for opt in getattr(p, "opts", [])}
    parts = [*declared(Pipeline), *declared(GradientEncoding)]  # the parts of .pipeline() and .gradient_encoding()
    flagged = [d for d in [*OPTIONS, *parts] if d.option.flag is not None]
    assert {d.name for d in flagged} >= {"workers", "averaging_frequency", "training_mode", "payload_dtype", "gradient_clipping", "stages", "threshold"}
    for d in flagged:
        param = params.get(d.option.flag)
        assert param is not None, f"pw-fit has no {d.option.flag} for {d.name}"
        assert (param.help or "").startswith(d.option.help), d.name
        if d.option.check.rule is not None:  # a value its rule passes, the help naming the examples
            assert param.metavar == "[" + "|".join(str(c) for c in d.option.check.choices) + "]", d.name
        elif d.option.check.choices:
            assert list(param.type.choices) == [str(c) for c in d.option.check.choices], d.name
    renamed = {"--mode", "--clip-grad-norm", "--val-every", "--replace-workers", "--schedule"}  # one name per thing (CHANGELOG.md)
    assert not renamed & params.keys()


def test_serving_declares_its_options_as_training_does() -> None:
    """InferenceConfig's fields are registry options, each with its setter; pw-fit predict's flags
    for them are their declarations."""
    from parallelwrapper.app.cli import main
    from parallelwrapper.inference.config import InferenceConfig
    from parallelwrapper.inference.settings import InferenceSettings

    serving = list(declared(InferenceConfig))
    assert [d.name for d in serving] == list(InferenceConfig.__dataclass_fields__)
    setters = {name for name, member in inspect.getmembers(InferenceSettings, inspect.isfunction) if not name.startswith("_")}
    assert setters == {d.option.setter for d in serving}
    params = {opt: p for p in main.commands["predict"].params for opt in getattr(p, "opts", [])}
    flagged = [d for d in serving if d.option.flag is not None]
    assert {d.name for d in flagged} == {"workers", "inference_mode", "batch_limit"}
    for d in flagged:
        assert (params[d.option.flag].help or "").startswith(d.option.help), d.name
    for d in serving:
        assert d.option.check.problem(d.default) is None and d.option.check.problem(d.option.example) is None, d.name


def test_each_default_is_written_once_in_its_declaration() -> None:
    """No setter of a declared option restates its default in prose; its docstring ends with the
    declared defaults, added when settings.py loads (registry.end_with_defaults)."""
    from parallelwrapper.inference.config import INFERENCE_OPTIONS
    from parallelwrapper.inference.settings import InferenceSettings

    for setters, options in ((Settings, [d for d in OPTIONS if d.name != "autopilot"]), (InferenceSettings, list(INFERENCE_OPTIONS.values()))):
        for d in options:
            method = getattr(setters, d.option.setter)
            source = inspect.getsource(method)
            assert "Default:" not in source and "(default)" not in source, f"{setters.__name__}.{d.option.setter} writes a default again"
            assert f"{d.name}=" in (method.__doc__ or "").rsplit("Default: ", 1)[-1], d.name
