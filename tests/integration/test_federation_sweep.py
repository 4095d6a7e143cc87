"""A Hypothesis sweep of every federation endpoint with malformed input, against a real process.

For each endpoint (``ENDPOINTS``; a test checks it covers every route ``servlets.py`` registers)
Hypothesis builds requests from hostile path parameters, query parameters, bodies and
``Authorization`` headers (signed by the test peer's key over the body, unsigned, forged, or
naming an origin that is no server name) and sends them raw. Every answer must be below 500,
every 4xx a Matrix error JSON (``errcode`` and ``error`` strings), and a refused request must
leave the database as it was (row counts of the event, state, membership and transaction
tables). Seeded (``derandomize``) and bounded: ``TRIBUTARY_SWEEP_EXAMPLES`` examples per endpoint
(20 by default, so it stays quick in ``make test``); raise it by hand for a longer run."""

# tests: homeserver/http/federation/servlets.py homeserver/federation/requests.py storage/kernel/json_input.py

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any, Final

import attrs
import psycopg2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from homeserver.http.federation import servlets as federation_servlets
from homeserver.http.routes import ROUTES_ATTRIBUTE
from tests.federation_peer import FederationPeer
from tests.integration.test_federation_input import (
    RawAnswer,
    Server,
    counted_rows,
    joined_room,
    quote,
    server,
    tributary,
    x_matrix,
)
from tests.twisted_plugin import reactor, run_sync

__all__ = ["server", "tributary"]

EXAMPLES: Final = int(os.environ.get("TRIBUTARY_SWEEP_EXAMPLES", "20"))
F1 = "/_matrix/federation/v1"
F2 = "/_matrix/federation/v2"
K2 = "/_matrix/key/v2"

# (method, path template): every route of servlets.py, plus spec endpoints we do not serve
# (they must still answer a Matrix 404/405, never a 5xx).
ENDPOINTS: Final = [
    ("GET", F1 + "/version"),
    ("GET", K2 + "/server"),
    ("GET", K2 + "/server/{key_id}"),
    ("POST", K2 + "/query"),
    ("GET", K2 + "/query/{server}"),
    ("GET", K2 + "/query/{server}/{key_id}"),
    ("GET", F1 + "/make_join/{room_id}/{user_id}"),
    ("PUT", F2 + "/send_join/{room_id}/{event_id}"),
    ("GET", F1 + "/make_leave/{room_id}/{user_id}"),
    ("PUT", F2 + "/send_leave/{room_id}/{event_id}"),
    ("GET", F1 + "/make_knock/{room_id}/{user_id}"),
    ("PUT", F1 + "/send_knock/{room_id}/{event_id}"),
    ("PUT", F1 + "/invite/{room_id}/{event_id}"),
    ("PUT", F2 + "/invite/{room_id}/{event_id}"),
    ("GET", F1 + "/state/{room_id}"),
    ("GET", F1 + "/state_ids/{room_id}"),
    ("GET", F1 + "/event/{event_id}"),
    ("GET", F1 + "/event_auth/{room_id}/{event_id}"),
    ("GET", F1 + "/backfill/{room_id}"),
    ("POST", F1 + "/get_missing_events/{room_id}"),
    ("PUT", F1 + "/send/{txn_id}"),
    ("GET", F1 + "/query/profile"),
    ("GET", F1 + "/query/directory"),
    ("GET", F1 + "/user/devices/{user_id}"),
    ("POST", F1 + "/user/keys/query"),
    ("POST", F1 + "/user/keys/claim"),
    ("GET", F1 + "/publicRooms"),
    ("POST", F1 + "/publicRooms"),
    ("PUT", F1 + "/3pid/onbind"),
    ("PUT", F1 + "/exchange_third_party_invite/{room_id}"),
]

ODD_SEGMENTS: Final = ["%00", "%FF", "%ED%A0%80", "x" * 300, "..", "%20", "@", "!", "$", "@a:b:c", "!r%00:hs",
                       "%24e%00", "%40u%3A" + "a" * 64 + ".org", "!r:" + "a" * 64, "%E2%9C%93", "-1",
                       "99999999999999999999", "ed25519:%00", "ed25519:", "[::1", "a..b", "%0A", "%5C"]
QUERY_NAMES: Final = ["event_id", "v", "limit", "user_id", "field", "room_alias", "ver", "minimum_valid_until_ts"]
ODD_QUERY_VALUES: Final = ["", "%00", "%FF", "%ED%A0%80", "-1", "1.5", "1e400", "99999999999999999999999",
                           "x" * 300, "%24e", "%40u%3Ahs", "%23a%3Ahs", "displayname", "12", "%0A", "%2524"]
