"""Issue 18's room rules against a real ``tributary`` process and the signing test peer:
redactions applied only as the room version allows, server ACLs on every inbound endpoint
that names a room and on outbound destinations, make_join/make_leave/make_knock running
the auth rules, and the per-origin limit on inbound invites."""

# tests: homeserver/events/server_acl.py homeserver/federation/membership.py homeserver/handlers/rooms/client_events.py

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote as _quote

import pytest

from homeserver.events import EventTemplate, build_pdu, get_room_version, select_auth_event_ids, sign_pdu
from homeserver.events import constants as C
from homeserver.remote.client import HttpResponseError
from tests.federation_peer import FederationPeer
from tests.integration.test_client_support import Client
from tests.integration.test_federation_peer import Tributary, make_peer, running_tributary, started_peer
from tests.twisted_plugin import eventually, reactor

__all__ = ["make_peer"]

UNLIMITED = {"per_second": 1000, "burst_count": 1000}
INVITES_PER_ORIGIN = 5


def quote(value: str) -> str:
    return _quote(value, safe="")


@pytest.fixture(scope="module")
def tributary(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tributary]:
    limits = {"per_room": UNLIMITED, "per_user": UNLIMITED, "per_issuer": UNLIMITED,
              "per_origin": {"per_second": 0.001, "burst_count": INVITES_PER_ORIGIN}}
    with running_tributary(postgres_template, tmp_path_factory.mktemp("tributary"), rc_invites=limits) as running:
        yield running


async def _room(tributary: Tributary, user: str, **create: Any) -> tuple[str, str]:
    """A room ``user`` (registered here) created; (token, room ID)."""
    registered = await tributary.client.register_ok(user)
    token = registered["access_token"]
    created = await tributary.client.request("POST", "createRoom", create or {"preset": "public_chat"}, token=token)
    assert created.status == 200, created
    return token, created.body["room_id"]


async def _send(tributary: Tributary, token: str, room_id: str, event_type: str, content: Mapping[str, Any],
                state_key: str | None = None) -> str:
    path = (f"rooms/{quote(room_id)}/state/{event_type}/{quote(state_key)}" if state_key is not None
            else f"rooms/{quote(room_id)}/send/{event_type}/t{reactor.seconds()}")
    response = await tributary.client.request("PUT", path, dict(content), token=token)
    assert response.status == 200, response
    return str(response.body["event_id"])


async def _remote_event(peer: FederationPeer, server: str, tributary: Tributary, room_id: str, prev: str,
                        event_type: str, sender: str, content: Mapping[str, Any], *, depth_above: int = 0,
                        redacts: str | None = None) -> dict[str, Any]:
    """A signed PDU of ``server`` on top of ``prev``, its auth events picked from the state there
    (read back over ``/state``)."""
    version = peer.room_version(room_id)
    assert version is not None
    answer = await peer.client(server).get_json(tributary.server_name, f"/_matrix/federation/v1/state/{quote(room_id)}",
                                                query={"event_id": prev})
    state = {(p["type"], p["state_key"]): p for p in answer["pdus"]}
    [prev_pdu] = (await peer.client(server).get_json(tributary.server_name,
                                                     f"/_matrix/federation/v1/event/{quote(prev)}"))["pdus"]
    ids = {key: peer._event_id(pdu) for key, pdu in state.items()}
    template = EventTemplate(event_type, dict(content), redacts=redacts)
    pdu = build_pdu(version, template, sender=sender, room_id=room_id, prev_event_ids=[prev],
                    auth_event_ids=select_auth_event_ids(version, template, sender, ids),
                    depth=int(prev_pdu["depth"]) + 1 + depth_above, origin_server_ts=int(reactor.seconds() * 1000))
    return dict(sign_pdu(version, pdu, server, peer.signing_key(server)).get_pdu_json())


async def _event(tributary: Tributary, token: str, room_id: str, event_id: str) -> dict[str, Any]:
    response = await tributary.client.request("GET", f"rooms/{quote(room_id)}/event/{quote(event_id)}", token=token)
    assert response.status == 200, response
    return dict(response.body)


async def _fed_error(call: Any) -> HttpResponseError:
    try:
        await call
    except HttpResponseError as e:
        return e
    raise AssertionError("the request succeeded")


