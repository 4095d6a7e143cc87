"""Canonical JSON for events: the value types, strict validation, freezing and encoding.

Room versions 6 and later require the strict canonical JSON of the spec's appendix:
integers in [-(2**53)+1, 2**53-1], no floats, valid UTF-8 strings. ``check_canonical``
enforces that (iteratively, with a nesting bound, so hostile input cannot exhaust the
stack); ``freeze``/``thaw`` convert between wire dicts and the immutable form events hold.
"""

# tests: tests/unit/events/test_canonical.py

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeGuard, Union

from canonicaljson import encode_canonical_json as _encode

from homeserver.events.constants import CANONICAL_INT_MAX, CANONICAL_INT_MIN
from homeserver.events.errors import InvalidEvent
from storage.kernel.json_input import JsonInputError, JsonRules, decode_json

JsonValue = Union[None, bool, int, str, Sequence["JsonValue"], Mapping[str, "JsonValue"]]
"""A JSON value as events hold it: mappings are read-only, arrays are tuples."""

JsonMapping = Mapping[str, JsonValue]
JsonDict = dict[str, Any]
"""A mutable JSON object on its way to or from the wire."""

MAX_NESTING = 128
"""Deepest object/array nesting accepted in an event (Python's JSON codec is recursive)."""


def is_int(value: object) -> TypeGuard[int]:
    """True for JSON integers (``bool`` is an ``int`` subclass in Python, but not here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_canonical(value: object, *, what: str = "event") -> None:
    """Raise ``InvalidEvent`` unless ``value`` is strictly canonical-JSON encodable.

    Walks the value without recursion: objects must have string keys, numbers must be
    integers in the canonical range, strings must encode as UTF-8 (no lone surrogates),
    and nesting may not exceed ``MAX_NESTING``.
    """
    stack: list[tuple[object, int, str]] = [(value, 0, what)]
    while stack:
        item, depth, path = stack.pop()
        if depth > MAX_NESTING:
            raise InvalidEvent(f"{path}: JSON nested deeper than {MAX_NESTING} levels")
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not CANONICAL_INT_MIN <= item <= CANONICAL_INT_MAX:
                raise InvalidEvent(
                    f"{path}: integer {item} outside the canonical JSON range "
                    f"[{CANONICAL_INT_MIN}, {CANONICAL_INT_MAX}]"
                )
        elif isinstance(item, str):
            _check_utf8(item, path)
        elif isinstance(item, Mapping):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise InvalidEvent(f"{path}: object key {key!r} is not a string")
                _check_utf8(key, path)
                stack.append((child, depth + 1, f"{path}.{key}"))
        elif isinstance(item, (list, tuple)):
            for index, child in enumerate(item):
                stack.append((child, depth + 1, f"{path}[{index}]"))
        elif isinstance(item, float):
            raise InvalidEvent(f"{path}: floats are not allowed in canonical JSON, got {item!r}")
        else:
            raise InvalidEvent(f"{path}: {type(item).__name__} is not a JSON value")


def _check_utf8(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEvent(f"{path}: string is not valid UTF-8 (lone surrogate)") from None


def freeze(value: object) -> JsonValue:
    """Deep-copy a checked JSON value into read-only mappings and tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise InvalidEvent(f"{type(value).__name__} is not a JSON value")


def thaw(value: object) -> Any:
    """Deep-copy a (possibly frozen) JSON value into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def encode_canonical(value: object) -> bytes:
    """Canonical JSON bytes of a value (frozen or not) per the spec's appendix."""
    return _encode(thaw(value))


def parse_json_object(raw: bytes | str, *, max_bytes: int, what: str = "event") -> JsonDict:
    """Parse untrusted JSON text into a dict by the strict decoder's event rules (no floats,
    canonical integers, unique keys, no lone surrogates, bounded nesting and size).

    Raises ``InvalidEvent`` (never a ``ValueError`` or ``RecursionError``) for anything that is
    not a canonical-encodable JSON object.
    """
    rules = JsonRules(max_bytes=max_bytes, max_depth=MAX_NESTING + 1, canonical=True, allow_floats=False)
    try:
        value = decode_json(raw, rules)
    except JsonInputError as e:
        raise InvalidEvent(f"{what}: {e.error}") from None
    if not isinstance(value, dict):
        raise InvalidEvent(f"{what}: expected a JSON object, got {type(value).__name__}")
    check_canonical(value, what=what)
    return value