FIELDS: Final = [
    "pdus", "edus", "origin", "origin_server_ts", "earliest_events", "latest_events", "limit", "min_depth",
    "event", "room_version", "invite_room_state", "device_keys", "one_time_keys", "server_keys", "type",
    "content", "sender", "room_id", "state_key", "prev_events", "auth_events", "depth", "hashes",
    "signatures", "edu_type", "membership", "redacts", "unsigned",
]  # fmt: skip
ODD_STRINGS: Final = ["", "\x00", "\ud800", "é✓😀", "@:", "!", "$", "m.room.member", "join", "12", "m.typing",
                      "x" * 2000, "@u:" + "a" * 64 + ".org"]
# Raw JSON fragments Python's json.dumps cannot produce; substituted for marker strings.
RAW_FRAGMENTS: Final = {"__INF__": "1e400", "__NAN__": "NaN", "__SURROGATE__": '"\\udc00"',
                        "__BIGINT__": "9007199254740993", "__FLOAT__": "1.5", "__NUL__": '"a\\u0000b"'}
BROKEN_BODIES: Final = [b"", b"not json", b"\xff\xfe", b"[]", b"null", b"123", b'"s"', b'{"a":', b"{" * 3000,
                        b"[" * 150 + b"]" * 150, b'{"a": 1, "a": 2}', b'{"a": ' + b"1" * 5000 + b"}",
                        b" " * 200_000]


@attrs.frozen
class Fixture:
    server: Server
    peer: FederationPeer
    origin: str
    room_id: str
    event_id: str
    counts: Any  # a psycopg2 connection in autocommit mode, kept for the row counts of every example


@pytest.fixture(scope="module")
def sweep(server: Server) -> Iterator[Fixture]:
    """A peer with one virtual server, joined to a public room on the real server (so the valid
    identifiers the sweep mixes in reach the handlers' deeper paths)."""
    peer = FederationPeer(reactor, request_timeout_seconds=10)
    counts = psycopg2.connect(server.dsn)
    counts.autocommit = True
    try:
        [origin] = run_sync(peer.start(1))
        room_id, join = run_sync(joined_room(server, peer, origin, "sweep_owner"))
        yield Fixture(server, peer, origin, room_id, join, counts)
    finally:
        counts.close()
        run_sync(peer.stop())


def _json_value(depth: int = 0) -> st.SearchStrategy[Any]:
    scalars = st.sampled_from([None, True, False, 0, -1, 2**53 - 1, [], {}]) | st.sampled_from(ODD_STRINGS) \
        | st.sampled_from(sorted(RAW_FRAGMENTS)) | st.integers(-10, 10**6)
    if depth >= 2:
        return scalars
    child = st.deferred(lambda: _json_value(depth + 1))
    return scalars | st.lists(child, max_size=4) | st.dictionaries(st.sampled_from(FIELDS), child, max_size=5)


def _encode(value: Any) -> bytes:
    text = json.dumps(value, ensure_ascii=True)
    for marker, fragment in RAW_FRAGMENTS.items():
        text = text.replace(json.dumps(marker), fragment)
    return text.encode("utf-8")


@attrs.frozen
class Attempt:
    segments: tuple[str, ...]
    query: tuple[tuple[str, str], ...]
    body: bytes | None
    auth: str  # "signed", "unsigned", "bad_origin", "garbage"


