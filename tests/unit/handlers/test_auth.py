"""Access tokens from requests, the token cache and its invalidation, and password hashing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.web.test.requesthelper import DummyRequest

from homeserver.handlers.accounts.auth import (
    Auth,
    PasswordHasher,
    access_token_from_request,
    generate_access_token,
    generate_device_id,
    hash_access_token,
)
from storage.kernel.errors import MatrixError
from storage.stores.accounts import TokenOwner


def _request(headers: list[bytes] | None = None, query: list[bytes] | None = None) -> DummyRequest:
    request = DummyRequest([b""])
    for value in headers or []:
        request.requestHeaders.addRawHeader(b"Authorization", value)
    if query is not None:
        request.args[b"access_token"] = query
    return request


def _errcode(call: Callable[[], Any]) -> str:
    with pytest.raises(MatrixError) as caught:
        call()
    assert caught.value.status == 401
    return caught.value.errcode


def test_token_from_header_or_query() -> None:
    assert access_token_from_request(_request([b"Bearer abc"])) == "abc"
    assert access_token_from_request(_request([b"bearer  abc "])) == "abc"
    assert access_token_from_request(_request(query=[b"xyz"])) == "xyz"
    assert access_token_from_request(_request()) is None


def test_malformed_tokens() -> None:
    assert _errcode(lambda: access_token_from_request(_request([b"Basic dXNlcg=="]))) == "M_MISSING_TOKEN"
    assert _errcode(lambda: access_token_from_request(_request([b"Bearer"]))) == "M_MISSING_TOKEN"
    assert _errcode(lambda: access_token_from_request(_request([b"Bearer a"], [b"a"]))) == "M_MISSING_TOKEN"
    assert _errcode(lambda: access_token_from_request(_request(query=[b"a", b"b"]))) == "M_MISSING_TOKEN"
    assert _errcode(lambda: access_token_from_request(_request([b"Bearer \xff\xfe"]))) == "M_UNKNOWN_TOKEN"
    assert _errcode(lambda: access_token_from_request(_request(query=[b"x" * 600]))) == "M_UNKNOWN_TOKEN"


def test_generated_values() -> None:
    tokens = {generate_access_token() for _ in range(100)}
    assert len(tokens) == 100 and all(t.startswith("trb_") and len(t) > 40 for t in tokens)
    assert len(hash_access_token("abc")) == 32
    device = generate_device_id()
    assert len(device) == 10 and device.isalpha() and device.isupper()


class FakeAccounts:
    """Token lookups answered by hand, to order them against invalidations."""

    def __init__(self) -> None:
        self.tokens: dict[bytes, TokenOwner] = {}
        self.lookups = 0
        self.pending: list[tuple[bytes, Deferred[TokenOwner | None]]] = []
        self.hold = False

    async def get_token_owner(self, digest: bytes) -> TokenOwner | None:
        self.lookups += 1
        if not self.hold:
            return self.tokens.get(digest)
        d: Deferred[TokenOwner | None] = Deferred()
        self.pending.append((digest, d))
        return await d


class FakeDevices:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, str | None]] = []

    async def update_last_seen(self, user_id: str, device_id: str, now_ms: int, ip: str | None) -> None:
        self.seen.append((user_id, device_id, now_ms, ip))


def _auth(cache_size: int = 100) -> tuple[Auth, FakeAccounts]:
    accounts = FakeAccounts()
    auth = Auth(accounts, FakeDevices(), clock=lambda: 1.0, cache_size=cache_size)  # type: ignore[arg-type]
    return auth, accounts


async def test_lookups_are_cached_and_invalidated() -> None:
    auth, accounts = _auth()
    accounts.tokens[hash_access_token("t1")] = TokenOwner(7, "@a:hs", "DEV", False)
    requester = await auth.get_user_by_access_token("t1")
    assert (requester.user_id, requester.device_id, requester.access_token_id) == ("@a:hs", "DEV", 7)
    await auth.get_user_by_access_token("t1")
    assert accounts.lookups == 1
    del accounts.tokens[hash_access_token("t1")]
    auth.invalidate_token_hashes([hash_access_token("t1")])
    with pytest.raises(MatrixError) as caught:
        await auth.get_user_by_access_token("t1")
    assert caught.value.to_json() == {
        "errcode": "M_UNKNOWN_TOKEN",
        "error": "Unknown or expired access token",
        "soft_logout": False,
    }


async def test_a_lookup_racing_a_logout_does_not_cache_the_revoked_token() -> None:
    """The lookup reads the token row, then the logout commits and invalidates,
    then the lookup finishes: it may answer, but must not cache the dead token."""
    auth, accounts = _auth()
    digest = hash_access_token("t1")
    accounts.tokens[digest] = TokenOwner(1, "@a:hs", "DEV", False)
    accounts.hold = True
    racing = Deferred.fromCoroutine(auth.get_user_by_access_token("t1"))
    (_, read), = accounts.pending
    del accounts.tokens[digest]
    auth.invalidate_token_hashes([digest])
    read.callback(TokenOwner(1, "@a:hs", "DEV", False))
    assert (await racing).user_id == "@a:hs"
    accounts.hold = False
    with pytest.raises(MatrixError):
        await auth.get_user_by_access_token("t1")
    assert accounts.lookups == 2


async def test_cache_is_bounded() -> None:
    auth, accounts = _auth(cache_size=3)
    for i in range(5):
        accounts.tokens[hash_access_token(f"t{i}")] = TokenOwner(i, "@a:hs", f"D{i}", False)
        await auth.get_user_by_access_token(f"t{i}")
    lookups = accounts.lookups
    await auth.get_user_by_access_token("t4")
    assert accounts.lookups == lookups
    await auth.get_user_by_access_token("t0")
    assert accounts.lookups == lookups + 1


async def _run(func: Callable[..., Any], *args: Any) -> Any:
    return func(*args)


async def test_password_hashing() -> None:
    hasher = PasswordHasher(4, _run)
    stored = await hasher.hash("correct horse")
    assert stored.startswith("$2b$04$")
    assert await hasher.verify("correct horse", stored)
    assert not await hasher.verify("correct horsE", stored)
    assert not await hasher.verify("correct horse", None)
    assert not await hasher.verify("correct horse", "not a bcrypt hash")


async def test_long_and_odd_passwords_keep_all_their_characters() -> None:
    """bcrypt alone reads 72 bytes; the digest in front makes every character count."""
    hasher = PasswordHasher(4, _run)
    long = "x" * 200
    stored = await hasher.hash(long + "a")
    assert await hasher.verify(long + "a", stored)
    assert not await hasher.verify(long + "b", stored)
    for odd in ["\x00nul", "lone \ud800 surrogate", "ünïcödé 😀"]:
        assert await hasher.verify(odd, await hasher.hash(odd))
    assert not await hasher.verify("\x00nul", await hasher.hash("\x00nuL"))
