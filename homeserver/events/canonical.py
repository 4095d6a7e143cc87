"""Canonical JSON for events: the value types, strict validation, freezing and encoding.

Room versions 6 and later require the strict canonical JSON of the spec's appendix:
integers in [-(2**53)+1, 2**53-1], no floats, valid UTF-8 strings. ``check_canonical``
enforces that (iteratively, with a nesting bound, so hostile input cannot exhaust the
stack); ``freeze``/``thaw`` convert between wire dicts and the immutable form events hold.
"""

# tests: tests/unit/events/test_canonical.py

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeGuard, Union


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


# Exact types of JSON values from the decoder or our own code: checked with ``type(x) in``,
# which is several times cheaper than ``isinstance`` against the ``Mapping`` ABC (freezing
# and thawing a big room's state is millions of such checks). Anything else takes the
# general path.
_MAPPINGS = (dict, MappingProxyType)
_ARRAYS = (list, tuple)
_SCALARS = (str, int, bool, type(None))

_PathNode = tuple[Any, str | int]
"""Where a value sits: (the parent's node or None, its key or index); spelt out only for an error."""


def _path(what: str, node: _PathNode | None) -> str:
    parts: list[str] = []
    while node is not None:
        node, part = node
        parts.append(f"[{part}]" if type(part) is int else f".{part}")
    return what + "".join(reversed(parts))


def check_canonical(value: object, *, what: str = "event") -> None:
    """Raise ``InvalidEvent`` unless ``value`` is strictly canonical-JSON encodable.

    Walks the value without recursion: objects must have string keys, numbers must be
    integers in the canonical range, strings must encode as UTF-8 (no lone surrogates),
    and nesting may not exceed ``MAX_NESTING``. A container's ASCII strings and in-range
    integers pass where they sit; every other value goes on the walk's stack.
    """
    stack: list[tuple[object, int, _PathNode | None]] = [(value, 0, None)]
    while stack:
        item, depth, node = stack.pop()
        if depth > MAX_NESTING:
            raise InvalidEvent(f"{_path(what, node)}: JSON nested deeper than {MAX_NESTING} levels")
        kind = type(item)
        if kind in _MAPPINGS or (kind not in _ARRAYS and kind not in _SCALARS and isinstance(item, Mapping)):
            for key in item:  # type: ignore[attr-defined]
                if type(key) is not str:
                    raise InvalidEvent(f"{_path(what, node)}: object key {key!r} is not a string")
                _check_utf8(key, what, node)
            children: Iterable[tuple[str | int, object]] = item.items()  # type: ignore[attr-defined]
        elif kind in _ARRAYS:
            children = enumerate(item)  # type: ignore[arg-type]
        elif kind is str:
            _check_utf8(item, what, node)  # type: ignore[arg-type]
            continue
        elif item is None or kind is bool:
            continue
        elif kind is int:
            if not CANONICAL_INT_MIN <= item <= CANONICAL_INT_MAX:  # type: ignore[operator]
                raise InvalidEvent(
                    f"{_path(what, node)}: integer {item} outside the canonical JSON range "
                    f"[{CANONICAL_INT_MIN}, {CANONICAL_INT_MAX}]"
                )
            continue
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int):
            stack.append((int(item), depth, node))
            continue
        elif isinstance(item, str):
            stack.append((str(item), depth, node))
            continue
        elif isinstance(item, (list, tuple)):
            stack.append((list(item), depth, node))
            continue
        elif isinstance(item, float):
            raise InvalidEvent(f"{_path(what, node)}: floats are not allowed in canonical JSON, got {item!r}")
        else:
            raise InvalidEvent(f"{_path(what, node)}: {type(item).__name__} is not a JSON value")
        inline = depth < MAX_NESTING  # the children's depth is still allowed
        for key_or_index, child in children:
            if inline:
                child_kind = type(child)
                if child_kind is str:
                    if child.isascii():  # type: ignore[attr-defined]
                        continue
                elif child_kind is int:
                    if CANONICAL_INT_MIN <= child <= CANONICAL_INT_MAX:  # type: ignore[operator]
                        continue
            stack.append((child, depth + 1, (node, key_or_index)))


def _check_utf8(text: str, what: str, node: _PathNode | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEvent(f"{_path(what, node)}: string is not valid UTF-8 (lone surrogate)") from None




def freeze(value: object) -> JsonValue:
    """Deep-copy a checked JSON value into read-only mappings and tuples."""
    kind = type(value)
    if kind in _SCALARS:
        return value  # type: ignore[return-value]
    if kind in _MAPPINGS:
        return MappingProxyType({k: freeze(v) for k, v in value.items()})  # type: ignore[attr-defined]
    if kind in _ARRAYS:
        return tuple([freeze(v) for v in value])  # type: ignore[attr-defined]
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise InvalidEvent(f"{type(value).__name__} is not a JSON value")


def thaw(value: object) -> Any:
    """Deep-copy a (possibly frozen) JSON value into plain dicts and lists."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind in _MAPPINGS:
        return {k: thaw(v) for k, v in value.items()}  # type: ignore[attr-defined]
    if kind in _ARRAYS:
        return [thaw(v) for v in value]  # type: ignore[attr-defined]
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def _unfreeze_one(value: object) -> object:
    """The encoder's hook for what it does not know: a frozen mapping becomes a dict (its
    children are met, and unfrozen, as the encoder walks on); tuples it encodes as arrays.
    The frozen mappings' own type is tested first: the ABC check costs several times that,
    and the encoder calls this for every frozen mapping of every event it writes."""
    if type(value) is MappingProxyType or isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not a JSON value")


# canonicaljson's encoder settings (sorted keys, compact, UTF-8, no NaN), taking frozen
# values as they are rather than after a deep copy by ``thaw``.
_CANONICAL_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), sort_keys=True, default=_unfreeze_one,
)


_COMPACT_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_unfreeze_one)


def encode_compact(value: object) -> str:
    """Compact JSON text of a value, frozen or not (as stored: keys in their own order)."""
    return _COMPACT_ENCODER.encode(value)


def encode_canonical(value: object) -> bytes:
    """Canonical JSON bytes of a value (frozen or not) per the spec's appendix."""
    return _CANONICAL_ENCODER.encode(value).encode("utf-8")


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


class EncodedJson(bytes):
    """A handler's body already encoded as JSON (a big answer assembled from stored JSON):
    sent as it is, as ``application/json``. Other ``bytes`` bodies (media) carry the
    Content-Type their handler set."""
