import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from homeserver.events import InvalidEvent, encode_canonical
from homeserver.events.canonical import MAX_NESTING, check_canonical, freeze, parse_json_object, thaw

# The appendix's canonical JSON examples.
EXAMPLES = [
    ({}, b"{}"),
    ({"one": 1, "two": "Two"}, b'{"one":1,"two":"Two"}'),
    ({"b": "2", "a": "1"}, b'{"a":"1","b":"2"}'),
    (
        {"auth": {"success": True, "mxid": "@john.doe:example.com", "profile": {"display_name": "John Doe",
         "three_pids": [{"medium": "email", "address": "john.doe@example.org"},
                        {"medium": "msisdn", "address": "123456789"}]}}},
        b'{"auth":{"mxid":"@john.doe:example.com","profile":{"display_name":"John Doe","three_pids":'
        b'[{"address":"john.doe@example.org","medium":"email"},{"address":"123456789","medium":"msisdn"}]},"success":true}}',
    ),
    ({"a": "日本語"}, '{"a":"日本語"}'.encode()),
    ({"本": 2, "日": 1}, '{"日":1,"本":2}'.encode()),
    ({"a": "\u65E5"}, '{"a":"日"}'.encode()),
    ({"a": None}, b'{"a":null}'),
]


@pytest.mark.parametrize(("value", "expected"), EXAMPLES)
def test_appendix_examples(value: object, expected: bytes) -> None:
    assert encode_canonical(value) == expected
    assert encode_canonical(freeze(value)) == expected


def test_frozen_values_round_trip_through_thaw() -> None:
    value = {"a": [1, {"b": [True, None, "x"]}]}
    frozen = freeze(value)
    assert thaw(frozen) == value
    with pytest.raises(TypeError):
        frozen["a"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    "bad",
    [{"f": 1.5}, {"big": 2**53}, {"small": -(2**53)}, {"s": "\ud800"}, {1: "x"}, {"set": {1}}],
)
def test_non_canonical_values_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidEvent):
        check_canonical(bad)


def test_nesting_is_bounded_without_recursion() -> None:
    deep: object = "x"
    for _ in range(MAX_NESTING + 5):
        deep = [deep]
    with pytest.raises(InvalidEvent, match="nested"):
        check_canonical({"d": deep})


@pytest.mark.parametrize(
    "raw",
    [b'{"a": 1.0}', b'{"a": NaN}', b'{"a": 1e3}', b"[1]", b"{", b"\xff", b"[" * 100_000, b'{"a":"\\ud800"}'],
)
def test_parse_json_object_only_raises_invalid_event(raw: bytes) -> None:
    with pytest.raises(InvalidEvent):
        parse_json_object(raw, max_bytes=1_000_000)


def test_parse_json_object_checks_size_first() -> None:
    with pytest.raises(InvalidEvent, match="exceeds"):
        parse_json_object(b"{}" + b" " * 100, max_bytes=10)


def _reference_refuses(value: object, depth: int = 0) -> bool:
    """The rules check_canonical enforces, written recursively (small values only)."""
    if depth > MAX_NESTING:
        return True
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, int):
        return not -(2**53) + 1 <= value <= 2**53 - 1
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(type(k) is not str or _reference_refuses(k) or _reference_refuses(v, depth + 1)
                   for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_reference_refuses(v, depth + 1) for v in value)
    return True  # floats, sets, bytes...


_scalars = (st.none() | st.booleans() | st.integers(-(2**54), 2**54) | st.floats(allow_nan=False)
            | st.sampled_from(["\ud800", "a\udfff", "é", "日本"]) | st.text(max_size=5))
_values = st.recursive(_scalars, lambda children: st.lists(children, max_size=3)
                       | st.dictionaries(st.text(max_size=3) | st.sampled_from(["\udc00", "é"]) | st.integers(0, 2),
                                                       children, max_size=3),
                       max_leaves=12)


@settings(derandomize=True, max_examples=400)
@given(_values, st.integers(0, MAX_NESTING + 2))
def test_check_canonical_refuses_exactly_what_the_rules_refuse(value: object, wrap: int) -> None:
    # Wrapped in lists to bring the depth bound into reach, a scalar at depth MAX_NESTING + 1 included.
    for _ in range(wrap):
        value = [value]
    if _reference_refuses(value):
        with pytest.raises(InvalidEvent):
            check_canonical(value)
    else:
        check_canonical(value)
        check_canonical(freeze(value))
