"""Tokens: string forms, comparisons, advancing, and the errors clients get for bad ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from storage.tokens import (
    MAX_POSITION,
    MAX_TOKEN_LENGTH,
    InvalidTokenError,
    MultiWriterStreamToken,
    RoomStreamToken,
    StreamToken,
    SyncStreamKey,
)


def test_string_forms() -> None:
    assert str(RoomStreamToken(53)) == "s53"
    assert str(RoomStreamToken.from_positions({1: 53, 2: 58, 3: 53})) == "m53~2.58"
    assert str(RoomStreamToken.from_positions({4: 60, 1: 53, 2: 58})) == "m53~2.58~4.60"
    assert str(RoomStreamToken.from_positions({1: 7, 2: 7})) == "s7"
    assert str(RoomStreamToken.from_positions({})) == "s0"
    assert RoomStreamToken.parse("m53~2.58~4.60") == RoomStreamToken(53, ((2, 58), (4, 60)))
    assert RoomStreamToken.parse("s0") == RoomStreamToken(0)
    assert RoomStreamToken.parse(f"s{MAX_POSITION}") == RoomStreamToken(MAX_POSITION)


def test_from_a_generators_view() -> None:
    positions = {"main": 10, "persister1": 14, "persister2": 10, "retired": 30}
    ids = {"main": 1, "persister1": 2, "persister2": 3}
    token = RoomStreamToken.from_writer_positions(positions, ["main", "persister1", "persister2"], ids)
    assert str(token) == "m10~2.14"
    assert str(RoomStreamToken.from_writer_positions({"main": 7}, ["main"], {})) == "s7"
    with pytest.raises(ValueError, match="no instance ID"):
        RoomStreamToken.from_writer_positions(positions, ["main", "persister1"], {"main": 1})


def test_get_and_max() -> None:
    token = RoomStreamToken.parse("m10~2.15~5.12")
    assert [token.get(i) for i in (1, 2, 3, 5)] == [10, 15, 10, 12]
    assert token.max_position == 15
    assert RoomStreamToken(4).max_position == 4


def test_comparisons_are_a_partial_order() -> None:
    a = RoomStreamToken.parse("m10~1.12")
    b = RoomStreamToken.parse("m10~2.12")
    both = RoomStreamToken.parse("m10~1.12~2.12")
    assert a.is_before(both) and both.is_after(a)
    assert not a.is_before(b) and not b.is_before(a) and not a.is_after(b)
    assert a.is_before_or_equal(a) and not a.is_before(a) and not a.is_after(a)
    assert RoomStreamToken(12).is_after(both)
    assert a.advance(b) == both


def test_advance_instance() -> None:
    token = RoomStreamToken(5)
    assert str(token.advance_instance(3, 9)) == "m5~3.9"
    assert token.advance_instance(3, 4) == token
    assert str(RoomStreamToken.parse("m5~3.9").advance_instance(3, 12)) == "m5~3.12"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected 's{pos}'"),
        ("53", "expected 's{pos}'"),
        ("t53-2", "expected 's{pos}'"),
        ("s", "empty"),
        ("s-1", "not a decimal"),
        ("s+1", "not a decimal"),
        ("s 1", "not a decimal"),
        ("s1 ", "not a decimal"),
        ("s٣", "not a decimal"),  # a non-ASCII digit
        ("s01", "leading zero"),
        ("s" + "9" * 20, "digits"),
        (f"s{MAX_POSITION + 1}", "larger than"),
        ("m5", "at least one writer"),
        ("m5~", "not '{id}.{pos}'"),
        ("m5~1", "not '{id}.{pos}'"),
        ("m5~1.", "empty"),
        ("m5~.7", "empty"),
        ("m5~1.5", "not ahead of the minimum"),
        ("m5~1.4", "not ahead of the minimum"),
        ("m5~2.7~1.8", "ascending"),
        ("m5~1.7~1.8", "ascending"),
        ("m5~0.7", "start at 1"),
        ("m5~2147483648.7", "larger than"),
        ("m5~1.7.8", "not a decimal"),
        ("m5~1.7~", "not '{id}.{pos}'"),
        ("s" + "1" * (MAX_TOKEN_LENGTH + 1), "characters long"),
    ],
)
def test_malformed_room_tokens_are_rejected_with_a_reason(text: str, reason: str) -> None:
    with pytest.raises(InvalidTokenError) as caught:
        RoomStreamToken.parse(text)
    assert reason in str(caught.value)
    assert caught.value.errcode == "M_INVALID_PARAM"
    assert caught.value.http_status == 400
    assert isinstance(caught.value, ValueError)
    assert len(str(caught.value)) < 400  # bounded, even for huge input


def test_constructor_refuses_tokens_that_have_no_canonical_form() -> None:
    with pytest.raises(ValueError, match="not ahead"):
        RoomStreamToken(5, ((1, 5),))
    with pytest.raises(ValueError, match="ascending"):
        RoomStreamToken(5, ((2, 7), (1, 8)))
    with pytest.raises(ValueError, match="between 0"):
        RoomStreamToken(-1)
    with pytest.raises(ValueError, match="between 0"):
        RoomStreamToken(True)


def test_room_and_other_tokens_are_different_types() -> None:
    room: object = RoomStreamToken(5)
    assert room != MultiWriterStreamToken(5)


def test_sync_token_round_trip_and_form() -> None:
    token = StreamToken(
        RoomStreamToken.parse("m1843~2.1850"),
        typing=MultiWriterStreamToken(12),
        receipts=MultiWriterStreamToken.from_positions({1: 7, 2: 9}),
        device_lists=MultiWriterStreamToken(41),
    )
    assert str(token) == "m1843~2.1850_12_m7~2.9_0_0_0_41"
    assert StreamToken.parse(str(token)) == token
    assert str(StreamToken.start()) == "s0_0_0_0_0_0_0"


def test_sync_token_components_and_advancing() -> None:
    start = StreamToken.start()
    later = start.advance(SyncStreamKey.TYPING, MultiWriterStreamToken(3))
    assert later.typing == MultiWriterStreamToken(3)
    assert later.advanced_keys(start) == {SyncStreamKey.TYPING}
    assert start.advanced_keys(later) == frozenset()
    assert later.advance(SyncStreamKey.TYPING, MultiWriterStreamToken(1)) == later
    assert later.get(SyncStreamKey.EVENTS) == RoomStreamToken(0)
    assert later.replace(SyncStreamKey.EVENTS, RoomStreamToken(9)).events == RoomStreamToken(9)
    with pytest.raises(TypeError):
        later.replace(SyncStreamKey.EVENTS, MultiWriterStreamToken(9))
    with pytest.raises(TypeError):
        later.advance(SyncStreamKey.TYPING, RoomStreamToken(9))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "s0",
        "s0_0_0_0_0_0",  # too few components
        "s0_0_0_0_0_0_0_0",  # too many
        "0_0_0_0_0_0_0",  # the events component needs its prefix
        "s0_s0_0_0_0_0_0",  # only the events component has 's'
        "s0_0_0_0_0_0_x",
        "s0_0_0__0_0_0",
        "s0_0_m5~1.5_0_0_0_0",
        "s0_0_01_0_0_0_0",
        "s0_0_0_0_0_0_-1",
    ],
)
def test_malformed_sync_tokens_are_rejected(text: str) -> None:
    with pytest.raises(InvalidTokenError) as caught:
        StreamToken.parse(text)
    assert caught.value.kind == "sync token"
    assert caught.value.errcode == "M_INVALID_PARAM"


def test_non_string_input_is_an_invalid_token() -> None:
    with pytest.raises(InvalidTokenError):
        StreamToken.parse(5)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokenError):
        RoomStreamToken.parse(None)  # type: ignore[arg-type]


DOC = Path(__file__).resolve().parents[3] / "docs" / "streams.md"


def test_every_token_in_the_streams_doc_parses_to_itself() -> None:
    prose = re.sub(r"```.*?```", "", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    examples = re.findall(r"`([^`]+)`", prose)
    room = [e for e in examples if re.fullmatch(r"s\d+|m\d+(~\d+\.\d+)+", e)]
    sync = [e for e in examples if re.fullmatch(r"[sm][\d~.]+(_[m\d][\d~.]*){6}", e)]
    assert len(room) >= 2 and len(sync) >= 2
    for text in room:
        assert str(RoomStreamToken.parse(text)) == text
    for text in sync:
        assert str(StreamToken.parse(text)) == text


def test_stream_positions_compare_only_within_one_stream() -> None:
    from storage.tokens import StreamPosition

    a, b = StreamPosition("events", 53), StreamPosition("events", 54)
    assert a < b and a <= b and b > a and b >= a and max(a, b) is b
    assert a == StreamPosition("events", 53) and hash(a) == hash(StreamPosition("events", 53))
    assert a.at(54) == b and str(a) == "events@53"
    caches = StreamPosition("caches", 53)
    assert a != caches  # equality is plain: different streams are unequal
    for compare in (lambda: a < caches, lambda: a <= caches, lambda: a > caches, lambda: a >= caches):
        with pytest.raises(TypeError, match="different streams: 'events' .* 'caches'"):
            compare()
    with pytest.raises(TypeError, match="with int"):
        assert a < 54  # type: ignore[operator]
    with pytest.raises(ValueError, match="fits in 64 bits"):
        StreamPosition("events", 2**63)
    with pytest.raises(ValueError, match="fits in 64 bits"):
        StreamPosition("events", True)
    with pytest.raises(ValueError, match="non-empty stream name"):
        StreamPosition("", 1)
