"""The test federation peer (tests/federation_peer.py): against a real ``tributary`` process with
whichever federation sender the tree has, and against itself (dedup, signature checks, failure
behaviours, waiting)."""

# tests: tests/federation_peer.py

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs
import pytest
import yaml
from signedjson.key import generate_signing_key
from twisted.internet.defer import Deferred

from homeserver.events import EventTemplate, build_pdu, get_room_version, sign_pdu
from homeserver.remote.client import (
    FederationClient,
    FederationClientError,
    FederationTimeout,
    HttpResponseError,
    Target,
)
from tests.conftest import scratch_database
from tests.federation_peer import Behaviour, FederationPeer, ReceivedTransaction
from tests.harness import TributaryProcess, free_port
from tests.integration.test_client_support import Client
from tests.twisted_plugin import eventually, reactor

FED = {"verify_certificates": False, "ip_range_whitelist": ["127.0.0.0/8"]}


@attrs.frozen
class Tributary:
    process: TributaryProcess
    server_name: str
    client: Client


@contextmanager
def running_tributary(postgres_template: str, tmp_path: Path, **extra: Any) -> Iterator[Tributary]:
    """A real ``tributary run`` process on a scratch database: server name ``127.0.0.1:<fed port>``,
    a TLS federation listener there, loopback whitelisted, certificates not verified; ``extra``
    config on top (``log_level`` WARNING unless given)."""
    fed_port = free_port()
    server_name = f"127.0.0.1:{fed_port}"
    with scratch_database(postgres_template) as dsn:
        proc = TributaryProcess.configure(tmp_path, database_url=dsn, server_name=server_name,
                                          extra={"federation": FED, "log_level": "WARNING", **extra})
        config = yaml.safe_load(proc.config_path.read_text())
        config["listeners"].append({"type": "http", "port": fed_port, "tls": True, "resources": ["federation", "keys"]})
        proc.config_path.write_text(yaml.safe_dump(config))
        proc.start()
        try:
            yield Tributary(proc, server_name, Client(proc.base_url))
        finally:
            assert proc.stop() == 0, proc.output[-5000:]


@pytest.fixture(scope="module")
def tributary(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tributary]:
    """One real ``tributary run`` process for the module (``running_tributary``)."""
    with running_tributary(postgres_template, tmp_path_factory.mktemp("tributary")) as running:
        yield running


@pytest.fixture
def make_peer() -> Iterator[list[FederationPeer]]:
    """Peers a test started; stopped after it."""
    from tests.twisted_plugin import run_sync

    peers: list[FederationPeer] = []
    yield peers
    for p in peers:
        run_sync(p.stop())


async def started_peer(peers: list[FederationPeer], n: int) -> tuple[FederationPeer, list[str]]:
    p = FederationPeer(reactor, request_timeout_seconds=10)
    peers.append(p)
    names = await p.start(n)
    return p, names


def signed_message(peer: FederationPeer, server: str, body: str) -> dict[str, Any]:
    """A hashed and signed m.room.message PDU of ``server``'s user in a made-up v12 room."""
    version = get_room_version("12")
    room_id = f"!room:{server}"
    peer.remember_room(room_id, version)
    pdu = build_pdu(version, EventTemplate("m.room.message", {"msgtype": "m.text", "body": body}),
                    sender=f"@u:{server}", room_id=room_id, prev_event_ids=[], auth_event_ids=[], depth=1,
                    origin_server_ts=int(reactor.seconds() * 1000))
    return dict(sign_pdu(version, pdu, server, peer.signing_key(server)).get_pdu_json())


