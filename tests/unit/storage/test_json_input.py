"""The strict JSON decoder of the kernel: what each rule set refuses, with which error code."""

# tests: storage/kernel/json_input.py

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.kernel.json_input import (
    CANONICAL_INT_MAX,
    CANONICAL_INT_MIN,
    JsonInputError,
    JsonRules,
    decode_json,
    decode_json_entries,
)

CLIENT = JsonRules(max_bytes=10_000)
CANONICAL = JsonRules(max_bytes=10_000, canonical=True)
EVENT = JsonRules(max_bytes=10_000, canonical=True, allow_floats=False)


def refused(raw: bytes | str, rules: JsonRules) -> tuple[int, str]:
    with pytest.raises(JsonInputError) as info:
        decode_json(raw, rules)
    return info.value.status, info.value.errcode


@pytest.mark.parametrize("rules", [CLIENT, CANONICAL, EVENT])
@pytest.mark.parametrize(
    ("raw", "errcode"),
    [
        (b"", "M_NOT_JSON"),
        (b"   ", "M_NOT_JSON"),
        (b"{not json", "M_NOT_JSON"),
        (b"\xff\xfe{}", "M_NOT_JSON"),
        (b'{"a": "\xed\xa0\x80"}', "M_NOT_JSON"),  # a surrogate encoded as UTF-8 is not UTF-8
        (b"NaN", "M_NOT_JSON"),
        (b'{"a": -Infinity}', "M_NOT_JSON"),
        (b"[" * 200 + b"]" * 200, "M_NOT_JSON"),
        (b"[" * 5000 + b"]" * 5000, "M_NOT_JSON"),
        (b'{"a": 1' + b"0" * 5000 + b"}", "M_NOT_JSON"),
        (b'{"a": 1e400}', "M_BAD_JSON"),
        (b'{"a": [-1e400]}', "M_BAD_JSON"),
        (b'{"a": "\\ud800"}', "M_BAD_JSON"),
        (b'{"\\udc00": 1}', "M_BAD_JSON"),
        (b'["x\\ud83d"]', "M_BAD_JSON"),
    ],
)
def test_refused_by_every_rule_set(rules: JsonRules, raw: bytes, errcode: str) -> None:
    assert refused(raw, rules) == (400, errcode)


def test_size_bound_is_413() -> None:
    assert refused(b'{"a": "' + b"x" * 20_000 + b'"}', CLIENT) == (413, "M_TOO_LARGE")


def test_canonical_rules_refuse_duplicate_keys_and_big_integers() -> None:
    assert decode_json(b'{"a": 1, "a": 2}', CLIENT) == {"a": 2}
    assert refused(b'{"a": 1, "b": {"a": 1, "a": 2}}', CANONICAL) == (400, "M_BAD_JSON")
    big = str(CANONICAL_INT_MAX + 1).encode()
    small = str(CANONICAL_INT_MIN - 1).encode()
    assert decode_json(b"[" + big + b"]", CLIENT) == [CANONICAL_INT_MAX + 1]
    for raw in (b"[" + big + b"]", b'{"x": ' + small + b"}"):
        assert refused(raw, CANONICAL) == (400, "M_BAD_JSON")
    edges = f"[{CANONICAL_INT_MAX}, {CANONICAL_INT_MIN}]".encode()
    assert decode_json(edges, CANONICAL) == [CANONICAL_INT_MAX, CANONICAL_INT_MIN]


def test_floats_are_a_switch() -> None:
    assert decode_json(b'{"ts": 1.5, "e": 1e300}', CANONICAL) == {"ts": 1.5, "e": 1e300}
    assert refused(b'{"ts": 1.5}', EVENT) == (400, "M_BAD_JSON")
    assert refused(b'{"ts": 1e2}', EVENT) == (400, "M_BAD_JSON")


def test_valid_surrogate_pairs_and_depth_edge() -> None:
    assert decode_json(b'{"s": "\\ud83d\\ude00"}', EVENT) == {"s": "\U0001F600"}
    rules = JsonRules(max_bytes=10_000, max_depth=4)  # a scalar counts as a level
    assert decode_json(b'[[["deep"]]]', rules) == [[["deep"]]]
    assert refused(b'[[[["deeper"]]]]', rules) == (400, "M_NOT_JSON")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(CANONICAL_INT_MIN, CANONICAL_INT_MAX) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(derandomize=True, max_examples=200)
@given(json_values)
def test_canonical_values_round_trip(value: object) -> None:
    assert decode_json(json.dumps(value).encode(), EVENT) == value


@settings(derandomize=True, max_examples=300)
@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_arbitrary_bytes_raise_only_json_input_error(raw: bytes) -> None:
    for rules in (CLIENT, CANONICAL, EVENT):
        try:
            decode_json(raw, rules)
        except JsonInputError as e:
            assert e.status in (400, 413) and e.errcode in ("M_NOT_JSON", "M_BAD_JSON", "M_TOO_LARGE")


def test_a_lone_surrogate_is_found_whether_the_text_escapes_it_or_holds_it() -> None:
    # Bytes are UTF-8, so only an escape can make one; a str may hold one outright.
    assert refused(b'{"a": ["ok", {"b": "\\ud800"}]}', CLIENT) == (400, "M_BAD_JSON")
    assert refused('{"a": ["ok", {"b": "\ud800"}]}', CLIENT) == (400, "M_BAD_JSON")
    assert refused('{"\udfff": 1}', CLIENT) == (400, "M_BAD_JSON")
    assert decode_json(b'{"a": "\\\\ud800"}', CLIENT) == {"a": "\\ud800"}  # an escaped backslash, then text


