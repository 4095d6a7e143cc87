"""A test federation peer: many virtual remote homeservers, in the test process, on the reactor.

Each virtual server is a TLS listener on ``127.0.0.1:<port>`` whose server name is
``127.0.0.1:<port>`` (an explicit port, so a homeserver's resolver connects straight
there), with its own ed25519 signing key and self-signed certificate. It serves its key
and ``/version``, accepts ``PUT /send/{txnId}`` (``X-Matrix`` checked against the
origin's key fetched over HTTPS, deduplicated by ``(origin, txnId)``) and recorded for
assertions, and countersigns ``PUT /v2/invite``. A switchable ``Behaviour`` per server
makes it fail the ways a real remote fails (5xx, 401, 429, hang, close, refuse
connections). As a client it can join a room through ``make_join``/``send_join`` and
send signed transactions.

It deliberately does not keep room state or check PDU signatures or auth: it records
what a sender delivered, nothing more. ``get_missing_events``, ``/event``,
``/state_ids`` and ``/state`` are answered only from a history a test hands a virtual
server (``serve_history``: events by ID, and the state IDs at some of them); otherwise
they, like ``backfill``, are counted and answered 404. It reuses the homeserver's signing,
event building, key response and ``X-Matrix`` code rather than its own.
"""

# tests: tests/integration/test_federation_peer.py

from __future__ import annotations

import enum
import json
import logging
import secrets
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import attrs
from signedjson.key import generate_signing_key
from signedjson.sign import sign_json
from signedjson.types import SigningKey, VerifyKey
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from homeserver.events import (
    DEFAULT_ROOM_VERSION,
    KNOWN_ROOM_VERSIONS,
    RoomVersion,
    compute_event_id,
    get_room_version,
    prune_event_dict,
    sign_pdu,
)
from homeserver.events.canonical import thaw
from homeserver.remote.request_auth import authenticate_request
from homeserver.remote.client import FederationClient
from homeserver.federation.keys import Keyring, server_key_response
from storage.kernel.errors import MatrixError
from homeserver.keys import ensure_self_signed_certificate, load_tls_options

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
WHITELIST = ("127.0.0.0/8",)
MAX_BODY_BYTES = 50 * 1024 * 1024
EVENT_ID_CACHE_SIZE = 100_000


class Behaviour(enum.Enum):
    """How a virtual server answers federation requests (``/_matrix/federation/...``).

    Key requests (``/_matrix/key/...``) are always answered, except when ``DOWN`` or ``SILENT``.
    """

    OK = "ok"
    ERROR_500 = "error_500"
    UNAUTHORIZED_401 = "unauthorized_401"
    RATELIMIT_429 = "ratelimit_429"
    BAD_REQUEST_400 = "bad_request_400"
    HANG = "hang"              # accept the request, never answer (until switched away)
    SILENT = "silent"          # like HANG, but for key requests too: a server that never answers
    CLOSE = "close"            # drop the TCP connection without answering
    PDU_ERRORS = "pdu_errors"  # 200, but every PDU gets {"error": ...}
    DOWN = "down"              # the listening port is closed: connections are refused


_ERROR_ANSWERS: dict[Behaviour, tuple[int, dict[str, Any]]] = {
    Behaviour.ERROR_500: (500, {"errcode": "M_UNKNOWN", "error": "federation peer: simulated internal error"}),
    Behaviour.UNAUTHORIZED_401: (401, {"errcode": "M_UNAUTHORIZED", "error": "federation peer: simulated 401"}),
    Behaviour.RATELIMIT_429: (429, {"errcode": "M_LIMIT_EXCEEDED", "error": "federation peer: simulated 429",
                                    "retry_after_ms": 1000}),
    Behaviour.BAD_REQUEST_400: (400, {"errcode": "M_BAD_JSON", "error": "federation peer: simulated 400"}),
}


@attrs.frozen
class ReceivedTransaction:
    """One ``PUT /send`` the virtual server accepted (signature verified).

    ``repeat``: the ``(origin, txn_id)`` was seen before; the stored response was
    returned and its PDUs were not recorded again. ``pdu_errors``: answered under
    ``Behaviour.PDU_ERRORS`` (every PDU refused); its PDUs are not counted as received.
    """

    destination: str
    origin: str
    txn_id: str
    pdus: tuple[dict[str, Any], ...]
    edus: tuple[dict[str, Any], ...]
    pdu_ids: tuple[str, ...]
    arrived_at: float
    repeat: bool
    pdu_errors: bool
    response: dict[str, Any]


