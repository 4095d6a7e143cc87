"""Malformed input to every account endpoint: never a 5xx, never an error in the server log.

Every route this package registers is listed in ``ENDPOINTS`` (a test checks
the router has no client route missing from it). Each endpoint gets broken
bodies (not JSON, bad UTF-8, wrong JSON types, too deep, too large), random
objects built from every field name the endpoints read with values of every
JSON type, odd path parameters (NUL, bad UTF-8, surrogates, huge) and odd
access tokens. Each endpoint runs as a fresh user, so a fuzzed logout or
password change cannot spoil the next endpoint. The random source is seeded.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from homeserver.http.routes import Gated
from homeserver.http.server import Route
from tests.integration.test_client_support import SERVER_NAME, Client, running_server

ROOM_MODULES: Final = (
    "homeserver.http.client_api.rooms",
    "homeserver.http.client_api.sync",
    "homeserver.http.client_api.e2e",
    "homeserver.http.client_api.relations",
    "homeserver.http.client_api.directory",
    "homeserver.http.client_api.search",
    "homeserver.http.client_api.room_upgrade",
    # Media answers with bytes, not JSON: its hostile input is in test_media.py.
    "homeserver.http.client_api.media",
)

ENDPOINTS: Final = [
    ("GET", "/_matrix/client/versions"),
    ("POST", "register"),
    ("GET", "register/available"),
    ("GET", "/_matrix/client/v1/register/m.login.registration_token/validity"),
    ("GET", "login"),
    ("POST", "login"),
    ("POST", "logout"),
    ("POST", "logout/all"),
    ("GET", "account/whoami"),
    ("POST", "account/password"),
    ("POST", "account/deactivate"),
    ("GET", "account/3pid"),
    ("POST", "account/3pid/add"),
    ("POST", "account/3pid/bind"),
    ("POST", "account/3pid/delete"),
    ("POST", "account/3pid/unbind"),
    ("POST", "account/3pid/email/requestToken"),
    ("POST", "account/3pid/msisdn/requestToken"),
    ("POST", "register/email/requestToken"),
    ("POST", "register/msisdn/requestToken"),
    ("POST", "account/password/email/requestToken"),
    ("POST", "account/password/msisdn/requestToken"),
    ("GET", "devices"),
    ("GET", "devices/{device}"),
    ("PUT", "devices/{device}"),
    ("DELETE", "devices/{device}"),
    ("POST", "delete_devices"),
    ("GET", "profile/{user}"),
    ("GET", "profile/{user}/displayname"),
    ("PUT", "profile/{user}/displayname"),
    ("GET", "profile/{user}/avatar_url"),
    ("PUT", "profile/{user}/avatar_url"),
    ("GET", "user/{user}/account_data/{type}"),
    ("PUT", "user/{user}/account_data/{type}"),
    ("GET", "user/{user}/rooms/{room}/account_data/{type}"),
    ("PUT", "user/{user}/rooms/{room}/account_data/{type}"),
    ("POST", "user/{user}/filter"),
    ("GET", "user/{user}/filter/{filter}"),
    ("GET", "capabilities"),
    ("GET", "pushrules/"),
    ("GET", "pushrules/global/"),
    ("GET", "pushrules/global/override/{type}"),
    ("PUT", "pushrules/global/override/{type}"),
    ("DELETE", "pushrules/global/override/{type}"),
    ("PUT", "pushrules/global/room/{room}"),
    ("GET", "pushrules/global/override/{type}/enabled"),
    ("PUT", "pushrules/global/override/{type}/enabled"),
    ("GET", "pushrules/global/underride/{type}/actions"),
    ("PUT", "pushrules/global/underride/{type}/actions"),
    ("GET", "pushers"),
    ("POST", "pushers/set"),
    ("GET", "notifications"),
    ("GET", "/.well-known/matrix/client"),
    ("POST", "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync"),
    ("POST", "/_matrix/client/v1/appservice/{type}/ping"),
    ("GET", "thirdparty/protocols"),
    *(("GET", f"thirdparty/{kind}") for kind in ("protocol/{type}", "location/{type}", "user/{type}", "location",
                                                   "user")),
    ("GET", "room_keys/version"),
    ("POST", "room_keys/version"),
    *((m, "room_keys/version/{filter}") for m in ("GET", "PUT", "DELETE")),
    *((m, f"room_keys/keys{tail}") for m in ("GET", "PUT", "DELETE") for tail in ("", "/{room}", "/{room}/{type}")),
]

FIELDS: Final = [
    "username", "password", "device_id", "initial_device_display_name", "inhibit_login", "refresh_token",
    "auth", "type", "identifier", "user", "medium", "address", "token", "new_password", "logout_devices",
    "display_name", "devices", "displayname", "avatar_url", "event_fields", "event_format", "presence",
    "account_data", "room", "session", "client_secret", "sid", "send_attempt", "email", "country",
    "phone_number", "id_server", "id_access_token", "next_link", "actions", "conditions", "pattern", "enabled",
    "kind", "app_id", "pushkey", "data", "append", "lang", "app_display_name", "device_display_name",
    "lists", "ranges", "room_subscriptions", "required_state", "timeline_limit", "filters", "extensions",
    "conn_id", "unsubscribe_rooms",
]  # fmt: skip

ODD_STRINGS: Final = ["", " ", "x" * 70_000, "\x00", "\ud800", "é✓😀", "@:", "!", "m.login.dummy",
                      "m.login.password", "m.id.user", "m.id.thirdparty", "mxc://", "mxc://hs/x", "client",
                      "{}", "0", "-1", "99999999999999999999999"]  # fmt: skip
ODD_VALUES: Final[list[Any]] = [None, True, False, 0, -1, 2**64, 1.5, 1e308, [], {}, [None], [1, "a"], {"a": None}]

ODD_SEGMENTS: Final = ["%00", "%FF", "%ED%A0%80", "x" * 3000, "%2F", "..", "%20", "@", "!", "@a:b:c",
                       "%40nobody%3Aelsewhere", "%E2%9C%93", "-1", "99999999999999999999", "m.push_rules",
                       "m.fully_read"]  # fmt: skip

BROKEN_BODIES: Final = [
    b"",
    b"not json",
    b"\xff\xfe\xfd",
    b'{"a": "\xff"}',
    b"[]",
    b"null",
    b"123",
    b'"string"',
    b'{"a":',
    b"{" * 5000,
    b"[" * 150 + b"]" * 150,
    b'{"a": NaN}',
    b'{"a": 1e400}',
    b'{"a": "\\ud800"}',
    b'{"a": ' + b"1" * 5000 + b"}",
    json.dumps({"a": "x" * 900_000}).encode(),
    b" " * 2_000_000,
]


def odd_value(rng: random.Random, fields: list[str], strings: list[str], depth: int = 0) -> Any:
    """A random JSON value of wrong types, odd strings from ``strings`` and objects keyed by ``fields``."""
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(strings)
    if roll < 0.75 or depth > 2:
        return rng.choice(ODD_VALUES)
    if roll < 0.9:
        return {rng.choice(fields): odd_value(rng, fields, strings, depth + 1) for _ in range(rng.randint(1, 4))}
    return [odd_value(rng, fields, strings, depth + 1) for _ in range(rng.randint(0, 3))]


def _odd_value(rng: random.Random) -> Any:
    return odd_value(rng, FIELDS, ODD_STRINGS)


def _random_body(rng: random.Random, user_id: str) -> dict[str, Any]:
    body = {field: _odd_value(rng) for field in rng.sample(FIELDS, rng.randint(1, 6))}
    if rng.random() < 0.5:
        # Auth dicts that get past the first checks, to reach the stage checkers.
        body["auth"] = {
            "type": rng.choice(["m.login.dummy", "m.login.password", "m.login.sso", _odd_value(rng)]),
            "identifier": rng.choice([{"type": "m.id.user", "user": user_id}, _odd_value(rng)]),
            "password": rng.choice(["wrong", _odd_value(rng)]),
            **({"session": _odd_value(rng)} if rng.random() < 0.5 else {}),
        }
    return body


def _paths(template: str, user_id: str, rng: random.Random) -> Iterator[str]:
    values = {"user": user_id, "device": "FUZZDEV", "room": "!room:test.local", "type": "m.example", "filter": "0"}
    yield template.format(**values)
    for name in values:
        if "{" + name + "}" in template:
            for segment in ODD_SEGMENTS:
                yield template.format(**{**values, name: segment})
    if "?" not in template:
        for query in ["kind=%FF", "kind=guest", "username=%FF", "username=", "username=" + "a" * 5000,
                      "access_token=%FF", "access_token=" + "t" * 10_000, "filter=%00", "before=%FF",
                      "after=" + "a" * 5000, "from=%FF", "from=99999999999999999999", "limit=-1", "limit=x",
                      "only=highlight"]:  # fmt: skip
            yield f"{template.format(**values)}?{query}"


class ErrorLogCounter(logging.Handler):
    """Collects ERROR records of the server's own code (and Twisted's, which logs
    unhandled errors of request processing). Other libraries' records, such as an
    earlier test's HTTP client being garbage-collected, are not the server's."""

    OURS = ("homeserver", "storage", "replication", "federation_sender", "workers", "twisted")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] in self.OURS:
            self.records.append(record)


def servlet_module(route: Route) -> str:
    """The module that declares ``route``'s handler (the gate's wrapper names its endpoint)."""
    handler = route.handler
    return handler.endpoint.handler.__module__ if isinstance(handler, Gated) else handler.__module__


def _url(path: str) -> str:
    return path if path.startswith("/") else "/_matrix/client/v3/" + path


@pytest.mark.timeout(120)
async def test_malformed_input_never_causes_a_server_error(database_dsn: str, tmp_path: Path) -> None:
    rng = random.Random(20240601)
    errors = ErrorLogCounter()
    logging.getLogger().addHandler(errors)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    try:
        async with running_server(database_dsn, tmp_path, public_baseurl="https://hs.example/") as (hs, client):
            # Every route this package registers is in ENDPOINTS, and nothing else is.
            # Room and sync routes are fuzzed by test_client_rooms_fuzz.py.
            ours = [
                r
                for r in hs.router._routes
                if servlet_module(r).startswith("homeserver.http.client_api")
                and servlet_module(r) not in ROOM_MODULES
            ]
            samples = [(m, _url(t.format(user="@a:b", device="D", room="!r:b", type="t", filter="0"))) for m, t in ENDPOINTS]
            for route in ours:
                assert any(m == route.method and route.pattern.fullmatch(p) for m, p in samples), route
            for method, path in samples:
                assert any(r.method == method and r.pattern.fullmatch(path) for r in ours), (method, path)

            for index, (method, template) in enumerate(ENDPOINTS):
                localpart = f"fuzz{index}"
                token = (await client.register_ok(localpart, device_id="FUZZDEV"))["access_token"]
                user_id = f"@{localpart}:{SERVER_NAME}"
                sent = 0

                async def send(path: str, raw: bytes | None, who: str | None, headers: dict[str, str] | None = None) -> None:
                    nonlocal sent
                    sent += 1
                    response = await client.request(method, _url(path), raw=raw, token=who, headers=headers)
                    body = response.body
                    statuses[response.status] = statuses.get(response.status, 0) + 1
                    well_formed = isinstance(body, dict) and (
                        response.status < 400 or "errcode" in body or (response.status == 401 and "flows" in body)
                    ) or (isinstance(body, list) and response.status == 200 and "thirdparty/" in path)  # spec: arrays
                    # A remote user's profile is asked of its server; one that cannot be reached
                    # (``elsewhere`` does not resolve) is 502 M_UNKNOWN, as Synapse answers: not a fault.
                    unreachable = response.status == 502 and "elsewhere" in path and isinstance(body, dict) \
                        and body.get("errcode") == "M_UNKNOWN"
                    if (response.status >= 500 and not unreachable) or not well_formed:
                        failures.append(f"{method} {path[:120]} body={(raw or b'')[:80]!r} -> {response.status} {str(response.body)[:200]}")

                for path in _paths(template, user_id, rng):
                    await send(path, b"{}", token)
                base = next(_paths(template, user_id, rng))
                for raw in BROKEN_BODIES:
                    if len(raw) > 100_000 and method == "GET":
                        continue  # GET handlers read no body; the size limit is tested on the others
                    await send(base, raw, token)
                for _ in range(25):
                    await send(base, json.dumps(_random_body(rng, user_id)).encode(), token)
                for who in [None, "", "x" * 5000, "trb_unknown", "é"]:
                    if who == "é":
                        await send(base, b"{}", None, {"Authorization": "Bearer é"})
                    else:
                        await send(base, b"{}", who)
                await send(base, b"{}", None, {"Authorization": "Basic Zm9vOmJhcg=="})
                await send(base + ("&" if "?" in base else "?") + f"access_token={token}", b"{}", token)
                assert sent > 40
    finally:
        logging.getLogger().removeHandler(errors)
    assert failures == [], "\n".join(failures[:30])
    # The inputs reached past parsing: successes, every kind of refusal, and the size limit.
    assert {200, 400, 401, 403, 404, 405, 413} <= set(statuses), statuses
    assert [r.getMessage() for r in errors.records] == []