@pytest.mark.parametrize("depth", [1, 2, 5, 100])
def test_depth_counts_every_value_with_empty_containers_and_scalars_alike(depth: int) -> None:
    rules = JsonRules(max_bytes=10_000, max_depth=depth)
    for leaf in (b"1", b'"s"', b"{}", b"[]", b"null", b"true"):
        at = b"[" * (depth - 1) + leaf + b"]" * (depth - 1)
        assert decode_json(at, rules) == json.loads(at)
        deeper = b'{"k": ' * depth + leaf + b"}" * depth
        assert refused(deeper, rules) == (400, "M_NOT_JSON")


def nesting(value: object) -> int:
    """The depth the rules count: 1 for a scalar or an empty container, else one more than the deepest child."""
    children = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    return 1 + max(map(nesting, children), default=0)


@settings(derandomize=True, max_examples=300)
@given(json_values, st.integers(1, 6))
def test_refused_for_depth_exactly_when_deeper_than_the_bound(value: object, max_depth: int) -> None:
    rules = JsonRules(max_bytes=10_000, max_depth=max_depth, canonical=True)
    raw = json.dumps(value, ensure_ascii=False).encode()
    if nesting(value) > max_depth:
        assert refused(raw, rules) == (400, "M_NOT_JSON")
    else:
        assert decode_json(raw, rules) == value


# --- a transaction's entries judged one by one (decode_json_entries) --------------------------

ENTRIES = ("pdus", "edus")


def entries(raw: bytes, rules: JsonRules = CANONICAL) -> tuple[object, dict[tuple[str, int], str]]:
    value, refused = decode_json_entries(raw, rules, ENTRIES)
    assert all(e.status == 400 and e.errcode == "M_BAD_JSON" for e in refused.values())
    return value, {where: e.error for where, e in refused.items()}


def test_an_entry_breaking_a_value_rule_is_refused_alone_and_kept_as_parsed() -> None:
    """A PDU's depth of 2**60, an overflowing float, a lone surrogate and a repeated key each
    refuse their own entry; the others and the top level are as decode_json would give them."""
    raw = (b'{"origin": "a", "pdus": [{"depth": 1152921504606846976}, {"depth": 1}, {"x": 1e400}],'
           b' "edus": [{"c": "\\ud800"}, {"k": 1, "k": 2}, {"edu_type": "m.typing"}]}')
    value, refused = entries(raw)
    assert value == {"origin": "a", "pdus": [{"depth": 2**60}, {"depth": 1}, {"x": float("inf")}],
                     "edus": [{"c": "\ud800"}, {"k": 2}, {"edu_type": "m.typing"}]}
    assert sorted(refused) == [("edus", 0), ("edus", 1), ("pdus", 0), ("pdus", 2)]
    assert "1152921504606846976" in refused[("pdus", 0)] and "canonical" in refused[("pdus", 0)]
    assert "out of range" in refused[("pdus", 2)]
    assert "surrogate" in refused[("edus", 0)]
    assert "duplicate object key 'k'" in refused[("edus", 1)]


def test_without_a_bad_entry_it_is_decode_json() -> None:
    raw = b'{"pdus": [{"depth": 9007199254740991, "f": 1.5}], "edus": []}'
    assert entries(raw) == (decode_json(raw, CANONICAL), {})
    assert entries(b'{"pdus": [{"f": 1.5}]}', EVENT)[1] == {("pdus", 0): "non-integer number 1.5 is not allowed here"}


@pytest.mark.parametrize(
    ("raw", "errcode"),
    [
        (b'{"pdus": [], "origin_server_ts": 1152921504606846976}', "M_BAD_JSON"),  # outside the entries
        (b'{"pdus": [{"d": 1e400}], "edus": "\\ud800"}', "M_BAD_JSON"),  # edus is no list: all of it judged
        (b'{"pdus": [{"d": 1e400}], "pdus": []}', "M_BAD_JSON"),  # the top level repeats a key
        (b'{"pdus": {"d": 1152921504606846976}}', "M_BAD_JSON"),  # not a list of entries
        (b'[{"pdus": [{"d": 1152921504606846976}]}]', "M_BAD_JSON"),  # the top level is no object
        (b'{"pdus": [{"d": 1e400}], "x": NaN}', "M_NOT_JSON"),  # no JSON after the bad entry
        (b'{"pdus": [{"d": 1e400}], "x": ', "M_NOT_JSON"),
        (b'{"pdus": [{"d": 1e400}, ' + b"[" * 200 + b"]" * 200 + b"]}", "M_NOT_JSON"),  # nesting is the text's
        (b'{"pdus": [{"d": 1e400}, ' + b"[" * 5000 + b"]" * 5000 + b"]}", "M_NOT_JSON"),
    ],
)
def test_what_is_not_one_entrys_fault_still_refuses_the_text(raw: bytes, errcode: str) -> None:
    with pytest.raises(JsonInputError) as info:
        decode_json_entries(raw, JsonRules(max_bytes=100_000, canonical=True), ENTRIES)
    assert (info.value.status, info.value.errcode) == (400, errcode)


@settings(derandomize=True, max_examples=200)
@given(st.lists(st.one_of(st.integers(-(2**64), 2**64), st.text(max_size=3), st.floats(allow_nan=False, allow_infinity=False)),
                max_size=5))
def test_an_entry_is_refused_exactly_when_decode_json_refuses_it_alone(values: list[object]) -> None:
    raw = json.dumps({"pdus": [{"v": v} for v in values], "edus": []}).encode()
    value, refused = entries(raw)
    assert value == json.loads(raw)
    for index, v in enumerate(values):
        alone = json.dumps({"v": v}).encode()
        try:
            decode_json(alone, CANONICAL)
        except JsonInputError:
            assert ("pdus", index) in refused
        else:
            assert ("pdus", index) not in refused
