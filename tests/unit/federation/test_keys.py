"""The key server response and the keyring's cache, with a fake clock and fake fetchers."""

from __future__ import annotations

from typing import Any

import pytest
from signedjson.key import generate_signing_key
from signedjson.sign import sign_json

from homeserver.federation.keys import (
    KEY_VALIDITY_MS,
    MAX_CACHE_MS,
    KeyFetchError,
    Keyring,
    parse_key_response,
    server_key_response,
)
from tests.twisted_plugin import run_sync

REMOTE = generate_signing_key("r1")
NOTARY = generate_signing_key("n1")
OURS = generate_signing_key("o1")
DAY = 24 * 3600 * 1000


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now


class Fetcher:
    """Counts fetches; answers with ``REMOTE``'s keys unless told to fail."""

    def __init__(self, clock: Clock, validity: int = DAY) -> None:
        self.clock = clock
        self.validity = validity
        self.direct = 0
        self.notary = 0
        self.fail_direct = False

    async def fetch_direct(self, server: str) -> Any:
        self.direct += 1
        if self.fail_direct:
            raise ConnectionError("down")
        if server == "notary.test":
            return server_key_response("notary.test", NOTARY, self.clock())
        return _response(self.clock() + self.validity)

    async def fetch_notary(self, notary: str, server: str, key_ids: Any) -> Any:
        self.notary += 1
        return {"server_keys": [sign_json(_response(self.clock() + self.validity), "notary.test", NOTARY)]}


def _response(valid_until: int) -> dict[str, Any]:
    body = server_key_response("remote.test", REMOTE, 0)
    body.pop("signatures")
    body["valid_until_ts"] = valid_until
    signed: dict[str, Any] = sign_json(body, "remote.test", REMOTE)
    return signed


def _keyring(clock: Clock, fetcher: Fetcher, notaries: tuple[str, ...] = ()) -> Keyring:
    return Keyring(server_name="ours.test", signing_key=OURS, clock_ms=clock,
                   fetch_direct=fetcher.fetch_direct, fetch_notary=fetcher.fetch_notary, notaries=notaries)


def test_our_key_response_is_signed_and_parses() -> None:
    body = server_key_response("ours.test", OURS, 1000)
    keys = parse_key_response("ours.test", body, 1000)
    assert keys["ed25519:o1"].valid_until_ts == 1000 + KEY_VALIDITY_MS


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.update(server_name="evil.test"),
        lambda b: b.update(valid_until_ts="soon"),
        lambda b: b.pop("signatures"),
        lambda b: b["verify_keys"]["ed25519:r1"].update(key="AAAA"),
        lambda b: b.update(extra="changed after signing"),
    ],
)
def test_bad_key_responses_are_refused(mutate: Any) -> None:
    body = _response(10**13)
    mutate(body)
    with pytest.raises(KeyFetchError):
        parse_key_response("remote.test", body, 0)


def test_validity_is_capped_at_seven_days() -> None:
    keys = parse_key_response("remote.test", _response(10**15), 5000)
    assert keys["ed25519:r1"].valid_until_ts == 5000 + MAX_CACHE_MS


def test_keys_are_cached_until_valid_until_ts() -> None:
    clock = Clock()
    fetcher = Fetcher(clock)
    keyring = _keyring(clock, fetcher)
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:r1")) is not None
    clock.now += DAY - 1
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:r1")) is not None
    assert fetcher.direct == 1
    clock.now += 2  # now past valid_until_ts: fetched again
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:r1")) is not None
    assert fetcher.direct == 2


def test_unknown_key_is_not_refetched_within_a_minute() -> None:
    clock = Clock()
    fetcher = Fetcher(clock)
    keyring = _keyring(clock, fetcher)
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:nope")) is None
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:nope")) is None
    assert fetcher.direct == 1
    clock.now += 60_000
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:nope")) is None
    assert fetcher.direct == 2


def test_a_key_id_not_looked_for_before_is_fetched_at_once() -> None:
    """A server that rotated its key: its new key ID is fetched now, not a minute later."""
    clock = Clock()
    fetcher = Fetcher(clock)
    keyring = _keyring(clock, fetcher)
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:nope")) is None
    clock.now += 1000
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:other")) is None
    assert fetcher.direct == 2
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:other")) is None
    assert fetcher.direct == 2


def test_notary_is_asked_when_the_server_is_down() -> None:
    clock = Clock()
    fetcher = Fetcher(clock)
    fetcher.fail_direct = True
    keyring = _keyring(clock, fetcher, notaries=("notary.test",))
    # The notary's own key is fetched directly too, so let that one through.
    original = fetcher.fetch_direct

    async def direct(server: str) -> Any:
        if server == "notary.test":
            return server_key_response("notary.test", NOTARY, clock())
        return await original(server)

    keyring._fetch_direct = direct
    assert run_sync(keyring.get_verify_key("remote.test", "ed25519:r1")) is not None
    assert fetcher.notary == 1