@pytest.mark.timeout(120)
async def test_redactions_apply_only_as_the_room_version_allows(tributary: Tributary,
                                                                make_peer: list[FederationPeer]) -> None:
    peer, [server] = await started_peer(make_peer, 1)
    token, room_id = await _room(tributary, "redact_alice")
    remote = f"@u:{server}"
    await peer.join(server, remote, room_id, via=tributary.server_name)
    message = await _send(tributary, token, room_id, "m.room.message", {"msgtype": "m.text", "body": "keep me"})

    # A power-level-0 user of another server redacts the local user's message: the redaction is
    # accepted into the room but not applied.
    redaction = await _remote_event(peer, server, tributary, room_id, message, C.REDACTION, remote,
                                    {"redacts": message}, redacts=message)
    answer = await peer.send_transaction(server, tributary.server_name, "r1", [redaction])
    assert answer["pdus"] == {peer._event_id(redaction): {}}, answer
    served = await _event(tributary, token, room_id, message)
    assert served["content"] == {"msgtype": "m.text", "body": "keep me"}, served
    assert "redacted_because" not in served["unsigned"]
    synced = await tributary.client.request("GET", "sync", token=token)
    timeline = synced.body["rooms"]["join"][room_id]["timeline"]["events"]
    [as_synced] = [e for e in timeline if e["event_id"] == message]
    assert as_synced["content"]["body"] == "keep me"

    # A redaction that arrives before its target (same server as the target's sender): applied
    # once the target is here.
    first = peer._event_id(redaction)
    own = await _remote_event(peer, server, tributary, room_id, first, "m.room.message", remote,
                              {"msgtype": "m.text", "body": "regret"})
    own_id = peer._event_id(own)
    early = await _remote_event(peer, server, tributary, room_id, first, C.REDACTION, remote,
                                {"redacts": own_id}, redacts=own_id)
    await peer.send_transaction(server, tributary.server_name, "r2", [early])
    await peer.send_transaction(server, tributary.server_name, "r3", [own])
    served_own = await _event(tributary, token, room_id, own_id)
    assert served_own["content"] == {} and served_own["unsigned"]["redacted_because"]["event_id"] == peer._event_id(early)

    # The room's admin (the local creator) may redact the remote user's event.
    mine = await tributary.client.request("PUT", f"rooms/{quote(room_id)}/redact/{quote(own_id)}/x1", {}, token=token)
    assert mine.status == 200, mine


@pytest.mark.timeout(120)
async def test_client_redaction_of_another_rooms_event_or_the_acl_is_refused(tributary: Tributary) -> None:
    token, room_id = await _room(tributary, "redact_bob")
    _, other_room = await _room(tributary, "redact_carol")
    registered = await tributary.client.register_ok("redact_dave")
    other_token = registered["access_token"]
    joined = await tributary.client.request("POST", f"join/{quote(other_room)}", {}, token=other_token)
    assert joined.status == 200, joined
    elsewhere = await _send(tributary, other_token, other_room, "m.room.message", {"msgtype": "m.text", "body": "x"})
    refused = await tributary.client.request("PUT", f"rooms/{quote(room_id)}/redact/{quote(elsewhere)}/c1", {},
                                             token=token)
    assert (refused.status, refused.errcode) == (400, "M_UNKNOWN"), refused
    assert (await _event(tributary, other_token, other_room, elsewhere))["content"]["body"] == "x"
    acl = await _send(tributary, token, room_id, C.SERVER_ACL, {"allow": ["*"]}, state_key="")
    no = await tributary.client.request("PUT", f"rooms/{quote(room_id)}/redact/{quote(acl)}/c2", {}, token=token)
    assert (no.status, no.errcode) == (403, "M_FORBIDDEN"), no


