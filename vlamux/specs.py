"""Specs (a head's, an optimizer's, an env's, a job's) as dataclasses whose fields state their own
bounds, and the one validator that reads them.

A field declares what it takes once, where it is defined:

    width: int = bounded(128, 1, 4096)
    instruction_cond: str = bounded("add", choices=("none", "add", "adaln"))

`check(spec)`, which every spec's ``__post_init__`` calls first, is the only place those bounds are
checked, whoever builds the spec (a job spec, the API, a test, a file being loaded); `build(cls, data,
where)` makes one from plain data (JSON, YAML), checking types and unknown or missing fields. Every
refusal is a `SpecError` "<field path>: <why>", which the API answers as a 422 naming that field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import MISSING, dataclass

from vlamux.errors import InvalidInputError, VlamuxError


SEED_MAX = 2**63 - 1  # a seed is any non-negative int64


class SpecError(InvalidInputError):
    """A spec's value out of its field's bounds, of the wrong type, unknown or missing; the message
    starts with the field's path."""


@dataclass(frozen=True)
class Bound:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # (lo, hi] rather than [lo, hi]
    hi_open: bool = False
    choices: tuple | None = None
    length: tuple[int, int] | None = None  # a string's or a list's length, [lo, hi]
    each: Bound | None = None  # every item of a list

    def why(self, value, integer: bool) -> str | None:
        """What is wrong with `value` (None: nothing)."""
        if self.choices is not None:
            return None if value in self.choices else f"one of {', '.join(map(repr, self.choices))}, got {value!r}"
        if self.length is not None:
            lo, hi = self.length
            if not isinstance(value, (str, list, tuple)):
                return f"expected a string or a list, got {_short(value)}"
            if not lo <= len(value) <= hi:
                what = "characters" if isinstance(value, str) else "items"
                return f"expected {lo if lo == hi else f'{lo} to {hi}'} {what}, got {_short(value)}"
        if self.each is not None:
            for i, v in enumerate(value):
                why = self.each.why(v, integer=False)
                if why is not None:
                    return f"item {i}: {why}"
        if self.lo is None and self.hi is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            return f"expected {'an integer' if integer else 'a number'}, got {_short(value)}"
        below = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        above = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if not math.isfinite(value) or below or above:
            return f"must be {'an integer' if integer else 'a number'} in {self.interval()}, got {value!r}"
        return None

    def interval(self) -> str:
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        return f"{'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


def bounded(default=MISSING, lo: float | None = None, hi: float | None = None, *, default_factory=MISSING,
            lo_open: bool = False, hi_open: bool = False, choices: tuple | None = None,
            length: tuple[int, int] | None = None, each: Bound | None = None):
    """A dataclass field with its bounds (None stays allowed where the field's type allows it)."""
    bound = Bound(lo, hi, lo_open, hi_open, tuple(choices) if choices is not None else None, length, each)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"bound": bound})


@functools.cache
def _fields(cls) -> tuple[tuple[str, Bound, bool, bool], ...]:
    """(name, bound, integer, optional) of the bounded fields of `cls`."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        bound = f.metadata.get("bound")
        if bound is None:
            continue
        hint = hints[f.name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        out.append((f.name, bound, int in args and float not in args, type(None) in args))
    return tuple(out)


def check(spec) -> None:
    """Every bounded field of `spec` within its bounds, else SpecError naming the field."""
    for name, bound, integer, optional in _fields(type(spec)):
        value = getattr(spec, name)
        if value is None and optional:
            continue
        why = bound.why(value, integer)
        if why is not None:
            raise SpecError(f"{name}: {why}")


def build(cls, data, where: str = ""):
    """Dataclass `cls` from plain data: names, types and bounds checked, errors naming the field path."""
    if not isinstance(data, dict):
        raise SpecError(f"{where or 'spec'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise SpecError(f"{join(where, str(unknown[0]))}: unknown field; allowed: {', '.join(sorted(fields))}")
    missing = [n for n, f in fields.items() if n not in data and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        raise SpecError(f"{join(where, missing[0])}: required")
    kwargs = {name: _value(hints[name], value, join(where, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, VlamuxError) as e:
        msg = str(e)
        if where and msg.startswith(f"{where}."):  # a nested build already named the whole path
            raise SpecError(msg) from None
        head = msg.split(":", 1)[0]
        if where and head.replace("_", "").replace(".", "").replace("[", "").replace("]", "").isalnum():
            raise SpecError(f"{where}.{msg}") from None  # "field: why" -> "where.field: why"
        raise SpecError(msg if not where and ":" in msg else f"{where or 'spec'}: {msg}") from None


def join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _value(hint, value, where: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _value(options[0], value, where)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{where}: expected a number, got {_short(value)}")
        return float(value)
    checks = {int: (int, "an integer"), bool: (bool, "true or false"), str: (str, "a string"),
              list: (list, "a list"), dict: (dict, "a mapping")}
    kind = origin or hint
    if kind is tuple:
        if not isinstance(value, (list, tuple)):
            raise SpecError(f"{where}: expected a list, got {_short(value)}")
        return tuple(value)
    if kind in checks:
        typ, what = checks[kind]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise SpecError(f"{where}: expected {what}, got {_short(value)}")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
