"""Identifier grammar (homeserver/events/identifiers.py): server names with DNS's limits, user,
room and event IDs without control characters, at most 255 bytes."""

# tests: homeserver/events/identifiers.py

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from homeserver.events.identifiers import (
    is_valid_event_id,
    is_valid_room_alias,
    is_valid_room_id,
    is_valid_server_name,
    is_valid_user_id,
)

GOOD_SERVERS = ["example.org", "example.org:8448", "1.2.3.4", "1.2.3.4:1", "[::1]", "[2001:db8::1]:65535",
                "localhost", "a-b.c-d.e", "x" * 63 + ".org", ".".join(["a" * 63] * 3) + "." + "b" * 61]
BAD_SERVERS = ["", ":80", "example.org:", "example.org:0", "example.org:65536", "example.org:99999999",
               "example.org:8a", "exa mple.org", "example..org", "example.org.", ".example.org",
               "x" * 64 + ".org", ".".join(["a" * 63] * 4) + ".b", "[::1", "[zz::1]", "[::1]x", "ex\x00ample.org",
               "exämple.org", "example.org:８0", "example_org"]


@pytest.mark.parametrize("name", GOOD_SERVERS)
def test_good_server_names(name: str) -> None:
    assert is_valid_server_name(name)


@pytest.mark.parametrize("name", BAD_SERVERS)
def test_bad_server_names(name: str) -> None:
    assert not is_valid_server_name(name)


def test_user_ids_allow_historical_localparts_but_no_controls() -> None:
    assert is_valid_user_id("@alice:example.org")
    assert is_valid_user_id("@Alice!#[]:example.org:8448")  # historical grammar, still accepted over federation
    assert is_valid_user_id("@é:example.org")
    for bad in ["alice:example.org", "@alice", "@:", "@a\x00b:example.org", "@a\nb:example.org",
                "@a:" + "x" * 64 + ".org", "@a:b:c", "@" + "a" * 250 + ":example.org", "@\ud800:example.org", 5, None]:
        assert not is_valid_user_id(bad), bad


def test_room_and_event_ids() -> None:
    assert is_valid_room_id("!abc:example.org")
    assert is_valid_room_id("!" + "A" * 43)  # v12: the create event's hash
    assert is_valid_event_id("$abc:example.org")  # v1/v2
    assert is_valid_event_id("$" + "a-_B" * 10 + "abc")  # v4 onwards
    for check, sigil in ((is_valid_room_id, "!"), (is_valid_event_id, "$")):
        for bad in [sigil, "x" + sigil, sigil + "a\x00b", sigil + "a\x7f", sigil + "a\x85", sigil + "x" * 255,
                    sigil + "abc:bad..server", sigil + "é" * 128, sigil + "\udc00", "", None, 7, ["$x"]]:
            assert not check(bad), (check.__name__, bad)
    assert is_valid_room_alias("#room:example.org") and not is_valid_room_alias("#room")


@settings(derandomize=True, max_examples=300)
@given(st.text(max_size=300))
def test_checks_are_total_and_refuse_controls(text: str) -> None:
    for check in (is_valid_server_name, is_valid_user_id, is_valid_room_id, is_valid_event_id, is_valid_room_alias):
        ok = check(text)
        if ok:
            assert "\x00" not in text and len(text.encode("utf-8")) <= 255