@pytest.mark.timeout(120)
async def test_five_virtual_servers_join_and_receive_every_message(tributary: Tributary,
                                                                   make_peer: list[FederationPeer]) -> None:
    """Alice on a real Tributary creates a public room; five virtual servers of the peer join it
    through make_join/send_join (Tributary fetches their keys over HTTPS and checks their
    signatures). Alice sends ten messages; every virtual server receives all ten, once each, in
    the order she sent them, in transactions whose X-Matrix signatures the peer verified against
    Tributary's key. An invite of a peer user is countersigned by the peer."""
    peer, names = await started_peer(make_peer, 5)
    client = tributary.client
    alice = await client.register_ok("alice")
    token = alice["access_token"]
    created = await client.request("POST", "createRoom", {"preset": "public_chat"}, token=token)
    assert created.status == 200, created
    room_id = created.body["room_id"]

    joins = {}
    for name in names:
        joins[name] = await peer.join(name, f"@u:{name}", room_id, via=tributary.server_name)
    assert peer.room_version(room_id) is not None

    sent = []
    for i in range(10):
        response = await client.request("PUT", f"rooms/{quote(room_id, safe='')}/send/m.room.message/m{i}",
                                        {"msgtype": "m.text", "body": f"message {i}"}, token=token)
        assert response.status == 200, response
        sent.append(response.body["event_id"])

    def messages(name: str) -> list[str]:
        return [p_id for p_id, pdu in zip(peer.received_pdu_ids(name, room_id), peer.received_pdus(name, room_id))
                if pdu["type"] == "m.room.message"]

    for name in names:
        await peer.wait_for_pdus(name, sent, timeout=30)
    for name in names:
        assert set(messages(name)) == set(sent), name
        assert messages(name) == sent, f"{name} received the messages out of order"
        assert not peer.duplicate_pdu_ids(name)
        txns = peer.transactions(name)
        assert txns and all(t.origin == tributary.server_name and not t.pdu_errors for t in txns)
        assert all(t.response == {"pdus": {e: {} for e in t.pdu_ids}} for t in txns)
        counts = peer.request_counts(name)
        assert counts["send"] == len(txns)
        assert counts["get_missing_events"] == 0
        assert counts["key/server"] >= 1  # Tributary fetched the key to check the join's signature
    # Later joins reach earlier joiners (Tributary forwards them as the resident server).
    await peer.wait_for_pdus(names[0], [joins[n] for n in names[1:]], timeout=30)

    invitee = f"@invited:{names[1]}"
    invited = await client.request("POST", f"rooms/{quote(room_id, safe='')}/invite", {"user_id": invitee},
                                   token=token)
    assert invited.status == 200, invited
    [invite] = peer.received_invites(names[1])
    assert (invite.origin, invite.room_id, invite.event["state_key"]) == (tributary.server_name, room_id, invitee)
    assert names[1] in invite.event["signatures"] and tributary.server_name in invite.event["signatures"]
    # The countersigned invite then reaches every server in the room like any other event.
    for name in names:
        await peer.wait_for_pdus(name, [invite.event_id], timeout=30)


async def test_repeated_transaction_is_deduplicated_and_signatures_are_checked(
        make_peer: list[FederationPeer]) -> None:
    """Virtual server A sends a signed transaction to B, then the same transaction ID again:
    B answers the stored response, records the repeat, and does not count its PDU again. A new
    transaction ID carrying the same PDU is a second delivery. A request signed with a key that
    is not A's, or addressed to another destination, is refused with 401 M_UNAUTHORIZED."""
    peer, (a, b) = await started_peer(make_peer, 2)
    pdu = signed_message(peer, a, "hello")
    edu = {"edu_type": "m.typing", "content": {"room_id": pdu["room_id"], "user_id": f"@u:{a}", "typing": True}}
    seen: list[ReceivedTransaction] = []
    peer.listeners.append(seen.append)

    first = await peer.send_transaction(a, b, "txn1", [pdu], [edu])
    [event_id] = peer.received_pdu_ids(b)
    assert first == {"pdus": {event_id: {}}}
    again = await peer.send_transaction(a, b, "txn1", [pdu], [edu])
    assert again == first
    txns = peer.transactions(b)
    assert [(t.origin, t.txn_id, t.repeat) for t in txns] == [(a, "txn1", False), (a, "txn1", True)]
    assert txns[0].pdus[0]["content"]["body"] == "hello" and txns[0].arrived_at <= txns[1].arrived_at
    assert peer.received_pdu_ids(b) == [event_id]
    assert peer.received_edus(b, "m.typing") == [edu] and peer.received_edus(b, "m.receipt") == []
    assert not peer.duplicate_pdu_ids(b)

    await peer.send_transaction(a, b, "txn2", [pdu])
    assert peer.received_pdu_ids(b) == [event_id]
    assert peer.duplicate_pdu_ids(b) == {event_id: 2}
    assert [t.txn_id for t in seen] == ["txn1", "txn1", "txn2"]
    await peer.wait_for_pdus(b, [event_id], timeout=1)
    with pytest.raises(TimeoutError, match="missing 1 of 2"):
        await peer.wait_for_pdus(b, [event_id, "$never"], timeout=0.2)
    assert peer.received_pdu_ids(a) == []
    assert peer.request_counts(b)["send"] == 3
    assert peer.request_counts(a)["key/server"] == 1  # B fetched A's key once, over HTTPS, then cached it

    impostor = FederationClient(reactor, server_name=a, signing_key=generate_signing_key(peer.signing_key(a).version),
                                verify_certificates=False, ip_range_whitelist=["127.0.0.0/8"])
    # Correctly signed by A but for destination A, while sent to B (the resolver is pointed at B).
    misdirected = FederationClient(reactor, server_name=a, signing_key=peer.signing_key(a),
                                   verify_certificates=False, ip_range_whitelist=["127.0.0.0/8"])
    misdirected.resolver.remember(a, Target("127.0.0.1", peer.port(b), "127.0.0.1"))
    try:
        for client, destination in ((impostor, b), (misdirected, a)):
            with pytest.raises(HttpResponseError) as info:
                await client.put_json(destination, "/_matrix/federation/v1/send/t3", {"pdus": [], "edus": []})
            assert (info.value.code, info.value.json["errcode"]) == (401, "M_UNAUTHORIZED")
    finally:
        await impostor.close()
        await misdirected.close()
    assert [t.txn_id for t in peer.transactions(b)] == ["txn1", "txn1", "txn2"]
    assert peer.request_counts(b)["send"] == 5


