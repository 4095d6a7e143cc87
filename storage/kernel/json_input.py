"""The one strict JSON decoder for untrusted input: request bodies (client and federation) and PDUs.

It owns what "acceptable JSON" means at the edge: bounded size and nesting, UTF-8 text, no
``NaN``/``Infinity``, no number that overflows to infinity (``1e400``), no lone surrogate
(``"\\ud800"``), and, where canonical JSON matters (federation bodies, events), no duplicate
keys and no integer outside ``[-(2**53)+1, 2**53-1]``. Floats are a separate switch: client
bodies may hold them where the spec allows, events may not. It does not know about HTTP
requests, events or room versions; callers pick a ``JsonRules`` and turn ``JsonInputError``
(a ``MatrixError``) into whatever their layer raises. ``decode_json_entries`` is the same
decoder for a text whose listed entries (a transaction's PDUs and EDUs) are each answered on
their own: a value rule broken inside one is that entry's error, not the text's.

Error codes follow the spec's "Common error codes": ``M_NOT_JSON`` when the text is not JSON
at all (syntax, encoding, ``NaN``, nesting our parser refuses), ``M_BAD_JSON`` when it is JSON
but a value we cannot accept (overflowing or out-of-range number, lone surrogate, duplicate
key, float where none is allowed), ``M_TOO_LARGE`` (413) over the size bound.
"""

# tests: tests/unit/storage/test_json_input.py

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

import attrs

from storage.kernel.errors import MatrixError

CANONICAL_INT_MIN: Final = -(2**53) + 1
CANONICAL_INT_MAX: Final = 2**53 - 1
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


class JsonInputError(MatrixError):
    """Untrusted JSON we refuse: ``M_NOT_JSON``, ``M_BAD_JSON`` (400) or ``M_TOO_LARGE`` (413)."""


@attrs.frozen(slots=True)
class JsonRules:
    """How strict one kind of input is.

    ``canonical``: integers must lie in canonical JSON's range and object keys must be unique
    (federation bodies and events, which are signed and hashed as canonical JSON).
    ``allow_floats``: non-integer numbers are accepted (finite ones only, always).
    """

    max_bytes: int
    max_depth: int = 100
    canonical: bool = False
    allow_floats: bool = True


class _Refused(Exception):
    """Raised from inside the parser's hooks; deliberately not a ValueError, which means syntax."""

    def __init__(self, errcode: str, error: str) -> None:
        super().__init__(error)
        self.errcode = errcode
        self.error = error


def _reject_constant(name: str) -> None:
    raise _Refused("M_NOT_JSON", f"{name} is not valid JSON")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused("M_BAD_JSON", f"duplicate object key {key[:100]!r}")
            seen.add(key)
    return result


class _DuplicateKeys(dict[str, Any]):
    """An object of a leniently parsed entry (``decode_json_entries``) that repeated a key: the
    last value kept, as Python's decoder does, and the key remembered so the walk refuses it."""

    duplicate: str = ""


def _marking_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    marked = _DuplicateKeys(pairs)
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            marked.duplicate = key
            break
        seen.add(key)
    return marked


def decode_json(raw: bytes | str, rules: JsonRules) -> Any:
    """``raw`` parsed as JSON under ``rules``; raises ``JsonInputError`` and nothing else."""
    if len(raw) > rules.max_bytes:
        raise JsonInputError(413, "M_TOO_LARGE", f"JSON of {len(raw)} bytes exceeds the {rules.max_bytes}-byte bound")
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise JsonInputError(400, "M_NOT_JSON", "JSON must be UTF-8 text") from None
    else:
        text = raw
    if not text.strip():
        raise JsonInputError(400, "M_NOT_JSON", "empty body; expected JSON")

    def parse_float(number: str) -> float:
        if not rules.allow_floats:
            raise _Refused("M_BAD_JSON", f"non-integer number {number[:40]} is not allowed here")
        value = float(number)
        if not math.isfinite(value):
            raise _Refused("M_BAD_JSON", f"number {number[:40]} is out of range")
        return value

    value = _loads(text, rules, parse_float, _unique_pairs if rules.canonical else None)
    # Decoded from bytes, the text is valid UTF-8, which cannot encode a lone surrogate: one can
    # only come from a ``\\u`` escape. Most bodies have none, and then no string is looked at.
    # (A backslash alone is looked for first: found with memchr, 0.6 µs in a 30 kB body, where
    # looking for the two characters took 41 µs.)
    _check_values(value, rules, strings=not isinstance(raw, bytes) or ("\\" in text and "\\u" in text))
    return value