@attrs.frozen
class ReceivedInvite:
    destination: str
    origin: str
    room_id: str
    event_id: str
    room_version: str
    event: dict[str, Any]
    arrived_at: float


@attrs.define(eq=False)
class _HeldRequest:
    request: Request
    path_kind: str
    disconnected: bool = False


class _TrackingChannel(HTTPChannel):
    """An HTTP channel that registers itself with its virtual server, so ``DOWN`` can cut it."""

    virtual: VirtualServer | None = None

    def connectionMade(self) -> None:
        super().connectionMade()  # type: ignore[no-untyped-call]
        if self.virtual is not None:
            self.virtual.channels.add(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.virtual is not None:
            self.virtual.channels.discard(self)
        super().connectionLost(reason)  # type: ignore[no-untyped-call]


class _PeerSite(Site):
    """A site whose channels know their virtual server (set once the server exists)."""

    protocol = _TrackingChannel  # type: ignore[assignment]  # a plain HTTP/1.1 channel, no HTTP/2
    virtual: VirtualServer | None = None

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)  # type: ignore[no-untyped-call]
        if isinstance(channel, _TrackingChannel):
            channel.virtual = self.virtual
        return channel


@attrs.define(eq=False)
class VirtualServer:
    """One remote homeserver the peer pretends to be, and everything it received."""

    name: str
    port: int
    signing_key: SigningKey
    tls_options: Any
    site: _PeerSite
    listening: IListeningPort | None
    client: FederationClient
    behaviour: Behaviour = Behaviour.OK
    transactions: list[ReceivedTransaction] = attrs.Factory(list)
    responses: dict[tuple[str, str], dict[str, Any]] = attrs.Factory(dict)
    pdus: dict[str, dict[str, Any]] = attrs.Factory(dict)         # event ID -> first PDU JSON
    pdu_order: list[str] = attrs.Factory(list)                     # event IDs, first arrival order
    pdu_deliveries: Counter[str] = attrs.Factory(Counter)          # event ID -> times delivered (non-repeat txns)
    invites: list[ReceivedInvite] = attrs.Factory(list)
    request_counts: Counter[str] = attrs.Factory(Counter)
    held: list[_HeldRequest] = attrs.Factory(list)
    channels: set[HTTPChannel] = attrs.Factory(set)
    # Answers to GET /query/profile (user ID -> profile) and /query/directory (alias -> answer);
    # anything else is answered 404 M_NOT_FOUND, as a real server does.
    profiles: dict[str, dict[str, Any]] = attrs.Factory(dict)
    aliases: dict[str, dict[str, Any]] = attrs.Factory(dict)
    transition: Deferred[None] = attrs.Factory(lambda: succeed(None))
    # History a test hands the server (``FederationPeer.serve_history``): event ID -> PDU for
    # /event and get_missing_events, event ID -> {"pdu_ids", "auth_chain_ids"} for /state_ids.
    history: dict[str, dict[str, Any]] = attrs.Factory(dict)
    state_ids: dict[str, dict[str, list[str]]] = attrs.Factory(dict)
    serves_missing_events: bool = False
    # When set, get_missing_events answers only once it fires (``hold_missing_events``).
    missing_events_gate: Deferred[None] | None = None


async def _stop_listening(listening: IListeningPort) -> None:
    stopped = listening.stopListening()
    if stopped is not None:
        await stopped


def path_kind(path: str) -> str:
    """A short name for a request path: ``send``, ``invite``, ``get_missing_events``, ``key/server``...

    ``/_matrix/federation/v1/send/t1`` -> ``send``; ``/_matrix/key/v2/server`` -> ``key/server``;
    anything else -> ``other``.
    """
    parts = path.split("?", 1)[0].split("/")
    if len(parts) >= 5 and parts[1] == "_matrix" and parts[2] == "federation":
        return parts[4]
    if len(parts) >= 5 and parts[1] == "_matrix" and parts[2] == "key":
        return "key/" + parts[4]
    return "other"