def test_our_own_key_needs_no_fetch() -> None:
    clock = Clock()
    fetcher = Fetcher(clock)
    keyring = _keyring(clock, fetcher)
    assert run_sync(keyring.get_verify_key("ours.test", "ed25519:o1")) is not None
    assert fetcher.direct == 0


class MemoryKeyStore:
    def __init__(self) -> None:
        self.rows: dict[str, Any] = {}

    async def get_key_response(self, server_name: str) -> Any:
        return self.rows.get(server_name)

    async def store_key_response(self, server_name: str, response: dict[str, Any], fetched_ts: int) -> None:
        from storage.stores.federation import StoredKeyResponse

        self.rows[server_name] = StoredKeyResponse(server_name, response, fetched_ts)


def test_stored_responses_spare_a_fetch_after_restart() -> None:
    clock = Clock()
    fetcher = Fetcher(clock)
    store = MemoryKeyStore()

    def keyring() -> Keyring:
        return Keyring(server_name="ours.test", signing_key=OURS, clock_ms=clock, fetch_direct=fetcher.fetch_direct,
                       fetch_notary=fetcher.fetch_notary, key_store=store)

    assert run_sync(keyring().get_verify_key("remote.test", "ed25519:r1")) is not None
    clock.now += 1000
    assert run_sync(keyring().get_verify_key("remote.test", "ed25519:r1")) is not None  # a "restarted" keyring
    assert fetcher.direct == 1
    clock.now += DAY  # the stored response has expired: fetched again
    assert run_sync(keyring().get_verify_key("remote.test", "ed25519:r1")) is not None
    assert fetcher.direct == 2


# --- notary ------------------------------------------------------------------------------


def test_parse_key_query_takes_the_latest_minimum_and_skips_invalid_names() -> None:
    from homeserver.federation.keys import KeyQuery, parse_key_query

    body = {"server_keys": {
        "remote.test": {"ed25519:a": {"minimum_valid_until_ts": 5}, "ed25519:b": {"minimum_valid_until_ts": 2000}},
        "a" * 64 + ".test": {},
        "other.test:8448": {},
    }}
    assert parse_key_query(body, 1000, max_servers=3) == [
        KeyQuery("remote.test", frozenset({"ed25519:a", "ed25519:b"}), 2000),
        KeyQuery("other.test:8448", frozenset(), 1000),
    ]


@pytest.mark.parametrize("body, errcode", [
    ([], "M_BAD_JSON"),
    ({"server_keys": []}, "M_BAD_JSON"),
    ({"server_keys": {"r.test": []}}, "M_BAD_JSON"),
    ({"server_keys": {"r.test": {"k": 1}}}, "M_BAD_JSON"),
    ({"server_keys": {"r.test": {"k": {"minimum_valid_until_ts": 1.5}}}}, "M_BAD_JSON"),
    ({"server_keys": {"r.test": {"k": {"minimum_valid_until_ts": True}}}}, "M_BAD_JSON"),
    ({"server_keys": {f"s{i}.test": {} for i in range(4)}}, "M_TOO_LARGE"),
])
def test_parse_key_query_refuses_bad_bodies(body: Any, errcode: str) -> None:
    from homeserver.federation.keys import parse_key_query
    from storage.kernel.errors import MatrixError

    with pytest.raises(MatrixError) as info:
        parse_key_query(body, 0, max_servers=3)
    assert (info.value.status, info.value.errcode) == (400, errcode)


def test_notary_refetches_keys_that_expire_before_the_minimum() -> None:
    """A cached key valid for a day is enough for a query needing it for an hour, not for one
    needing it for two days: that one refetches (and answers with what the server sends)."""
    from homeserver.federation.keys import Notary
    from tests.twisted_plugin import reactor

    clock = Clock()
    fetcher = Fetcher(clock)
    notary = Notary(keyring=_keyring(clock, fetcher), server_name="ours.test", signing_key=OURS, clock_ms=clock,
                    reactor=reactor)
    answer = run_sync(notary.query_server("remote.test", None, [str(clock.now + 3600_000)]))
    [keys] = answer["server_keys"]
    assert set(keys["signatures"]) == {"remote.test", "ours.test"} and fetcher.direct == 1
    run_sync(notary.query_server("remote.test", None, [str(clock.now + 3600_000)]))
    assert fetcher.direct == 1
    clock.now += 61_000
    run_sync(notary.query_body({"server_keys": {"remote.test": {"ed25519:r1": {
        "minimum_valid_until_ts": clock.now + 2 * DAY}}}}))
    assert fetcher.direct == 2
    assert run_sync(notary.query_server("not a name", None, [])) == {"server_keys": []}
    [own] = run_sync(notary.query_server("ours.test", None, []))["server_keys"]
    assert own["server_name"] == "ours.test"
