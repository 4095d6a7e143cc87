"""Issue 18's input findings against a real ``tributary`` process and the signing test peer: a
``/send`` body with ``1e400`` or a lone surrogate outside its PDUs and EDUs is a 400 (the
X-Matrix check used to crash re-encoding it) while inside one PDU it is that PDU's error alone, ``make_join`` with a NUL in the room ID is a 400 that never reaches
PostgreSQL, ``get_missing_events`` with fields of the wrong type is a 400 naming the field, an
X-Matrix origin with a 64-character DNS label is refused at once, and a PDU citing 1,300
``prev_events`` is reported as an error in the ``/send`` answer and never stored.

``RawFederation`` sends bytes exactly as given (any body, path, headers), signed with a peer
server's key or not; ``tests/integration/test_federation_sweep.py`` drives it with Hypothesis."""

# tests: homeserver/federation/requests.py storage/kernel/json_input.py homeserver/events/identifiers.py

from __future__ import annotations

import http.client
import json
import ssl
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote as _quote

import attrs
import psycopg2
import pytest
import yaml
from twisted.internet.threads import deferToThread

from homeserver.events import EventTemplate, build_pdu, select_auth_event_ids
from homeserver.events.hashing import compute_event_id
from homeserver.events.builder import add_hashes_and_signature
from homeserver.events.canonical import encode_canonical
from homeserver.remote.request_auth import sign_encoded_request, sign_request
from tests.federation_peer import FederationPeer
from tests.integration.test_federation_peer import Tributary, make_peer, started_peer, tributary
from tests.twisted_plugin import reactor

__all__ = ["make_peer", "tributary"]

FED_V1 = "/_matrix/federation/v1"
# Tables whose row counts must not change when a request is refused.
COUNTED_TABLES = ("events", "event_edges", "event_auth", "state_groups", "state_groups_state", "room_memberships",
                  "current_state_events", "event_forward_extremities", "event_redactions", "received_transactions",
                  "remote_invites", "receipts", "device_lists_stream")


def quote(value: str) -> str:
    return _quote(value, safe="")


@attrs.frozen
class RawAnswer:
    status: int
    body: Any
    seconds: float


def _unverified_context() -> ssl.SSLContext:
    """TLS without certificate checks (the test server's certificate is self-signed), made once:
    ``ssl.create_default_context`` loads the system's CA certificates, which these requests
    never use, and a sweep makes hundreds of them."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


_UNVERIFIED = _unverified_context()


@attrs.frozen
class RawFederation:
    """Raw HTTPS requests to a Tributary's federation listener, in a thread so the reactor (and the
    peer's key server on it) keeps running while we wait."""

    port: int
    destination: str

    def _send(self, method: str, uri: str, body: bytes | None, headers: Mapping[str, str]) -> RawAnswer:
        start = time.monotonic()
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=_UNVERIFIED, timeout=60)
        try:
            conn.putrequest(method, uri, skip_host=True, skip_accept_encoding=True)
            conn.putheader("Host", self.destination)
            for name, value in headers.items():
                conn.putheader(name, value)
            if body is not None:
                conn.putheader("Content-Type", "application/json")
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            raw = response.read()
            status = response.status
        finally:
            conn.close()
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw
        return RawAnswer(status, parsed, time.monotonic() - start)

    async def request(self, method: str, uri: str, body: bytes | None = None, *,
                      signer: tuple[FederationPeer, str] | None = None, origin: str | None = None,
                      headers: Mapping[str, str] | None = None) -> RawAnswer:
        """Send ``body`` as is. With ``signer`` (peer, server), an X-Matrix header signed by that
        server's key over the body as Python's lenient JSON reads it (unsigned content when it
        cannot be encoded); ``origin`` overrides the header's origin (the signature is then wrong)."""
        all_headers = dict(headers or {})
        if signer is not None:
            peer, server = signer
            all_headers["Authorization"] = x_matrix(peer, server, self.destination, method, uri, body, origin=origin)
        answer: RawAnswer = await deferToThread(self._send, method, uri, body, all_headers)
        return answer