class _PeerResource(Resource):
    isLeaf = True

    def __init__(self, peer: FederationPeer, server: VirtualServer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._peer = peer
        self._server = server

    def render(self, request: Request) -> Any:
        d = Deferred.fromCoroutine(self._peer._handle(self._server, request))
        d.addErrback(self._peer._log_failure, self._server.name)
        return NOT_DONE_YET


class FederationPeer:
    """N virtual remote homeservers in this process; see the module docstring.

    ``reactor`` is the running Twisted reactor (tests pass ``tests.twisted_plugin.reactor``).
    """

    def __init__(self, reactor: Any, *, request_timeout_seconds: float = 30.0) -> None:
        self._reactor = reactor
        self._timeout = request_timeout_seconds
        self._servers: dict[str, VirtualServer] = {}
        self._room_versions: dict[str, RoomVersion] = {}
        self._event_ids: dict[tuple[str, str], str] = {}
        self._tmp: Path | None = None
        self._waiters: list[tuple[str, frozenset[str], Deferred[None]]] = []
        self.listeners: list[Callable[[ReceivedTransaction], None]] = []
        """Called with every transaction a virtual server accepts (repeats included), as it arrives."""
        # Fetches the keys of whoever signs a request to one of our virtual servers.
        self._key_client = FederationClient(
            reactor, server_name="federation-peer.invalid", signing_key=generate_signing_key("peer"),
            verify_certificates=False, ip_range_whitelist=WHITELIST, timeout_seconds=10,
        )
        self._keyring = Keyring(
            server_name="federation-peer.invalid", signing_key=generate_signing_key("peer"),
            clock_ms=self._now_ms, fetch_direct=self._fetch_key, fetch_notary=self._no_notary,
        )

    # --- lifecycle -------------------------------------------------------------------

    async def start(self, n: int) -> list[str]:
        """Start ``n`` more virtual servers; return their names (``127.0.0.1:<port>``)."""
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="federation-peer-"))
        names = []
        for _ in range(n):
            index = len(self._servers)
            cert_path, key_path = self._tmp / f"{index}.crt", self._tmp / f"{index}.key"
            ensure_self_signed_certificate(cert_path, key_path, LOOPBACK)
            tls_options = load_tls_options(cert_path, key_path)
            # A key ID of its own: a later peer may get the same port, so the same server name,
            # and a server that cached the earlier key under the same ID would refuse the new one.
            signing_key = generate_signing_key(f"peer{index}_{secrets.token_hex(4)}")
            site = _PeerSite(Resource())  # type: ignore[no-untyped-call]
            listening = self._reactor.listenSSL(0, site, tls_options, interface=LOOPBACK)
            port = int(listening.getHost().port)
            name = f"{LOOPBACK}:{port}"
            client = FederationClient(
                self._reactor, server_name=name, signing_key=signing_key, verify_certificates=False,
                ip_range_whitelist=WHITELIST, timeout_seconds=self._timeout,
            )
            server = VirtualServer(name, port, signing_key, tls_options, site, listening, client)
            site.resource = _PeerResource(self, server)
            site.virtual = server
            self._servers[name] = server
            names.append(name)
        logger.info("federation peer started %d virtual servers", n)
        return names

    async def stop(self) -> None:
        """Close every listener, connection and client; idempotent."""
        for server in self._servers.values():
            try:
                await server.transition
            except Exception:  # a failed switch (re-listening, say): stop regardless
                pass
            self._abort_connections(server)
            if server.listening is not None:
                listening, server.listening = server.listening, None
                await _stop_listening(listening)
            await server.client.close()
        await self._key_client.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # --- behaviour -------------------------------------------------------------------

    def set_behaviour(self, server_name: str, behaviour: Behaviour) -> Deferred[None]:
        """Switch how ``server_name`` answers. Returns a Deferred that fires once the change is
        in effect: await it when switching to or from ``DOWN`` (closing or re-opening the port);
        other switches take effect at once. Leaving ``HANG`` handles the held requests whose
        clients are still connected under the new behaviour."""
        server = self._server(server_name)
        previous = server.transition
        d = Deferred.fromCoroutine(self._switch(server, previous, behaviour))
        server.transition = d
        return d

    def behaviour(self, server_name: str) -> Behaviour:
        return self._server(server_name).behaviour

    async def _switch(self, server: VirtualServer, previous: Deferred[None], behaviour: Behaviour) -> None:
        try:
            await previous
        except Exception:  # reported to whoever awaited that switch; this one goes ahead
            pass
        old, server.behaviour = server.behaviour, behaviour
        logger.info("[%s] federation peer behaviour %s -> %s", server.name, old.value, behaviour.value)
        if behaviour is Behaviour.DOWN and server.listening is not None:
            listening, server.listening = server.listening, None
            self._abort_connections(server)
            await _stop_listening(listening)
        elif behaviour is not Behaviour.DOWN and server.listening is None:
            server.listening = self._reactor.listenSSL(server.port, server.site, server.tls_options,
                                                       interface=LOOPBACK)
        holding = (Behaviour.HANG, Behaviour.SILENT)
        if old in holding and behaviour not in holding:
            held, server.held = server.held, []
            for item in held:
                if not item.disconnected:
                    await self._dispatch(server, item.request, item.path_kind)

    def _abort_connections(self, server: VirtualServer) -> None:
        for channel in list(server.channels):
            transport = channel.transport
            if transport is None:
                continue
            try:
                transport.abortConnection()  # type: ignore[attr-defined]
            except RuntimeError:
                # uvloop: the TCP handle under the TLS layer is already closed, and TLS's
                # close_notify cannot be written; drop the TCP connection itself.
                inner = getattr(transport, "transport", None)
                if inner is not None:
                    try:
                        inner.abortConnection()
                    except RuntimeError:
                        pass
        for item in server.held:
            item.disconnected = True
        server.held.clear()

    # --- accessors -------------------------------------------------------------------

    @property
    def servers(self) -> list[str]:
        return list(self._servers)

    def port(self, server_name: str) -> int:
        return self._server(server_name).port

    def signing_key(self, server_name: str) -> SigningKey:
        return self._server(server_name).signing_key

    def client(self, server_name: str) -> FederationClient:
        """A ``FederationClient`` that signs as ``server_name`` (TLS without verification, loopback allowed)."""
        return self._server(server_name).client

    def transactions(self, server_name: str) -> list[ReceivedTransaction]:
        """Every accepted ``PUT /send`` in arrival order, repeats included (``repeat=True``)."""
        return list(self._server(server_name).transactions)

    def received_pdu_ids(self, server_name: str, room_id: str | None = None) -> list[str]:
        """Event IDs received (in accepted, non-repeat transactions), first arrival order, each once."""
        server = self._server(server_name)
        return [e for e in server.pdu_order if room_id is None or server.pdus[e].get("room_id") == room_id]

    def received_pdus(self, server_name: str, room_id: str | None = None) -> list[dict[str, Any]]:
        """The PDU JSON of ``received_pdu_ids``, same order."""
        server = self._server(server_name)
        return [server.pdus[e] for e in self.received_pdu_ids(server_name, room_id)]

    def pdu_delivery_counts(self, server_name: str) -> Counter[str]:
        """Event ID -> how many accepted non-repeat transactions carried it (>1: sent again in a new txn)."""
        return Counter(self._server(server_name).pdu_deliveries)

    def duplicate_pdu_ids(self, server_name: str) -> dict[str, int]:
        """Event IDs delivered more than once in distinct transactions, with their counts."""
        return {e: n for e, n in self._server(server_name).pdu_deliveries.items() if n > 1}

    def received_edus(self, server_name: str, edu_type: str | None = None) -> list[dict[str, Any]]:
        """EDUs of accepted non-repeat transactions, in arrival order, optionally of one ``edu_type``."""
        return [
            edu for txn in self._server(server_name).transactions if not txn.repeat
            for edu in txn.edus if edu_type is None or edu.get("edu_type") == edu_type
        ]

    def received_invites(self, server_name: str) -> list[ReceivedInvite]:
        return list(self._server(server_name).invites)

    def request_counts(self, server_name: str) -> Counter[str]:
        """Requests received by path kind (``send``, ``invite``, ``get_missing_events``, ``key/server``...),
        counted on arrival whatever the behaviour or outcome."""
        return Counter(self._server(server_name).request_counts)

    def set_profile(self, server_name: str, user_id: str, profile: dict[str, Any]) -> None:
        """What ``server_name`` answers to ``GET /query/profile?user_id=user_id``."""
        self._server(server_name).profiles[user_id] = profile

    def set_alias(self, server_name: str, alias: str, answer: dict[str, Any]) -> None:
        """What ``server_name`` answers to ``GET /query/directory?room_alias=alias``."""
        self._server(server_name).aliases[alias] = answer

    def serve_history(self, server_name: str, pdus: Iterable[Mapping[str, Any]], *,
                      state_ids: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
                      missing_events: bool = True) -> None:
        """Let ``server_name`` serve ``pdus`` on ``/event`` and (with ``missing_events``) on
        ``get_missing_events``, and ``state_ids`` (event ID -> its ``/state_ids`` answer)."""
        server = self._server(server_name)
        for pdu in pdus:
            server.history[self._event_id(pdu)] = thaw(pdu)
        for event_id, answer in (state_ids or {}).items():
            server.state_ids[event_id] = {k: list(v) for k, v in answer.items()}
        server.serves_missing_events = missing_events

    def held_requests(self, server_name: str) -> int:
        """Requests held open under ``HANG`` whose clients are still connected."""
        return sum(1 for item in self._server(server_name).held if not item.disconnected)

    def hold_missing_events(self, server_name: str) -> Deferred[None]:
        """Hold ``server_name``'s get_missing_events answers until the returned Deferred is fired."""
        gate: Deferred[None] = Deferred()
        self._server(server_name).missing_events_gate = gate
        return gate

    async def wait_for_pdus(self, server_name: str, event_ids: Iterable[str], *, timeout: float = 30.0) -> None:
        """Return once ``server_name`` received every one of ``event_ids``; TimeoutError after ``timeout``.
        Woken by arrivals, not polling, so it adds no latency to a measurement."""
        wanted = frozenset(event_ids)
        server = self._server(server_name)
        if wanted <= server.pdus.keys():
            return
        d: Deferred[None] = Deferred()
        entry = (server_name, wanted, d)
        self._waiters.append(entry)
        d.addTimeout(timeout, self._reactor)
        try:
            await d
        except Exception:
            missing = sorted(wanted - server.pdus.keys())
            raise TimeoutError(f"{server_name} is still missing {len(missing)} of {len(wanted)} PDUs after "
                               f"{timeout}s: {missing[:5]}") from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def _wake(self, server: VirtualServer) -> None:
        for entry in list(self._waiters):
            name, wanted, d = entry
            if name == server.name and wanted <= server.pdus.keys() and not d.called:
                self._waiters.remove(entry)
                d.callback(None)

    def room_version(self, room_id: str) -> RoomVersion | None:
        return self._room_versions.get(room_id)

    def remember_room(self, room_id: str, room_version: RoomVersion) -> None:
        """Tell the peer a room's version (learnt by itself from joins and invites): event IDs of
        PDUs depend on it. PDUs of rooms it does not know are hashed as ``DEFAULT_ROOM_VERSION``."""
        self._room_versions[room_id] = room_version

    def _server(self, server_name: str) -> VirtualServer:
        try:
            return self._servers[server_name]
        except KeyError:
            raise KeyError(f"{server_name!r} is not a virtual server of this peer ({sorted(self._servers)})") from None

    # --- client side -----------------------------------------------------------------

    async def join(self, server_name: str, user_id: str, room_id: str, *, via: str) -> str:
        """Join ``user_id`` (a user of ``server_name``) to ``room_id`` through ``via``:
        make_join v1, hash and sign the template with the virtual server's key, send_join v2.
        Returns the join's event ID; the room's version is remembered for later PDUs."""
        client = self.client(server_name)
        made = await client.get_json(
            via, f"/_matrix/federation/v1/make_join/{quote(room_id, safe='')}/{quote(user_id, safe='')}",
            query={"ver": sorted(KNOWN_ROOM_VERSIONS)},
        )
        if not isinstance(made, dict) or not isinstance(made.get("event"), dict):
            raise AssertionError(f"{via} sent a make_join answer without an event: {made!r:.300}")
        room_version = get_room_version(str(made.get("room_version")))
        pdu = made["event"]
        pdu["content"] = {"membership": "join"}
        pdu["origin_server_ts"] = self._now_ms()
        pdu.pop("hashes", None)
        pdu.pop("signatures", None)
        join = sign_pdu(room_version, pdu, server_name, self.signing_key(server_name))
        self._room_versions[room_id] = room_version
        await client.put_json(
            via, f"/_matrix/federation/v2/send_join/{quote(room_id, safe='')}/{quote(join.event_id, safe='')}",
            join.get_pdu_json(),
        )
        return join.event_id

    async def send_transaction(self, server_name: str, destination: str, txn_id: str,
                               pdus: Sequence[Mapping[str, Any]] = (), edus: Sequence[Mapping[str, Any]] = (),
                               *, timeout: float | None = None) -> Any:
        """``PUT /send/{txn_id}`` from virtual server ``server_name`` to ``destination``; the answer's JSON."""
        body = {"origin": server_name, "origin_server_ts": self._now_ms(),
                "pdus": [thaw(p) for p in pdus], "edus": [thaw(e) for e in edus]}
        return await self.client(server_name).put_json(
            destination, f"/_matrix/federation/v1/send/{quote(txn_id, safe='')}", body, timeout=timeout
        )

    # --- serving ---------------------------------------------------------------------

    async def _handle(self, server: VirtualServer, request: Request) -> None:
        path = request.path.decode("ascii", "replace")
        kind = path_kind(path)
        server.request_counts[kind] += 1
        logger.debug("[%s] peer got %s %s", server.name, request.method.decode(), path)
        if (server.behaviour is Behaviour.HANG and not kind.startswith("key/")) or server.behaviour is Behaviour.SILENT:
            item = _HeldRequest(request, kind)
            request.notifyFinish().addErrback(lambda _: setattr(item, "disconnected", True))
            server.held.append(item)
            return
        await self._dispatch(server, request, kind)

    async def _dispatch(self, server: VirtualServer, request: Request, kind: str) -> None:
        behaviour = server.behaviour
        if not kind.startswith("key/"):
            if behaviour is Behaviour.CLOSE or behaviour is Behaviour.DOWN:
                transport = request.channel.transport if request.channel is not None else None
                if transport is not None:
                    transport.abortConnection()  # type: ignore[attr-defined]
                return
            if behaviour in _ERROR_ANSWERS:
                self._respond(request, *_ERROR_ANSWERS[behaviour])
                return
        try:
            code, body = await self._route(server, request, kind)
        except MatrixError as e:
            code, body = e.status, e.to_json()
        self._respond(request, code, body)

    async def _route(self, server: VirtualServer, request: Request, kind: str) -> tuple[int, dict[str, Any]]:
        method = request.method.decode("ascii")
        segments = [unquote(s) for s in request.path.decode("ascii", "replace").split("/")]
        if kind == "key/server" and method == "GET":
            return 200, server_key_response(server.name, server.signing_key, self._now_ms())
        if kind == "version" and method == "GET":
            return 200, {"server": {"name": "TributaryFederationPeer", "version": "0"}}
        if kind == "send" and method == "PUT" and len(segments) == 6:
            content = self._json_body(request)
            origin = await self._authenticate(server, request, content)
            return 200, self._on_transaction(server, origin, segments[5], content)
        if kind == "query" and method == "GET" and len(segments) == 6 and segments[5] in ("profile", "directory"):
            await self._authenticate(server, request, None)
            args = {k.decode(): v[0].decode() for k, v in (request.args or {}).items()}
            known = server.profiles if segments[5] == "profile" else server.aliases
            answer = known.get(args.get("user_id") or args.get("room_alias") or "")
            if answer is None:
                return 404, {"errcode": "M_NOT_FOUND", "error": f"federation peer: no such {segments[5]}"}
            return 200, answer
        if kind == "invite" and method == "PUT" and segments[3] == "v2" and len(segments) == 7:
            content = self._json_body(request)
            origin = await self._authenticate(server, request, content)
            return 200, self._on_invite(server, origin, segments[5], segments[6], content)
        if kind == "get_missing_events" and method == "POST" and server.serves_missing_events:
            content = self._json_body(request)
            await self._authenticate(server, request, content)
            if server.missing_events_gate is not None:
                await server.missing_events_gate
            return 200, self._missing_events(server, content)
        if kind == "event" and method == "GET" and len(segments) == 6 and segments[5] in server.history:
            await self._authenticate(server, request, None)
            return 200, {"origin": server.name, "origin_server_ts": self._now_ms(),
                         "pdus": [server.history[segments[5]]]}
        if kind in ("state_ids", "state") and method == "GET":
            await self._authenticate(server, request, None)
            event_id = (request.args or {}).get(b"event_id", [b""])[0].decode()
            answer = server.state_ids.get(event_id)
            if answer is None:
                return 404, {"errcode": "M_NOT_FOUND", "error": f"federation peer: no state at {event_id}"}
            if kind == "state_ids":
                return 200, answer
            # /state: the PDUs of its history among them (the rest the asker has, in these tests).
            return 200, {"pdus": [server.history[i] for i in answer["pdu_ids"] if i in server.history],
                         "auth_chain": [server.history[i] for i in answer["auth_chain_ids"] if i in server.history]}
        return 404, {"errcode": "M_UNRECOGNIZED", "error": f"the federation peer does not serve {method} {kind}"}

    @staticmethod
    def _missing_events(server: VirtualServer, content: Any) -> dict[str, Any]:
        """The spec's walk: back from ``latest_events`` through prev events, not past
        ``earliest_events``, the ``limit`` nearest events, answered oldest first."""
        body = content if isinstance(content, dict) else {}
        latest = [e for e in body.get("latest_events", []) if isinstance(e, str)]
        seen = {e for e in body.get("earliest_events", []) if isinstance(e, str)} | set(latest)
        limit = body.get("limit", 10) if isinstance(body.get("limit"), int) else 10
        frontier = [server.history[e] for e in latest if e in server.history]
        found: list[dict[str, Any]] = []
        while frontier and len(found) < limit:
            prevs = [p for pdu in frontier for p in pdu.get("prev_events", []) if p not in seen]
            seen.update(prevs)
            frontier = sorted((server.history[p] for p in set(prevs) if p in server.history),
                              key=lambda pdu: -int(pdu.get("depth", 0)))
            found.extend(frontier[:limit - len(found)])
        return {"events": sorted(found, key=lambda pdu: int(pdu.get("depth", 0)))}

    async def _authenticate(self, server: VirtualServer, request: Request, content: Any) -> str:
        return await authenticate_request(
            request.requestHeaders.getRawHeaders(b"Authorization"), request.method.decode("ascii"),
            request.uri.decode("ascii", "replace"), server.name, content, self._keyring.get_verify_key,
        )

    def _on_transaction(self, server: VirtualServer, origin: str, txn_id: str, content: Any) -> dict[str, Any]:
        if not isinstance(content, dict):
            raise MatrixError(400, "M_BAD_JSON", "a transaction must be a JSON object")
        raw_pdus = content.get("pdus", [])
        raw_edus = content.get("edus", [])
        if not isinstance(raw_pdus, list) or not isinstance(raw_edus, list):
            raise MatrixError(400, "M_BAD_JSON", "'pdus' and 'edus' must be lists")
        pdus = tuple(p for p in raw_pdus if isinstance(p, dict))
        edus = tuple(e for e in raw_edus if isinstance(e, dict))
        pdu_ids = tuple(self._event_id(p) for p in pdus)
        now = float(self._reactor.seconds())
        stored = server.responses.get((origin, txn_id))
        if stored is not None:
            self._record(server, ReceivedTransaction(
                server.name, origin, txn_id, pdus, edus, pdu_ids, now, repeat=True, pdu_errors=False, response=stored,
            ))
            logger.info("[%s] repeated transaction %s from %s", server.name, txn_id, origin)
            return stored
        refuse = server.behaviour is Behaviour.PDU_ERRORS
        response: dict[str, Any] = {"pdus": {
            e: ({"error": "federation peer: simulated per-PDU error"} if refuse else {}) for e in pdu_ids
        }}
        server.responses[(origin, txn_id)] = response
        if not refuse:
            for event_id, pdu in zip(pdu_ids, pdus):
                server.pdu_deliveries[event_id] += 1
                if event_id not in server.pdus:
                    server.pdus[event_id] = pdu
                    server.pdu_order.append(event_id)
        self._record(server, ReceivedTransaction(
            server.name, origin, txn_id, pdus, edus, pdu_ids, now, repeat=False, pdu_errors=refuse, response=response,
        ))
        return response

    def _record(self, server: VirtualServer, txn: ReceivedTransaction) -> None:
        server.transactions.append(txn)
        for listener in list(self.listeners):
            try:
                listener(txn)
            except Exception:  # a test's listener must not break the peer
                logger.exception("[%s] a federation peer listener failed", server.name)
        if not txn.repeat and not txn.pdu_errors:
            self._wake(server)

    def _on_invite(self, server: VirtualServer, origin: str, room_id: str, event_id: str,
                   content: Any) -> dict[str, Any]:
        if not isinstance(content, dict) or not isinstance(content.get("event"), dict):
            raise MatrixError(400, "M_BAD_JSON", "invite body must hold an 'event' object")
        identifier = content.get("room_version")
        if not isinstance(identifier, str) or identifier not in KNOWN_ROOM_VERSIONS:
            raise MatrixError(400, "M_INCOMPATIBLE_ROOM_VERSION", f"room version {identifier!r} is not supported")
        room_version = get_room_version(identifier)
        pdu: dict[str, Any] = content["event"]
        if compute_event_id(room_version, pdu) != event_id or pdu.get("room_id") != room_id:
            raise MatrixError(400, "M_BAD_JSON", "event ID/room ID in the path do not match the event")
        self._room_versions.setdefault(room_id, room_version)
        redacted = prune_event_dict(room_version, pdu)
        redacted.pop("unsigned", None)
        ours = sign_json(redacted, server.name, server.signing_key)["signatures"][server.name]
        signed = dict(pdu)
        signatures = thaw(pdu.get("signatures", {}))
        signatures.setdefault(server.name, {}).update(ours)
        signed["signatures"] = signatures
        server.invites.append(ReceivedInvite(server.name, origin, room_id, event_id, identifier, signed,
                                             float(self._reactor.seconds())))
        return {"event": signed}

    def _event_id(self, pdu: Mapping[str, Any]) -> str:
        """The PDU's event ID for its room's version. The same PDU reaching many virtual servers is
        hashed once: the cache key is the content hash plus the signatures, which together pin
        every field the reference hash covers (unless a sender changed a field without re-hashing
        and re-signing, which the peer, checking neither, would not notice anyway)."""
        version = self._room_versions.get(str(pdu.get("room_id")), DEFAULT_ROOM_VERSION)
        try:
            key = (version.identifier, json.dumps([pdu.get("hashes"), pdu.get("signatures")], sort_keys=True))
            cached = self._event_ids.get(key)
            if cached is None:
                cached = compute_event_id(version, pdu)
                if len(self._event_ids) >= EVENT_ID_CACHE_SIZE:
                    self._event_ids.clear()
                self._event_ids[key] = cached
            return cached
        except Exception as e:  # a malformed PDU still gets an answer
            logger.warning("cannot compute the event ID of a PDU: %s", e)
            return f"$invalid-{len(pdu)}"

    @staticmethod
    def _json_body(request: Request) -> Any:
        assert request.content is not None
        raw = request.content.read(MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            raise MatrixError(413, "M_TOO_LARGE", "body too large")
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise MatrixError(400, "M_NOT_JSON", "body is not JSON") from None

    @staticmethod
    def _respond(request: Request, code: int, body: Any) -> None:
        if request.finished or request.channel is None or getattr(request, "_disconnected", False):
            return  # the client went away (timed out, or DOWN cut the connection)
        data = json.dumps(body).encode("utf-8")
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", str(len(data)).encode("ascii"))
        request.write(data)
        request.finish()

    def _log_failure(self, failure: Any, server_name: str) -> None:
        logger.error("[%s] federation peer failed handling a request: %s", server_name, failure.getTraceback())

    # --- keys ------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._reactor.seconds() * 1000)

    async def _fetch_key(self, server_name: str) -> Any:
        # Over HTTPS even for our own virtual servers: their key endpoints get exercised too.
        return await self._key_client.get_json(server_name, "/_matrix/key/v2/server", signed=False)

    async def _no_notary(self, notary: str, server: str, key_ids: Iterable[str]) -> Any:
        raise RuntimeError("the federation peer uses no notary")

    async def verify_key(self, server_name: str, key_id: str) -> VerifyKey | None:
        """The key the peer would verify ``server_name``'s requests with (fetched and cached)."""
        return await self._keyring.get_verify_key(server_name, key_id)
