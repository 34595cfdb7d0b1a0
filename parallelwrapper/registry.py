"""Options declared once: each option's check, help, builder setter, pw-fit flag and fingerprint.

An option is a field of a frozen dataclass (config.Config) declared with `option(...)`: its name
and type are the field's, its default the field's default, and the rest rides in the field's
metadata as an `Option`. Everything else reads the declaration: the config's validation, the
checkpoint's fingerprint, pw-fit's flags, the setters' defaults (end_with_defaults), and the
tests that hold the builder's setters and the docs' options table against it. The parts of an
option (Pipeline's, GradientEncoding's fields) and serving's options (InferenceConfig) are
declared the same way. Imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    """What a value must be: an int (`integer`; >= `minimum` unless None), a number > 0 (`positive`)
    or >= `at_least`, one of `choices`, a bool (`boolean`), an instance of `kind`, what `rule` passes (it
    says what is wrong, or None); or None where `optional`. pw-fit maps it to a click type; the
    config calls it on every value."""

    integer: bool = False
    minimum: int | None = None
    positive: bool = False
    choices: tuple[object, ...] = ()
    boolean: bool = False
    kind: type | None = None
    optional: bool = False
    at_least: float | None = None
    rule: Callable[[object], str | None] | None = None

    def problem(self, value: object) -> str | None:
        """What is wrong with `value`, as the end of "must be ...", or None when it is right."""
        if value is None:
            return None if self.optional else "set (not None)"
        if self.integer and (not isinstance(value, int) or isinstance(value, bool) or (self.minimum is not None and value < self.minimum)):
            return "an int" if self.minimum is None else f"an int >= {self.minimum}"
        if self.positive and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf):
            return "a positive number"
        if self.at_least is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not self.at_least <= value < math.inf):
            return f"a number >= {self.at_least:g}"
        if self.rule is not None:
            return self.rule(value)
        if self.choices and value not in self.choices:
            return f"one of {list(self.choices)}"
        if self.boolean and not isinstance(value, bool):
            return "True or False"
        if self.kind is not None and not isinstance(value, self.kind):
            return f"a {self.kind.__name__}"
        return None


def count(minimum: int | None = 1, *, optional: bool = False) -> Check:
    return Check(integer=True, minimum=minimum, optional=optional)


def positive(*, optional: bool = False) -> Check:
    return Check(positive=True, optional=optional)


def number(at_least: float) -> Check:
    return Check(at_least=at_least)


def choice(*choices: object) -> Check:
    return Check(choices=tuple(choices))


def ruled(rule: Callable[[object], str | None], *examples: object, optional: bool = False) -> Check:
    """A value `rule` passes: it says what is wrong with one (the end of "must be ..."), or None
    (or None where `optional`). `examples` are some right values, for pw-fit's help."""
    return Check(rule=rule, choices=examples, optional=optional)


def boolean() -> Check:
    return Check(boolean=True)


def instance(kind: type, *, optional: bool = False) -> Check:
    return Check(kind=kind, optional=optional)


@dataclass(frozen=True)
class Option:
    """One option's declaration beside its field (name, type, default).

    Args:
        help: what it does, one or two sentences; pw-fit's help for its flag.
        check: what a value must be.
        setter: the builder's method that sets it, e.g. "workers".
        keyword: the setter's keyword argument that carries it, where not its first argument
            (e.g. "every" of `.checkpoint(directory, every=50)`).
        example: a right value other than the default, for error messages and tests.
        flag: pw-fit's flag for it, or None where pw-fit has none.
        fingerprint: whether a checkpoint holds it as something a resumed run must match.
    """

    help: str
    check: Check
    setter: str
    keyword: str | None = None
    example: object = None
    flag: str | None = None
    fingerprint: bool = False

    def call(self, value: object) -> str:
        """The builder call that sets `value`, as a user would write it."""
        given = repr(value.value if hasattr(value, "value") and not isinstance(value, (int, float, str)) else value)
        return f".{self.setter}(..., {self.keyword}={given})" if self.keyword else f".{self.setter}({given})"


def option(
    default: object, help: str, check: Check, setter: str, *, keyword: str | None = None, example: object = None, flag: str | None = None, fingerprint: bool = False
) -> Any:  # a field's default stands for a value of the field's own type
    """A dataclass field that is an option: `default`, and the rest of `Option`'s arguments."""
    return dataclasses.field(default=default, metadata={"option": Option(help, check, setter, keyword, example, flag, fingerprint)})


@dataclass(frozen=True)
class Declared:
    """An option as declared: its field's name and default, and its `Option`."""

    name: str
    default: object
    option: Option

    def check(self, value: object, where: str = "") -> None:
        """A ValueError naming the option (after `where`, the option it is part of) unless its check
        takes `value`, with a right call."""
        wrong = self.option.check.problem(value)
        if wrong is not None:
            at = f"{where}: " if where else ""
            raise ValueError(f"{at}{self.name} must be {wrong}, got {value!r}; e.g. {self.option.call(self.option.example)}")


def declared(cls: type) -> Iterator[Declared]:
    """The options of a dataclass declared with `option(...)`, in their order."""
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield Declared(f.name, f.default, f.metadata["option"])


def changed(instance: object) -> dict[str, object]:
    """The options of `instance` whose values differ from their declared defaults, by name: what a
    user set, as far as a value can say (a builder started from a config counts them as set)."""
    return {d.name: getattr(instance, d.name) for d in declared(type(instance)) if getattr(instance, d.name) != d.default}


def end_with_defaults(setters: type, options: Iterable[Declared]) -> None:
    """End each setter's docstring with the defaults of `options` that it sets, as declared, so
    that a default is written once, in its declaration (help() and IDEs show it)."""
    shown: dict[str, list[str]] = {}
    for d in options:
        default = f"{type(d.default).__name__}.{d.default.name}" if isinstance(d.default, enum.Enum) else repr(d.default)
        shown.setdefault(d.option.setter, []).append(f"{d.name}={default}")
    for setter, defaults in shown.items():
        fn = getattr(setters, setter)
        fn.__doc__ = f"{(fn.__doc__ or '').rstrip()}\n\n        Default: {', '.join(defaults)}."


def validate(instance: object, where: str = "") -> None:
    """A ValueError naming the first option of `instance` whose value its check refuses (after
    `where`, for the parts of an option: "pipeline")."""
    for d in declared(type(instance)):
        d.check(getattr(instance, d.name), where)


__all__ = ["Check", "Declared", "Option", "boolean", "changed", "choice", "count", "declared", "end_with_defaults", "instance", "number", "option", "positive", "ruled", "validate"]
