"""The server ACL matcher (homeserver/events/server_acl.py): globs, ports, IP literals, deny over
allow, malformed content read as Synapse reads it, and which rooms an EDU names."""

# tests: homeserver/events/server_acl.py

from __future__ import annotations

import pytest

from homeserver.events.server_acl import edu_rooms, host_of, is_ip_literal, server_allowed


def test_no_acl_allows_everyone() -> None:
    assert server_allowed("evil.example", None)
    assert server_allowed("1.2.3.4:8448", None)


@pytest.mark.parametrize(
    ("server", "allowed"),
    [
        ("good.example", True),
        ("matrix.good.example", True),
        ("GOOD.EXAMPLE:8448", True),  # the port is not matched; case does not matter (as Synapse)
        ("evil.example", False),
        ("sub.evil.example", False),
        ("notgood.example.org", False),  # neither list: denied
        ("a1.test", True),
        ("a12.test", False),  # ? is exactly one character
    ],
)
def test_globs_deny_wins_and_unlisted_is_denied(server: str, allowed: bool) -> None:
    content = {"allow": ["*.good.example", "good.example", "a?.test", "*evil*"], "deny": ["*evil.example"]}
    assert server_allowed(server, content) is allowed


def test_star_allows_all_but_the_denied() -> None:
    content = {"allow": ["*"], "deny": ["evil.example"]}
    assert server_allowed("anything.org:443", content)
    assert not server_allowed("evil.example:8448", content)
    assert not server_allowed("EVIL.example", content)


def test_empty_or_missing_allow_denies_everyone() -> None:
    assert not server_allowed("good.example", {})
    assert not server_allowed("good.example", {"allow": []})


def test_ip_literals() -> None:
    content = {"allow": ["*"], "allow_ip_literals": False}
    assert not server_allowed("1.2.3.4", content)
    assert not server_allowed("127.0.0.1:8448", content)
    assert not server_allowed("[::1]:8448", content)
    assert server_allowed("host.example:8448", content)
    # Default true; a non-boolean reads as true (Synapse).
    assert server_allowed("1.2.3.4", {"allow": ["*"]})
    assert server_allowed("1.2.3.4", {"allow": ["*"], "allow_ip_literals": "no"})
    # Allowed literals still go through deny/allow.
    assert not server_allowed("1.2.3.4", {"allow": ["*"], "deny": ["1.2.3.*"]})


def test_malformed_lists_are_empty_and_non_strings_skipped() -> None:
    assert not server_allowed("good.example", {"allow": "good.example"})
    assert server_allowed("good.example", {"allow": [1, None, "good.example"], "deny": {"good.example": 1}})


def test_regex_characters_are_literal() -> None:
    content = {"allow": ["a.b", "x+y.test"]}
    assert server_allowed("a.b", content)
    assert not server_allowed("axb", content)
    assert server_allowed("x+y.test", content)
    assert not server_allowed("xxy.test", content)


def test_host_and_ip_helpers() -> None:
    assert host_of("example.org:8448") == "example.org"
    assert host_of("[::1]:8448") == "[::1]"
    assert host_of("[::1]") == "[::1]"
    assert host_of("example.org") == "example.org"
    assert is_ip_literal("10.0.0.1") and is_ip_literal("[2001:db8::1]")
    assert not is_ip_literal("example.org") and not is_ip_literal("2001:db8::1x")


def test_edu_rooms() -> None:
    assert edu_rooms("m.typing", {"room_id": "!r:x", "user_id": "@u:x"}) == ["!r:x"]
    assert edu_rooms("m.receipt", {"!a:x": {}, "!b:x": {}}) == ["!a:x", "!b:x"]
    assert edu_rooms("m.presence", {"push": []}) == []
    assert edu_rooms("m.typing", "nonsense") == []
