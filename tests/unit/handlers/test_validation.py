"""Usernames, user and room IDs, storable text and JSON, and what a login names."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.handlers.accounts.login import resolve_user, user_from_identifier
from homeserver.handlers.accounts.register import localpart_from_username
from homeserver.events.validation import (
    check_event_type,
    check_localpart,
    check_room_id,
    check_text,
    check_user_id,
    dump_json_object,
    is_local_user_id,
    is_storable_text,
)
from storage.kernel.errors import MatrixError


@pytest.mark.parametrize("localpart", ["alice", "a", "bob.smith", "x_y-z=1/2+3", "0123456789"])
def test_valid_localparts(localpart: str) -> None:
    assert check_localpart(localpart, "example.org") == localpart


@pytest.mark.parametrize(
    "localpart", ["", "Alice", "al ice", "al:ice", "@alice", "ålice", "al\x00ice", "alice!", "a#b", "\ud800"]
)
def test_invalid_localparts(localpart: str) -> None:
    with pytest.raises(MatrixError) as caught:
        check_localpart(localpart, "example.org")
    assert (caught.value.status, caught.value.errcode) == (400, "M_INVALID_USERNAME")


def test_user_id_may_not_exceed_255_bytes() -> None:
    server = "example.org"
    fits = "a" * (255 - len(f"@:{server}"))
    assert check_localpart(fits, server) == fits
    with pytest.raises(MatrixError):
        check_localpart(fits + "a", server)


def test_usernames_are_lowercased_before_the_grammar_applies() -> None:
    assert localpart_from_username("Alice.Smith") == "alice.smith"
    with pytest.raises(MatrixError):
        check_localpart(localpart_from_username("Ålice"), "hs")


def test_storable_text() -> None:
    assert is_storable_text("héllo ✓ 😀")
    assert not is_storable_text("nul\x00byte")
    assert not is_storable_text("lone \udc80 surrogate")


def test_check_text_names_the_field() -> None:
    assert check_text("ok", "display_name", max_length=5) == "ok"
    with pytest.raises(MatrixError, match="display_name is too long"):
        check_text("toolong", "display_name", max_length=5)
    with pytest.raises(MatrixError, match="must not be empty"):
        check_text("", "device_id", max_length=5, allow_empty=False)
    with pytest.raises(MatrixError, match="NUL"):
        check_text("a\x00", "device_id", max_length=5)


def test_user_ids() -> None:
    assert check_user_id("@alice:example.org") == "@alice:example.org"
    for bad in ["alice", "@alice", "@:", "@alice:bad host", "@al\x00ice:hs", "@" + "a" * 300 + ":hs"]:
        with pytest.raises(MatrixError) as caught:
            check_user_id(bad)
        assert caught.value.errcode == "M_INVALID_PARAM"
    assert is_local_user_id("@a:hs.example", "hs.example")
    assert not is_local_user_id("@a:other", "hs.example")
    assert not is_local_user_id("@a:hs.example:8448", "hs.example")


def test_room_ids_of_every_version() -> None:
    assert check_room_id("!abc:example.org") == "!abc:example.org"
    assert check_room_id("!31hneApxJ_1o-63DmFrpeqnkFfWppnzWso1JvH3ogLM") == "!31hneApxJ_1o-63DmFrpeqnkFfWppnzWso1JvH3ogLM"
    for bad in ["", "!", "abc:example.org", "#alias:hs", "!a\x00b", "!" + "x" * 300]:
        with pytest.raises(MatrixError) as caught:
            check_room_id(bad)
        assert caught.value.errcode == "M_INVALID_PARAM"


def test_event_types() -> None:
    assert check_event_type("m.direct") == "m.direct"
    for bad in ["", "x" * 256, "a\x00"]:
        with pytest.raises(MatrixError):
            check_event_type(bad)


def test_dump_json_object_refuses_what_cannot_round_trip() -> None:
    assert dump_json_object({"a": "é", "n": [1, 2.5, None, True]}) == '{"a":"é","n":[1,2.5,null,true]}'
    assert dump_json_object({"nul": "\x00"}) == '{"nul":"\\u0000"}'
    for bad in [{"s": "\ud800"}, {"f": float("inf")}, {"\udc80": 1}]:
        with pytest.raises(MatrixError) as caught:
            dump_json_object(bad)
        assert caught.value.errcode == "M_BAD_JSON"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("alice", "@alice:hs"),
        ("Alice", "@alice:hs"),
        ("@alice:hs", "@alice:hs"),
        ("@ALICE:hs", "@alice:hs"),
        ("@alice:other", None),
        ("@alice", None),
        ("", None),
        ("a:b", None),
        ("a\x00", None),
        ("x" * 300, None),
    ],
)
def test_resolve_login_user(given: str, expected: str | None) -> None:
    assert resolve_user(given, "hs") == expected


def test_identifiers() -> None:
    assert user_from_identifier({"type": "m.id.user", "user": "bob"}, None) == "bob"
    assert user_from_identifier(None, "legacy") == "legacy"
    assert user_from_identifier(None, None) is None
    cases: list[tuple[Any, Any, str]] = [
        ("notadict", None, "M_BAD_JSON"),
        ({"type": "m.id.user"}, None, "M_BAD_JSON"),
        ({"type": "m.id.user", "user": 5}, None, "M_BAD_JSON"),
        ({"type": "m.id.thirdparty", "medium": "email", "address": "a@b"}, None, "M_FORBIDDEN"),
        ({"type": "m.id.phone"}, None, "M_FORBIDDEN"),
        ({"type": "nonsense"}, None, "M_UNKNOWN"),
        (None, ["list"], "M_BAD_JSON"),
    ]
    for identifier, legacy, errcode in cases:
        with pytest.raises(MatrixError) as caught:
            user_from_identifier(identifier, legacy)
        assert caught.value.errcode == errcode, (identifier, legacy)