def _loads(text: str, rules: JsonRules, parse_float: Callable[[str], float],
           pairs: Callable[[list[tuple[str, Any]]], dict[str, Any]] | None) -> Any:
    try:
        return json.loads(text, parse_float=parse_float, parse_constant=_reject_constant, object_pairs_hook=pairs)
    except _Refused as e:
        raise JsonInputError(400, e.errcode, e.error) from None
    except RecursionError:
        raise JsonInputError(400, "M_NOT_JSON", f"JSON nested deeper than {rules.max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, and int() refusing thousands of digits
        raise JsonInputError(400, "M_NOT_JSON", f"not valid JSON: {str(e)[:200]}") from None


def _check_values(value: Any, rules: JsonRules, *, strings: bool = True, depth: int = 1) -> None:
    """Nesting depth, lone surrogates in keys and strings (``strings``: they may hold one), and
    (canonical) the integer range. The root is at ``depth`` (the whole text's root: 1) and each
    value one deeper than its container, scalars included. Walks containers only; their scalars
    are checked in place. What only a lenient parse lets through (a float that overflowed or is
    not allowed, a repeated key) is refused here too."""
    max_depth = rules.max_depth
    canonical = rules.canonical
    stack: list[tuple[Any, int]] = [([value], depth - 1)]  # the root, as the child of its container
    while stack:
        item, depth = stack.pop()
        if type(item) is dict:
            if strings:
                for key in item:
                    if _SURROGATE.search(key):
                        raise JsonInputError(400, "M_BAD_JSON", "object key holds a lone UTF-16 surrogate")
            children = item.values()
        else:
            children = item
        for child in children:
            if depth >= max_depth:
                raise JsonInputError(400, "M_NOT_JSON", f"JSON nested deeper than {max_depth} levels")
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is str:
                if strings and _SURROGATE.search(child):
                    raise JsonInputError(400, "M_BAD_JSON", "string holds a lone UTF-16 surrogate")
            elif kind is int and canonical and not CANONICAL_INT_MIN <= child <= CANONICAL_INT_MAX:
                raise JsonInputError(400, "M_BAD_JSON", f"integer {str(child)[:40]} is outside the canonical "
                                                        f"JSON range [{CANONICAL_INT_MIN}, {CANONICAL_INT_MAX}]")
            elif kind is float and not (rules.allow_floats and math.isfinite(child)):
                raise JsonInputError(400, "M_BAD_JSON", "a number overflows a double (out of range)"
                                     if rules.allow_floats else f"non-integer number {child!r} is not allowed here")
            elif kind is _DuplicateKeys:
                raise JsonInputError(400, "M_BAD_JSON", f"duplicate object key {child.duplicate[:100]!r}")


def decode_json_entries(raw: bytes, rules: JsonRules,
                        lists: Collection[str]) -> tuple[Any, Mapping[tuple[str, int], JsonInputError]]:
    """``decode_json``, except that an entry of one of the top-level object's ``lists`` (a
    transaction's ``pdus`` and ``edus``) that breaks a value rule (an integer out of range, a
    float that overflows or is not allowed, a lone surrogate, a repeated key) does not refuse
    the text: the entry is kept as Python's decoder reads it, and its error is returned under
    (list, index), for the caller to refuse that entry alone. Everything else (the text's
    syntax, size, nesting, and every value outside those entries) is held to ``rules`` as
    ``decode_json`` holds it. A text that passes ``decode_json`` is parsed once, by it."""
    try:
        return decode_json(raw, rules), {}
    except JsonInputError as e:
        if e.errcode != "M_BAD_JSON":
            raise
        refusal = e
    # Valid JSON, then (decode_json parsed it): only a value rule failed. Parsed again leniently,
    # its entries are judged one by one and the rest as a whole.
    value = _loads(raw.decode("utf-8"), rules, float, _marking_pairs)
    if type(value) is not dict or not any(type(value.get(name)) is list for name in lists):
        raise refusal
    refused: dict[tuple[str, int], JsonInputError] = {}
    for name in lists:
        entries = value.get(name)
        if type(entries) is not list:
            continue
        for index, entry in enumerate(entries):
            try:
                _check_values(entry, rules, depth=3)  # the root, its list, then the entry
            except JsonInputError as e:
                if e.errcode != "M_BAD_JSON":  # nesting: the text's own bound
                    raise
                refused[(name, index)] = e
    _check_values({k: [] if k in lists and type(v) is list else v for k, v in value.items()}, rules)
    return value, refused