@pytest.mark.timeout(120)
async def test_server_acls_refuse_a_denied_server_everywhere(tributary: Tributary,
                                                             make_peer: list[FederationPeer]) -> None:
    peer, [server] = await started_peer(make_peer, 1)
    token, room_id = await _room(tributary, "acl_alice")
    remote = f"@u:{server}"
    await peer.join(server, remote, room_id, via=tributary.server_name)
    before = await _send(tributary, token, room_id, "m.room.message", {"msgtype": "m.text", "body": "before"})
    await peer.wait_for_pdus(server, [before])
    # Every peer server is 127.0.0.1:<port>, so the ACL bans IP literals (our own server is
    # never subject to its rooms' ACLs).
    message = await _remote_event(peer, server, tributary, room_id, before, "m.room.message", remote,
                                  {"msgtype": "m.text", "body": "from a banned server"}, depth_above=1)
    # (built while /state still answers)
    acl = await _send(tributary, token, room_id, C.SERVER_ACL, {"allow": ["*"], "allow_ip_literals": False},
                      state_key="")

    client = peer.client(server)
    room = quote(room_id)
    calls = {
        "make_join": client.get_json(tributary.server_name, f"/_matrix/federation/v1/make_join/{room}/{quote(remote)}",
                                     query={"ver": ["10", "11", "12"]}),
        "make_leave": client.get_json(tributary.server_name, f"/_matrix/federation/v1/make_leave/{room}/{quote(remote)}"),
        "make_knock": client.get_json(tributary.server_name, f"/_matrix/federation/v1/make_knock/{room}/{quote(remote)}",
                                      query={"ver": ["12"]}),
        "state": client.get_json(tributary.server_name, f"/_matrix/federation/v1/state/{room}",
                                 query={"event_id": before}),
        "state_ids": client.get_json(tributary.server_name, f"/_matrix/federation/v1/state_ids/{room}",
                                     query={"event_id": before}),
        "backfill": client.get_json(tributary.server_name, f"/_matrix/federation/v1/backfill/{room}",
                                    query={"v": [before], "limit": "5"}),
        "event": client.get_json(tributary.server_name, f"/_matrix/federation/v1/event/{quote(before)}"),
        "get_missing_events": client.post_json(tributary.server_name,
                                               f"/_matrix/federation/v1/get_missing_events/{room}",
                                               {"earliest_events": [], "latest_events": [before]}),
        "send_leave": client.put_json(tributary.server_name, f"/_matrix/federation/v2/send_leave/{room}/$x",
                                      {"type": C.MEMBER}),
        "invite": client.put_json(tributary.server_name, f"/_matrix/federation/v2/invite/{room}/$x",
                                  {"event": {}, "room_version": "12"}),
    }
    for name, call in calls.items():
        error = await _fed_error(call)
        assert (error.code, error.json.get("errcode")) == (403, "M_FORBIDDEN"), (name, error)

    # /send: the banned server's PDUs are dropped (reported as errors), not stored.
    answer = await peer.send_transaction(server, tributary.server_name, "acl1", [message])
    assert "M_FORBIDDEN" in answer["pdus"][peer._event_id(message)]["error"], answer
    missing = await tributary.client.request("GET", f"rooms/{room}/event/{quote(peer._event_id(message))}",
                                             token=token)
    assert missing.status == 404, missing
    # ... and its typing EDUs for the room are dropped.
    edu = {"edu_type": "m.typing", "content": {"room_id": room_id, "user_id": remote, "typing": True}}
    await peer.send_transaction(server, tributary.server_name, "acl2", [], [edu])
    synced = await tributary.client.request("GET", "sync", token=token)
    typing = [e for e in synced.body["rooms"]["join"][room_id]["ephemeral"]["events"] if e["type"] == "m.typing"]
    assert all(remote not in e["content"]["user_ids"] for e in typing), typing

    # Outbound: the room's events and typing no longer go to the denied server.
    after = await _send(tributary, token, room_id, "m.room.message", {"msgtype": "m.text", "body": "after"})
    alice = f"@acl_alice:{tributary.server_name}"
    typed = await tributary.client.request("PUT", f"rooms/{room}/typing/{quote(alice)}",
                                           {"typing": True, "timeout": 30000}, token=token)
    assert typed.status == 200, typed
    marker = await _room(tributary, "acl_marker")
    await peer.join(server, remote, marker[1], via=tributary.server_name)
    marker_user = f"@acl_marker:{tributary.server_name}"
    await tributary.client.request("PUT", f"rooms/{quote(marker[1])}/typing/{quote(marker_user)}",
                                   {"typing": True, "timeout": 30000}, token=marker[0])
    flushed = await _send(tributary, marker[0], marker[1], "m.room.message", {"msgtype": "m.text", "body": "m"})
    await peer.wait_for_pdus(server, [flushed])
    await eventually(lambda: any(e["content"].get("room_id") == marker[1]
                                 for e in peer.received_edus(server, "m.typing")), what="the marker room's typing")
    received = set(peer.received_pdu_ids(server, room_id))
    assert after not in received and acl not in received, received
    typing_rooms = {e["content"].get("room_id") for e in peer.received_edus(server, "m.typing")}
    assert room_id not in typing_rooms, typing_rooms

    # Lifting the ACL lets the server back in.
    await _send(tributary, token, room_id, C.SERVER_ACL, {"allow": ["*"]}, state_key="")
    state = await client.get_json(tributary.server_name, f"/_matrix/federation/v1/state_ids/{room}",
                                  query={"event_id": before})
    assert state["pdu_ids"]