def x_matrix(peer: FederationPeer, server: str, destination: str, method: str, uri: str, body: bytes | None,
             *, origin: str | None = None) -> str:
    content: Any = None
    if body is not None:
        try:
            content = json.loads(body)
        except ValueError:
            content = None
    try:
        header = sign_request(method, uri, server, destination, content, peer.signing_key(server))
    except (ValueError, UnicodeEncodeError):  # inf or a lone surrogate: canonical JSON refuses it
        header = sign_request(method, uri, server, destination, None, peer.signing_key(server))
    if origin is not None:
        header = header.replace(f'origin="{server}"', f'origin="{origin}"')
    return header


def row_counts(dsn: str) -> dict[str, int]:
    """Rows of every table in ``COUNTED_TABLES``, in one query, on a connection of its own."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        return counted_rows(conn)
    finally:
        conn.close()


def counted_rows(conn: Any) -> dict[str, int]:
    """``row_counts`` on an open connection in autocommit mode (so each count is current)."""
    with conn.cursor() as cur:
        # Table names come from the constant above, never from input.
        cur.execute("SELECT " + ", ".join(f"(SELECT count(*) FROM {t})" for t in COUNTED_TABLES))
        row = cur.fetchone()
    assert row is not None
    return dict(zip(COUNTED_TABLES, (int(n) for n in row)))


def stored_event_count(dsn: str, event_id: str) -> int:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM events WHERE event_id = %s", (event_id,))
        row = cur.fetchone()
    conn.close()
    assert row is not None
    return int(row[0])


@attrs.frozen
class Server:
    tributary: Tributary
    dsn: str
    raw: RawFederation


@pytest.fixture(scope="module")
def server(tributary: Tributary) -> Server:
    """test_federation_peer's real ``tributary run`` (a TLS federation listener, loopback
    whitelisted), with its database DSN and a raw client for its federation port."""
    config = yaml.safe_load(tributary.process.config_path.read_text())
    port = int(tributary.server_name.rsplit(":", 1)[1])
    return Server(tributary, str(config["database"]["url"]), RawFederation(port, tributary.server_name))


async def joined_room(server: Server, peer: FederationPeer, peer_server: str, user: str) -> tuple[str, str]:
    """A public room created by a local user, joined by ``@u:peer_server``; (room ID, the join's ID)."""
    room_id, join, _ = await _owned_room(server, peer, peer_server, user)
    return room_id, join


async def _owned_room(server: Server, peer: FederationPeer, peer_server: str, user: str) -> tuple[str, str, str]:
    """``joined_room``, with the local user's access token."""
    client = server.tributary.client
    token = (await client.register_ok(user))["access_token"]
    created = await client.request("POST", "createRoom", {"preset": "public_chat"}, token=token)
    assert created.status == 200, created
    room_id = str(created.body["room_id"])
    join = await peer.join(peer_server, f"@u:{peer_server}", room_id, via=server.tributary.server_name)
    return room_id, join, token


@attrs.frozen
class PeerRoom:
    """A room of the server joined by the peer's ``sender``, for building that sender's messages."""

    peer: FederationPeer
    origin: str
    room_id: str
    join: str
    version: Any
    state: dict[tuple[str, str], str]
    depth: int  # the join's

    @property
    def sender(self) -> str:
        return f"@u:{self.origin}"

    def message(self, body: str, prev: list[str] | None = None, extra_auth: int = 0) -> dict[str, Any]:
        """A message after the join (or ``prev``), citing ``extra_auth`` made-up auth events too,
        hashed and signed directly: make_event (inside sign_pdu) would refuse the odd ones."""
        template = EventTemplate("m.room.message", {"msgtype": "m.text", "body": body})
        auth = select_auth_event_ids(self.version, template, self.sender, self.state)
        auth += [f"$fake{i}" for i in range(extra_auth)]
        pdu = build_pdu(self.version, template, sender=self.sender, room_id=self.room_id,
                        prev_event_ids=[self.join] if prev is None else prev, auth_event_ids=auth,
                        depth=self.depth + 1, origin_server_ts=int(reactor.seconds() * 1000))
        return add_hashes_and_signature(self.version, pdu, self.origin, self.peer.signing_key(self.origin))


async def peer_room(server: Server, peer: FederationPeer, origin: str, owner: str) -> tuple[PeerRoom, str]:
    """``joined_room`` as a ``PeerRoom``, with the owner's access token."""
    room_id, join, token = await _owned_room(server, peer, origin, owner)
    version = peer.room_version(room_id)
    assert version is not None
    client = peer.client(origin)
    answer = await client.get_json(server.tributary.server_name, f"{FED_V1}/state/{quote(room_id)}",
                                   query={"event_id": join})
    state = {(p["type"], p["state_key"]): peer._event_id(p) for p in answer["pdus"]}
    [join_pdu] = (await client.get_json(server.tributary.server_name, f"{FED_V1}/event/{quote(join)}"))["pdus"]
    state[("m.room.member", f"@u:{origin}")] = join  # /state answers the state before the join
    return PeerRoom(peer, origin, room_id, join, version, state, int(join_pdu["depth"])), token


def assert_matrix_error(answer: RawAnswer, status: int, errcode: str) -> None:
    assert (answer.status, answer.body.get("errcode") if isinstance(answer.body, dict) else answer.body) \
        == (status, errcode), answer
    assert isinstance(answer.body.get("error"), str)


@pytest.mark.timeout(120)
async def test_send_bodies_the_signature_check_cannot_encode_are_400(server: Server,
                                                                      make_peer: list[FederationPeer]) -> None:
    """``1e400`` overflows a float and ``"\\ud800"`` is no Unicode scalar: canonical JSON cannot
    encode either, and the X-Matrix check used to crash with a 500 re-encoding them. Signed or
    not, they are a 400 now, and nothing is written. (Inside one PDU or EDU, such a value is
    that entry's fault alone: see the next test.)"""
    peer, [origin] = await started_peer(make_peer, 1)
    before = row_counts(server.dsn)
    for body in (b'{"origin": "x", "pdus": [], "edus": [], "origin_server_ts": 1e400}',
                 b'{"pdus": [], "edus": "\\ud800"}',
                 b'{"pdus": [], "edus": [], "origin_server_ts": 9007199254740993}',
                 b'{"pdus": [], "pdus": [], "edus": []}'):
        for signer in ((peer, origin), None):
            answer = await server.raw.request("PUT", f"{FED_V1}/send/t{time.monotonic_ns()}", body, signer=signer)
            assert_matrix_error(answer, 400, "M_BAD_JSON")
    assert row_counts(server.dsn) == before


@pytest.mark.timeout(120)
async def test_identifiers_with_nul_never_reach_postgres(server: Server, make_peer: list[FederationPeer]) -> None:
    """``make_join`` with a NUL byte in the room ID used to fail inside PostgreSQL (a 500). Every
    identifier path and query parameter is checked by its grammar first: 400 M_INVALID_PARAM."""
    peer, [origin] = await started_peer(make_peer, 1)
    user = quote(f"@u:{origin}")
    cases = [
        ("GET", f"{FED_V1}/make_join/{quote('!room:hs')}%00/{user}"),
        ("GET", f"{FED_V1}/make_join/{quote('!room')}%00{quote(':hs')}/{user}"),
        ("GET", f"{FED_V1}/make_leave/{quote('!room:hs')}/%40u%00%3Ahs"),
        ("GET", f"{FED_V1}/event/%24e%00"),
        ("GET", f"{FED_V1}/state_ids/{quote('!room:hs')}?event_id=%24e%00"),
        ("GET", f"{FED_V1}/backfill/{quote('!room:hs')}?v=%24e%00&limit=5"),
        ("GET", f"{FED_V1}/query/profile?user_id=%40u%00%3Ahs"),
        ("GET", f"{FED_V1}/user/devices/%40u%3A" + "x" * 64 + ".org"),
        ("GET", f"{FED_V1}/make_join/{quote('!' + 'r' * 300)}/{user}"),
        ("GET", "/_matrix/key/v2/query/" + "x" * 64 + ".org"),
    ]
    for method, uri in cases:
        answer = await server.raw.request(method, uri, signer=(peer, origin))
        assert_matrix_error(answer, 400, "M_INVALID_PARAM")
        # Unsigned: path parameters are refused before authentication, query parameters after it.
        answer = await server.raw.request(method, uri)
        if "?" in uri:
            assert_matrix_error(answer, 401, "M_UNAUTHORIZED")
        else:
            assert_matrix_error(answer, 400, "M_INVALID_PARAM")
    # The client API checks its identifier path parameters the same way.
    token = (await server.tributary.client.register_ok("nul_client"))["access_token"]
    for path in (f"rooms/{quote('!r:hs')}%00/state", f"profile/%40a%00%3Ahs", f"rooms/{quote('!r:hs')}/event/%24e%00"):
        response = await server.tributary.client.request("GET", path, token=token)
        assert (response.status, response.errcode) == (400, "M_INVALID_PARAM"), (path, response)


@pytest.mark.timeout(120)
async def test_get_missing_events_fields_of_the_wrong_type_are_400(server: Server,
                                                                     make_peer: list[FederationPeer]) -> None:
    """``earliest_events``/``latest_events`` that are not lists raised a TypeError (500). Each field is
    type-checked; the 400 names it. Well-formed requests still work."""
    peer, [origin] = await started_peer(make_peer, 1)
    room_id, join = await joined_room(server, peer, origin, "gme_owner")
    uri = f"{FED_V1}/get_missing_events/{quote(room_id)}"
    for field, body in [
        ("earliest_events", {"earliest_events": 5, "latest_events": [join]}),
        ("latest_events", {"earliest_events": [], "latest_events": {"a": 1}}),
        ("latest_events", {"earliest_events": [], "latest_events": "$x"}),
        ("latest_events", {"earliest_events": [], "latest_events": [None]}),
        ("limit", {"earliest_events": [], "latest_events": [join], "limit": "10"}),
        ("min_depth", {"earliest_events": [], "latest_events": [join], "min_depth": [1]}),
    ]:
        answer = await server.raw.request("POST", uri, json.dumps(body).encode(), signer=(peer, origin))
        assert_matrix_error(answer, 400, "M_BAD_JSON")
        assert field in answer.body["error"], answer
    fine = await server.raw.request("POST", uri, json.dumps({"earliest_events": [], "latest_events": [join],
                                                             "limit": 5}).encode(), signer=(peer, origin))
    assert fine.status == 200 and isinstance(fine.body["events"], list) and fine.body["events"], fine
    # backfill's limit is a query parameter: not a number is a 400 too.
    answer = await server.raw.request("GET", f"{FED_V1}/backfill/{quote(room_id)}?v={quote(join)}&limit=x",
                                      signer=(peer, origin))
    assert_matrix_error(answer, 400, "M_INVALID_PARAM")


@pytest.mark.timeout(120)
async def test_an_origin_with_a_64_character_label_is_refused_at_once(server: Server,
                                                                       make_peer: list[FederationPeer]) -> None:
    """Such an origin used to stall the request 15 s in a key lookup before the 401. The origin is
    checked by the server-name grammar before any lookup: 401 in well under 2 s."""
    peer, [origin] = await started_peer(make_peer, 1)
    bad_origin = "a" * 64 + ".example.org"
    for method, uri, body in (("GET", f"{FED_V1}/query/profile?user_id=%40u%3Ahs", None),
                              ("PUT", f"{FED_V1}/send/t1", b'{"pdus": [], "edus": []}')):
        answer = await server.raw.request(method, uri, body, signer=(peer, origin), origin=bad_origin)
        assert_matrix_error(answer, 401, "M_UNAUTHORIZED")
        assert answer.seconds < 2, answer


@pytest.mark.timeout(120)
async def test_a_pdu_that_is_not_canonical_json_is_answered_alone(server: Server,
                                                                   make_peer: list[FederationPeer]) -> None:
    """A peer sends one transaction, signed over its bytes as sent, with a valid message and four
    broken ones: ``depth`` 2**60 (outside canonical JSON's integers), 1.5 (a float), "7" (a
    string) and 1e400 (no number at all: no event ID can be computed for it), and an EDU with a
    lone surrogate. The transaction is answered 200 (it used to be a 400 for the whole
    transaction, which loses the valid PDU at a sender that drops what is answered 4xx): each
    broken PDU with an ID has an error under it, the one without an ID is left out (as Synapse
    leaves out a PDU it cannot make an event of), the EDU is dropped, and the valid message is
    stored and shown to the room's local member."""
    peer, [origin] = await started_peer(make_peer, 1)
    room, token = await peer_room(server, peer, origin, "canonical_owner")
    room_id, version = room.room_id, room.version

    def message(body: str, depth: object) -> dict[str, Any]:
        # Signed as valid, then broken: the checks that refuse it come before the signature's.
        return {**room.message(body), "depth": depth}

    fine = room.message("fine")
    broken = [message("huge depth", 2**60), message("float depth", 1.5), message("string depth", "7")]
    fine_id, *broken_ids = (compute_event_id(version, p) for p in (fine, *broken))
    pdus = b",".join([*(encode_canonical(p) for p in broken),
                      encode_canonical(message("no number", 0)).replace(b'"depth":0', b'"depth":1e400'),
                      encode_canonical(fine)])
    body = (b'{"edus":[{"content":{"room_id":"' + room_id.encode() + b'","typing":true,"user_id":"\\ud800"},'
            b'"edu_type":"m.typing"}],"origin":' + encode_canonical(origin) + b',"origin_server_ts":'
            + str(int(reactor.seconds() * 1000)).encode() + b',"pdus":[' + pdus + b"]}")
    uri = f"{FED_V1}/send/canonical1"
    header = sign_encoded_request("PUT", uri, origin, server.tributary.server_name, body, peer.signing_key(origin))
    answer = await server.raw.request("PUT", uri, body, headers={"Authorization": header})
    assert answer.status == 200, answer
    results = answer.body["pdus"]
    assert set(results) == {fine_id, *broken_ids}, answer  # the 1e400 one has no ID to answer under
    assert results[fine_id] == {}, answer
    assert "1152921504606846976" in results[broken_ids[0]]["error"], answer
    assert "1.5" in results[broken_ids[1]]["error"], answer
    assert "depth" in results[broken_ids[2]]["error"], answer
    assert [stored_event_count(server.dsn, i) for i in (fine_id, *broken_ids)] == [1, 0, 0, 0]
    shown = await server.tributary.client.request("GET", f"rooms/{quote(room_id)}/event/{quote(fine_id)}", token=token)
    assert (shown.status, shown.body["content"]["body"]) == (200, "fine"), shown


@pytest.mark.timeout(120)
async def test_a_pdu_with_1300_prev_events_is_rejected_and_not_stored(server: Server,
                                                                        make_peer: list[FederationPeer]) -> None:
    """Room versions cap a PDU at 20 prev_events and 10 auth_events. A properly signed PDU citing
    1,300 prev events comes back in the /send answer with an error, and no row of it is stored;
    one with 11 auth events likewise. A PDU within the caps from the same server is accepted."""
    peer, [origin] = await started_peer(make_peer, 1)
    room, _ = await peer_room(server, peer, origin, "caps_owner")
    version, join = room.version, room.join
    wide = room.message("wide", [join] + [f"$missing{i}" for i in range(1299)])
    many_auth = room.message("many auth", extra_auth=11 - len(select_auth_event_ids(
        version, EventTemplate("m.room.message", {}), room.sender, room.state)))
    fine = room.message("fine")
    ids = [compute_event_id(version, p) for p in (wide, many_auth, fine)]
    before = row_counts(server.dsn)
    result = await peer.send_transaction(origin, server.tributary.server_name, "caps1", [wide, many_auth, fine])
    assert "1300 prev_events" in result["pdus"][ids[0]]["error"], result
    assert "11 auth_events" in result["pdus"][ids[1]]["error"], result
    assert result["pdus"][ids[2]] == {}, result
    assert [stored_event_count(server.dsn, i) for i in ids] == [0, 0, 1]
    after = row_counts(server.dsn)
    assert after["events"] == before["events"] + 1


async def test_pdus_whose_room_id_is_not_a_string_are_dropped_not_a_500(server: Server,
                                                                        make_peer: list[FederationPeer]) -> None:
    """A transaction's PDUs are grouped by room before anything else; a room ID that is a list
    or an object (unhashable) or a number is no room: the PDU is dropped, the transaction is
    answered 200 and nothing is written."""
    peer, [origin] = await started_peer(make_peer, 1)
    before = row_counts(server.dsn)
    pdus = [{"room_id": ["!a:b"], "type": "m.room.message"}, {"room_id": {"x": 1}}, {"room_id": 7}, "not a pdu"]
    result = await peer.send_transaction(origin, server.tributary.server_name, "odd-rooms", pdus)
    assert result == {"pdus": {}}, result
    assert row_counts(server.dsn) == {**before, "received_transactions": before["received_transactions"] + 1}