async def test_failure_behaviours(make_peer: list[FederationPeer]) -> None:
    """B's behaviour is switched while A sends to it: error statuses come back as set; ``hang``
    holds the request until the client's timeout; ``close`` drops the connection; ``pdu_errors``
    refuses each PDU; ``down`` refuses connections and coming back listens on the same port. None
    of the failed attempts is recorded as a received transaction."""
    peer, (a, b) = await started_peer(make_peer, 2)
    pdu = signed_message(peer, a, "hi")
    port = peer.port(b)

    for behaviour, code in ((Behaviour.ERROR_500, 500), (Behaviour.UNAUTHORIZED_401, 401),
                            (Behaviour.RATELIMIT_429, 429), (Behaviour.BAD_REQUEST_400, 400)):
        await peer.set_behaviour(b, behaviour)
        with pytest.raises(HttpResponseError) as info:
            await peer.send_transaction(a, b, f"t-{code}", [pdu])
        assert info.value.code == code
    assert peer.transactions(b) == []

    await peer.set_behaviour(b, Behaviour.HANG)
    with pytest.raises(FederationClientError) as failure:
        await peer.send_transaction(a, b, "t-hang", [pdu], timeout=0.5)
    assert not isinstance(failure.value, HttpResponseError)
    assert isinstance(failure.value, FederationTimeout), failure.value
    assert peer.request_counts(b)["send"] == 5 and peer.transactions(b) == []

    # A request held while hanging is answered once B recovers, if its client still waits.
    await peer.set_behaviour(b, Behaviour.HANG)
    pending = peer.send_transaction(a, b, "t-held", [pdu], timeout=10)
    held = Deferred.fromCoroutine(pending)
    await eventually(lambda: peer.held_requests(b) == 1, what="a held request")
    assert not held.called
    await peer.set_behaviour(b, Behaviour.OK)
    answer = await held
    assert list(answer["pdus"]) == peer.received_pdu_ids(b) and peer.held_requests(b) == 0

    await peer.set_behaviour(b, Behaviour.CLOSE)
    with pytest.raises(FederationClientError) as failure:
        await peer.send_transaction(a, b, "t-close", [pdu])
    assert not isinstance(failure.value, HttpResponseError)

    await peer.set_behaviour(b, Behaviour.PDU_ERRORS)
    second = signed_message(peer, a, "refused")
    answer = await peer.send_transaction(a, b, "t-errors", [second])
    [(refused_id, result)] = answer["pdus"].items()
    assert "error" in result and peer.transactions(b)[-1].pdu_errors
    assert refused_id not in peer.received_pdu_ids(b)

    await peer.set_behaviour(b, Behaviour.DOWN)
    # A's pooled connection was cut; its next attempt connects afresh and is refused.
    with pytest.raises(FederationClientError):
        await peer.send_transaction(a, b, "t-down", [pdu], timeout=5)
    with pytest.raises(FederationClientError) as failure:
        await peer.send_transaction(a, b, "t-down", [pdu], timeout=5)
    assert "ConnectionRefused" in str(failure.value), failure.value
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    await peer.set_behaviour(b, Behaviour.OK)
    assert peer.port(b) == port
    answer = await peer.send_transaction(a, b, "t-up", [second])
    assert answer == {"pdus": {refused_id: {}}}
    assert peer.received_pdu_ids(b)[-1] == refused_id
    assert peer.behaviour(b) is Behaviour.OK
