"""Server-name parsing and the outbound IP blacklist."""

from __future__ import annotations

import pytest

from homeserver.remote.client import IpFilter, ServerName, parse_server_name


@pytest.mark.parametrize(
    "name,expected",
    [
        ("example.org", ServerName("example.org", None)),
        ("example.org:8448", ServerName("example.org", 8448)),
        ("localhost:1234", ServerName("localhost", 1234)),
        ("1.2.3.4", ServerName("1.2.3.4", None)),
        ("[::1]:80", ServerName("::1", 80)),
        ("[2001:db8::1]", ServerName("2001:db8::1", None)),
    ],
)
def test_parse_server_name(name: str, expected: ServerName) -> None:
    assert parse_server_name(name) == expected


@pytest.mark.parametrize("name", ["", ":80", "host:", "host:99999", "host:8a", "[::1", "[nope]"])
def test_parse_server_name_rejects(name: str) -> None:
    with pytest.raises(ValueError):
        parse_server_name(name)


def test_blacklist_refuses_private_ranges_by_default() -> None:
    ips = IpFilter(())
    for address in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.1.1", "::1", "fd00::1"):
        assert not ips.allowed(address), address
    assert ips.allowed("8.8.8.8")
    assert ips.allowed("2001:4860:4860::8888")


def test_whitelist_overrides_the_blacklist() -> None:
    ips = IpFilter(("127.0.0.0/8",))
    assert ips.allowed("127.0.0.1")
    assert not ips.allowed("10.0.0.1")


def test_trusted_key_servers_config() -> None:
    from homeserver.config import ConfigError, parse_config

    base = {"server_name": "example.org", "listeners": [{"type": "http", "port": 8008}]}
    config = parse_config({**base, "federation": {"trusted_key_servers": ["notary.example:8448"]}})
    assert config.federation.trusted_key_servers == ("notary.example:8448",)
    with pytest.raises(ConfigError, match=r"federation\.trusted_key_servers\[0\]"):
        parse_config({**base, "federation": {"trusted_key_servers": ["not a name"]}})


@pytest.mark.parametrize("name", [
    "a" * 64 + ".example.org",            # a DNS label is at most 63 characters
    ".".join(["a" * 63] * 4) + ".org",    # a DNS name is at most 255
    "a..b", "a.b.", "exa mple.org", "ex_ample.org", "bücher.example", "host:+80", "host:０", "::1", "host:123456",
])
def test_parse_server_name_refuses_what_the_grammar_refuses(name: str) -> None:
    with pytest.raises(ValueError):
        parse_server_name(name)


def test_parse_server_name_takes_63_character_labels() -> None:
    name = "a" * 63 + ".example-1.org"
    assert parse_server_name(name + ":8448") == ServerName(name, 8448)


def test_within_times_out_cancels_and_lets_cancellation_through() -> None:
    """``within`` turns its own timer into FederationTimeout whatever error the cancelled work
    reports, passes results through, and leaves a cancellation from above a CancelledError."""
    from twisted.internet.defer import CancelledError, Deferred
    from twisted.internet.task import Clock

    from homeserver.remote.client import FederationTimeout, within

    clock = Clock()

    def wrapped_cancel(d: Deferred[int]) -> None:
        d.errback(RuntimeError("the agent wraps the cancellation"))

    outcomes: list[object] = []
    slow: Deferred[int] = Deferred(wrapped_cancel)
    Deferred.fromCoroutine(within(slow, 2.0, clock, "DNS lookup of x")).addErrback(lambda f: outcomes.append(f.value))
    clock.advance(1.9)
    assert outcomes == []
    clock.advance(0.2)
    assert isinstance(outcomes[0], FederationTimeout) and "DNS lookup of x timed out after 2s" in str(outcomes[0])

    fast: Deferred[int] = Deferred()
    Deferred.fromCoroutine(within(fast, 2.0, clock, "x")).addCallback(outcomes.append)
    fast.callback(7)
    assert outcomes[-1] == 7 and not clock.getDelayedCalls()

    waiting: Deferred[int] = Deferred()
    outer = Deferred.fromCoroutine(within(waiting, 2.0, clock, "x"))
    outer.addErrback(lambda f: outcomes.append(f.value))
    outer.cancel()
    assert isinstance(outcomes[-1], CancelledError) and not clock.getDelayedCalls()