@pytest.mark.timeout(120)
async def test_make_membership_runs_the_auth_rules(tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    peer, [server] = await started_peer(make_peer, 1)
    client = peer.client(server)
    remote = f"@u:{server}"

    def make(kind: str, room_id: str, ver: bool = True) -> Any:
        return client.get_json(tributary.server_name,
                               f"/_matrix/federation/v1/make_{kind}/{quote(room_id)}/{quote(remote)}",
                               query={"ver": ["10", "11", "12"]} if ver else None)

    # Invite-only: no join template for a user nobody invited; no knock template either.
    _, private = await _room(tributary, "mj_alice", preset="private_chat")
    for kind in ("join", "knock"):
        error = await _fed_error(make(kind, private))
        assert (error.code, error.json.get("errcode")) == (403, "M_FORBIDDEN"), (kind, error)
    # Not in the room: nothing to leave.
    error = await _fed_error(make("leave", private, ver=False))
    assert (error.code, error.json.get("errcode")) == (403, "M_FORBIDDEN"), error

    # Public: a join template; a banned user gets 403 instead.
    token, public = await _room(tributary, "mj_bob")
    made = await make("join", public)
    assert made["event"]["content"] == {"membership": "join"} and made["room_version"]
    error = await _fed_error(make("knock", public))  # the join rule is public, not knock
    assert error.code == 403, error
    banned = await tributary.client.request("POST", f"rooms/{quote(public)}/ban", {"user_id": remote}, token=token)
    assert banned.status == 200, banned
    error = await _fed_error(make("join", public))
    assert (error.code, error.json.get("errcode")) == (403, "M_FORBIDDEN"), error

    # A knock room: a knock template.
    knock_token, knock_room = await _room(tributary, "mj_carol", preset="private_chat")
    await _send(tributary, knock_token, knock_room, C.JOIN_RULES, {"join_rule": "knock"}, state_key="")
    made = await make("knock", knock_room)
    assert made["event"]["content"] == {"membership": "knock"}


@pytest.mark.timeout(120)
async def test_inbound_invites_are_rate_limited_per_origin(tributary: Tributary,
                                                           make_peer: list[FederationPeer]) -> None:
    peer, [server] = await started_peer(make_peer, 1)
    host = tributary.server_name
    version = get_room_version("11")
    statuses = []
    for i in range(INVITES_PER_ORIGIN + 3):
        room_id = f"!spam{i}:{server}"
        invitee = f"@victim{i}:{host}"
        template = EventTemplate(C.MEMBER, {"membership": "invite"}, state_key=invitee)
        pdu = build_pdu(version, template, sender=f"@spammer:{server}", room_id=room_id, prev_event_ids=[],
                        auth_event_ids=[], depth=1, origin_server_ts=int(reactor.seconds() * 1000))
        event = sign_pdu(version, pdu, server, peer.signing_key(server))
        try:
            await peer.client(server).put_json(
                host, f"/_matrix/federation/v2/invite/{quote(room_id)}/{quote(event.event_id)}",
                {"event": event.get_pdu_json(), "room_version": "11", "invite_room_state": []})
            statuses.append(200)
        except HttpResponseError as e:
            assert e.json.get("errcode") == "M_LIMIT_EXCEEDED" and e.json.get("retry_after_ms", 0) > 0, e.json
            statuses.append(e.code)
    assert statuses == [200] * INVITES_PER_ORIGIN + [429] * 3, statuses
