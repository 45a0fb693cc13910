"""The one codec of the control plane: message dataclasses <-> msgpack-friendly plain data.

    to_wire(Submit(rid="r1", prompt_ids=[1, 2], ...))   -> {"rid": "r1", "prompt_ids": [1, 2], ...}
    from_wire(Submit, {"rid": "r1", ...})                -> Submit(...), checked against its type hints

A dataclass travels as a map of its fields (nested dataclasses, lists, tuples, dicts, Optional and unions of
plain types inside); a field missing from the map takes its default. Anything that does not match the hints
(a missing required field, an unknown field, a string where an int belongs) raises MessageError naming the
message, the field path, the value and the expected type, so a malformed or forged message is refused before
any handler sees it. Every float must be finite (NaN and infinities are refused everywhere), every int fit in 64
bits, and a field declared with `field(metadata=bounds(lo, hi))` (`bounds(lo, hi, each=True)` for a list of numbers)
must lie in [lo, hi]. A dataclass with a `wire_variant(data) -> subclass` classmethod is a tagged family: its map
decodes as the subclass that names (Health: by "role"). Imports only the standard library and
dsakv.disagg.protocol.errors.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from typing import Any, TypeVar, Union, cast, get_args, get_origin

from dsakv.disagg.protocol.errors import MessageError

T = TypeVar("T")
INT_MIN, INT_MAX = -(2**63), 2**64 - 1


def bounds(lo: float, hi: float, *, each: bool = False) -> dict[str, Any]:
    """Field metadata: the value (or, with each=True, every item of its list) must lie in [lo, hi] on arrival;
    None passes (an Optional field's absence). `x: float = field(metadata=bounds(0.0, 60.0))`."""
    return {"range": (lo, hi, each)}


def _check_range(where: str, value: Any, lo: float, hi: float, each: bool) -> None:
    items = value if each and isinstance(value, (list, tuple)) else [value]
    for i, v in enumerate(items):
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not lo <= v <= hi:
            at = f"{where}[{i}]" if each else where
            raise MessageError(f"{at}: {v!r} is out of range: it must be within [{lo:g}, {hi:g}]")


def to_wire(obj: Any) -> Any:
    """Plain data (dict / list / str / int / float / bool / bytes / None) for a message or a field value."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_wire(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fail(where: str, value: Any, expected: str) -> MessageError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return MessageError(f"{where}: got {shown} ({type(value).__name__}), expected {expected}")


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_wire(tp: type[T], data: Any, where: str | None = None) -> T:
    """`data` checked and converted to `tp` (a message dataclass, or a plain type such as bool or list[int])."""
    return cast(T, _decode(tp, data, where or _name(tp)))


def _decode(tp: Any, data: Any, where: str) -> Any:
    if tp is Any:
        return data
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if data is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _decode(a, data, where)
            except MessageError as e:
                errors.append(e)
        raise _fail(where, data, " or ".join(_name(a) for a in args))
    if origin is list or origin is tuple:
        if not isinstance(data, (list, tuple)):
            raise _fail(where, data, _name(tp))
        args = get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(data):
                raise _fail(where, data, f"{len(args)} items")
            return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
        item = args[0] if args else Any
        out = [_decode(item, v, f"{where}[{i}]") for i, v in enumerate(data)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(data, dict):
            raise _fail(where, data, _name(tp))
        kt, vt = get_args(tp) or (Any, Any)
        return {_decode(kt, k, f"{where} key"): _decode(vt, v, f"{where}[{k!r}]") for k, v in data.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, data, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise _fail(where, data, f"one of {[m.value for m in tp]}") from None
    if tp is bool:
        if not isinstance(data, bool):
            raise _fail(where, data, "bool")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise _fail(where, data, "int")
        if not INT_MIN <= data <= INT_MAX:
            raise _fail(where, data, "a 64-bit int")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise _fail(where, data, "float")
        if isinstance(data, int) and not INT_MIN <= data <= INT_MAX:
            raise _fail(where, data, "a finite float")
        if not math.isfinite(data):
            raise _fail(where, data, "a finite float (NaN and infinities are refused)")
        return float(data)
    if tp is str or tp is bytes:
        if not isinstance(data, tp):
            raise _fail(where, data, tp.__name__)
        return data
    if tp is type(None):
        if data is not None:
            raise _fail(where, data, "None")
        return None
    raise MessageError(f"{where}: the codec cannot decode type {tp!r}")


def _decode_dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise _fail(where, data, f"a {cls.__name__} map")
    variant = getattr(cls, "wire_variant", None)
    if variant is not None:  # a tagged family (Health): the subclass the map's tag names
        try:
            sub = variant(data)
        except MessageError as e:
            raise MessageError(f"{where}.{e}") from None
        if not issubclass(sub, cls):
            raise MessageError(f"{where}: a {sub.__name__} map where a {cls.__name__} belongs")
        cls = sub
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise MessageError(f"{where}: unknown field(s) {unknown}; a {cls.__name__} has {sorted(fields)}")
    kw: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            kw[name] = _decode(hints[name], data[name], f"{where}.{name}")
            rng = f.metadata.get("range")
            if rng is not None:
                _check_range(f"{where}.{name}", kw[name], *rng)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MessageError(f"{where}: required field {name!r} is missing")
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:  # __post_init__ validation
        raise MessageError(f"{where}: {e}") from None


__all__ = ["MessageError", "bounds", "from_wire", "to_wire"]