def attempts(fixture: Fixture, method: str, template: str) -> st.SearchStrategy[Attempt]:
    """Requests for one endpoint: each path and query parameter is mostly the right kind of valid
    value (so requests reach the handlers), otherwise something hostile."""
    right = {"room_id": fixture.room_id, "event_id": fixture.event_id, "user_id": f"@u:{fixture.origin}",
             "server": fixture.origin, "key_id": "ed25519:a_1", "txn_id": "t1", "v": fixture.event_id,
             "limit": "5", "field": "displayname", "room_alias": f"#a:{fixture.server.tributary.server_name}",
             "ver": "12", "minimum_valid_until_ts": "0"}
    valid = sorted(quote(v) for v in right.values())
    odd = st.sampled_from(ODD_SEGMENTS) | st.sampled_from(valid) | st.text(max_size=20).map(quote)

    def param(name: str, odd_values: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        good = right.get(name)
        if good is None:
            return odd_values
        return st.one_of(*[st.just(quote(good))] * 3, odd_values)

    names = re.findall(r"\{(\w+)\}", template)
    query_value = st.sampled_from(ODD_QUERY_VALUES) | st.sampled_from(valid)
    query_pair = st.sampled_from(QUERY_NAMES).flatmap(lambda n: st.tuples(st.just(n), param(n, query_value)))
    bodies: st.SearchStrategy[bytes | None]
    if method in ("PUT", "POST"):
        bodies = st.sampled_from(BROKEN_BODIES) | _json_value().map(_encode) \
            | st.dictionaries(st.sampled_from(FIELDS), _json_value(1), min_size=1, max_size=6).map(_encode)
    else:
        bodies = st.none()
    return st.builds(
        Attempt,
        segments=st.tuples(*[param(n, odd) for n in names]),
        query=st.lists(query_pair, max_size=4).map(tuple),
        body=bodies,
        auth=st.sampled_from(["signed", "signed", "signed", "unsigned", "bad_origin", "garbage"]),
    )


def _uri(template: str, attempt: Attempt) -> str:
    names = re.findall(r"\{(\w+)\}", template)
    path = template
    for name, value in zip(names, attempt.segments):
        path = path.replace("{" + name + "}", value)
    if attempt.query:
        path += "?" + "&".join(f"{k}={v}" for k, v in attempt.query)
    return path


async def _send(fixture: Fixture, method: str, uri: str, attempt: Attempt) -> RawAnswer:
    raw = fixture.server.raw
    headers: dict[str, str] = {}
    if attempt.auth == "garbage":
        headers["Authorization"] = 'X-Matrix origin="\x01",key=,sig="!!"'
    elif attempt.auth != "unsigned":
        header = x_matrix(fixture.peer, fixture.origin, raw.destination, method, uri, attempt.body)
        if attempt.auth == "bad_origin":
            header = header.replace(f'origin="{fixture.origin}"', 'origin="' + "a" * 64 + '.org"')
        headers["Authorization"] = header
    return await raw.request(method, uri, attempt.body, headers=headers)


def check_answer(answer: RawAnswer, what: str) -> None:
    assert answer.status < 500, f"{what} -> {answer.status} {str(answer.body)[:300]}"
    if answer.status >= 400:
        body = answer.body
        assert isinstance(body, dict) and isinstance(body.get("errcode"), str) \
            and isinstance(body.get("error"), str), f"{what} -> {answer.status} without Matrix error JSON: {body!r:.300}"


@pytest.mark.parametrize(("method", "template"), ENDPOINTS, ids=[f"{m} {t}" for m, t in ENDPOINTS])
def test_malformed_requests_never_5xx_and_change_nothing(sweep: Fixture, method: str, template: str) -> None:
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(attempts(sweep, method, template))
    def run(attempt: Attempt) -> None:
        uri = _uri(template, attempt)
        what = f"{method} {uri[:200]} auth={attempt.auth} body={(attempt.body or b'')[:120]!r}"
        before = counted_rows(sweep.counts)
        answer = run_sync(_send(sweep, method, uri, attempt))
        check_answer(answer, what)
        if answer.status >= 400:
            assert counted_rows(sweep.counts) == before, f"{what} -> {answer.status} but the database changed"

    run()


def test_endpoints_cover_every_federation_route() -> None:
    """Every route homeserver/http/federation/servlets.py declares is matched by some entry of
    ``ENDPOINTS`` (the directory and media servlets are swept by their own tests)."""
    patterns = [
        (declaration.method, re.compile(declaration.path))
        for servlet in vars(federation_servlets).values()
        if isinstance(servlet, type) and servlet.__module__ == federation_servlets.__name__
        for handler in vars(servlet).values()
        for declaration in getattr(handler, ROUTES_ATTRIBUTE, ())
    ]
    assert len(patterns) > 20
    filled = [(m, re.sub(r"\{(\w+)\}", "x", t)) for m, t in ENDPOINTS]
    for method, pattern in patterns:
        assert any(m == method and pattern.fullmatch(path) for m, path in filled), (method, pattern.pattern)


def test_the_server_logged_no_error(sweep: Fixture) -> None:
    """Runs after the sweep (file order): no request made the server log an ERROR or a traceback,
    which is how a bug caught broadly (an EDU handler's, a background task's) would show."""
    log = sweep.server.tributary.process.log_path.read_text(encoding="utf-8", errors="replace")
    bad = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not bad, "\n".join(bad[:20])
