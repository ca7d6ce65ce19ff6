"""Typed facts: what a probe measured on one rank, as a dataclass, with the JSON on the wire unchanged.

Why a base class: facts travel as JSON (through the store, into reports and snapshots, and back
from files written by older versions), so every probe needs the same two things: a typed object
that says what its facts contain (so diagnose reads attributes, not `.get(..) or {}`), and a
reading that never loses what it does not understand. `from_json` is the one tolerant reader:

- a missing key or a null becomes the field's default (what the old `.get(key) or {}` guards
  did, once, here);
- a value of the wrong JSON kind (a number where an object belongs) becomes the default too,
  unless the class says `STRICT_KINDS = True`: then it raises `FactsError` naming the field, so
  a live run says RUN011 and `ddpdoctor diagnose` says the file cannot be judged. Each probe
  keeps the contract its judging had before the facts had types: topology and init-hang judged
  any corrupted facts without raising, homogeneity refused them;
- a key this version does not know is kept verbatim and written back;
- what was read and not changed is written back exactly as read, in the order read, so a report,
  snapshot or fixture round-trips byte for byte (each probe's tests/unit/test_*_facts.py).

A subclass is a plain `@dataclass` whose every field has a default. Field metadata says how to
read nested values: `nested(SubFacts)` for one object, `nested_list(SubFacts)` for a list,
`nested_map(SubFacts)` for a mapping of keys to objects. Anything else is kept as its JSON value
after a kind check against the default (dict, list, str, number, bool).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Optional, TypeVar

T = TypeVar("T", bound="Facts")


class FactsError(ValueError):
    """A fact of the wrong JSON kind: the facts come from another program or a damaged file."""

_NESTED = "ddpdoctor.facts.nested"


def nested(kind: type) -> dict[str, Any]:
    return {_NESTED: ("one", kind)}


def nested_list(kind: type) -> dict[str, Any]:
    return {_NESTED: ("list", kind)}


def nested_map(kind: type) -> dict[str, Any]:
    return {_NESTED: ("map", kind)}


def _kind_ok(value: Any, default: Any) -> bool:
    """Is `value` of the JSON kind the field's default says? None defaults accept anything."""
    if default is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, dict):
        return isinstance(value, dict)
    if isinstance(default, (list, tuple)):
        return isinstance(value, list)
    return True


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"facts field {f.name!r} needs a default: every key may be absent on the wire")


def _out(value: Any) -> Any:
    if isinstance(value, Facts):
        return value.to_json()
    if isinstance(value, list):
        return [_out(v) for v in value]
    if isinstance(value, tuple):
        return [_out(v) for v in value]
    if isinstance(value, dict):
        return {k: _out(v) for k, v in value.items()}
    return value


class Facts:
    """Mixin for a probe's facts dataclass: `from_json` (tolerant) and `to_json` (faithful)."""

    # Keys omitted from a freshly built object's JSON while their value is None (a key the
    # collect side only writes when it knows the value).
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()
    # A value of the wrong JSON kind raises FactsError instead of reading as the default.
    STRICT_KINDS: ClassVar[bool] = False

    # Set by from_json: the JSON as read, and each known field's value as first converted, so
    # to_json writes back what was read unless the attribute was changed since.
    _raw: Optional[Mapping[str, Any]]
    _read: dict[str, Any]

    @classmethod
    def from_json(cls: type[T], data: Any) -> T:
        if isinstance(data, cls):
            return data
        raw: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in raw:
                continue
            kwargs[f.name] = _read_field(f, raw[f.name], cls.STRICT_KINDS)
        obj = cls(**kwargs)
        object.__setattr__(obj, "_raw", raw)
        object.__setattr__(obj, "_read", dict(kwargs))
        return obj

    def to_json(self) -> dict[str, Any]:
        raw = getattr(self, "_raw", None)
        names = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
        if raw is None:
            return {n: _out(getattr(self, n)) for n in names
                    if not (n in self.OMIT_NONE and getattr(self, n) is None)}
        read = getattr(self, "_read", {})
        out: dict[str, Any] = {}
        for key, value in raw.items():
            if key in read:
                now = getattr(self, key)
                out[key] = value if now is read[key] else _out(now)
            elif key in names:  # a key read but not usable: written back unless it was set since
                now = getattr(self, key)
                default = _default(next(f for f in dataclasses.fields(self) if f.name == key))  # type: ignore[arg-type]
                out[key] = value if now == default else _out(now)
            else:
                out[key] = value  # unknown to this version: kept verbatim
        for n in names:  # set after reading, absent on the wire
            if n not in out and n not in raw:
                now = getattr(self, n)
                f = next(f for f in dataclasses.fields(self) if f.name == n)  # type: ignore[arg-type]
                if now != _default(f):
                    out[n] = _out(now)
        return out



def _read_field(f: dataclasses.Field, value: Any, strict: bool) -> Any:
    spec = f.metadata.get(_NESTED)
    default = _default(f)
    if value is None:
        return default
    if spec is not None:
        how, kind = spec
        if how == "one" and isinstance(value, Mapping):
            return kind.from_json(value)
        if how == "list" and isinstance(value, list):
            return [kind.from_json(v) for v in value]
        if how == "map" and isinstance(value, Mapping):
            return {k: kind.from_json(v) for k, v in value.items()}
        return _wrong_kind(f, value, "a list" if how == "list" else "an object", default, strict)
    if not _kind_ok(value, default):
        return _wrong_kind(f, value, type(default).__name__, default, strict)
    return value


def _wrong_kind(f: dataclasses.Field, value: Any, expected: str, default: Any, strict: bool) -> Any:
    if strict:
        raise FactsError(f"{f.name} is {type(value).__name__}, expected {expected}")
    return default


def facts_by_rank(kind: type[T], facts: Mapping[Any, Any]) -> dict[int, T]:
    """All ranks' facts as typed objects, keyed by int rank (reports key them by string)."""
    out: dict[int, T] = {}
    for rank, value in facts.items():
        try:
            r = int(rank)
        except (TypeError, ValueError):
            continue
        out[r] = kind.from_json(value)
    return out
