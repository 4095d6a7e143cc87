"""Gaps in front of received PDUs, against a real ``tributary`` process and the signing test peer
(issues 18 and 28): a long gap closed by ``get_missing_events`` in steps, a gap the origin will
not walk closed with ``/state_ids`` (its state events fetched and stored as outliers), a
transaction that carries children before parents, fifty orphans in one transaction, what
``/event``, ``/state`` and ``/state_ids`` answer for outliers and rejected events, and that a
server with only an invited user is sent no room events."""

# tests: homeserver/federation/gaps.py homeserver/federation/transaction.py homeserver/federation/history.py

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote as _quote

import pytest
from prometheus_client.parser import text_string_to_metric_families

from homeserver.events import EventTemplate, build_pdu, parse_create_room_request, select_auth_event_ids, sign_pdu
from homeserver.remote.client import HttpResponseError, Target
from tests.federation_peer import FederationPeer
from tests.harness import free_port
from tests.integration.test_federation import eventually, name, stored, two_servers
from tests.integration.test_federation_peer import Tributary, make_peer, running_tributary, started_peer
from tests.twisted_plugin import reactor

__all__ = ["make_peer"]


_TXN_IDS = itertools.count()


def quote(value: str) -> str:
    return _quote(value, safe="")


@pytest.fixture(scope="module")
def tributary(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tributary]:
    """One real process with the default ``federation_limits`` (the gap-filling bounds included)."""
    with running_tributary(postgres_template, tmp_path_factory.mktemp("tributary"), log_level="INFO") as running:
        yield running


def metric(tributary: Tributary, name: str, **labels: str) -> float:
    status, body = tributary.process.get("/metrics", port=tributary.process.metrics_port)
    assert status == 200
    return sum(sample.value for family in text_string_to_metric_families(body.decode())
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


async def _room_with_peer(tributary: Tributary, peer: FederationPeer, server: str,
                          user: str) -> tuple[str, str, str, str]:
    """A public room of ``user`` (registered here) that ``@u:server`` joined, then a message of
    ``user``; (token, room ID, that message's ID, the remote user)."""
    token = (await tributary.client.register_ok(user))["access_token"]
    created = await tributary.client.request("POST", "createRoom", {"preset": "public_chat"}, token=token)
    assert created.status == 200, created
    room_id = created.body["room_id"]
    remote = f"@u:{server}"
    await peer.join(server, remote, room_id, via=tributary.server_name)
    message = await _send(tributary, token, room_id, "after the join")
    return token, room_id, message, remote


async def _send(tributary: Tributary, token: str, room_id: str, body: str) -> str:
    response = await tributary.client.request(
        "PUT", f"rooms/{quote(room_id)}/send/m.room.message/{next(_TXN_IDS)}",
        {"msgtype": "m.text", "body": body}, token=token)
    assert response.status == 200, response
    return str(response.body["event_id"])


async def _chain(peer: FederationPeer, server: str, tributary: Tributary, room_id: str, on: str, n: int,
                 sender: str, *, rename_first: bool = False
                 ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[tuple[str, str], str]]:
    """``n`` signed PDUs of ``server`` in a line on top of ``on`` (a message, so the state after it
    is the state before it, read back with ``/state``); the first renames ``sender`` (a state
    event) when ``rename_first``. Also returns the ``/state_ids`` answer at ``on`` and the state
    there by key."""
    version = peer.room_version(room_id)
    assert version is not None
    client = peer.client(server)
    answer = await client.get_json(tributary.server_name, f"/_matrix/federation/v1/state/{quote(room_id)}",
                                   query={"event_id": on})
    ids = {(p["type"], p["state_key"]): peer._event_id(p) for p in answer["pdus"]}
    at_on = dict(ids)
    state_ids = await client.get_json(tributary.server_name, f"/_matrix/federation/v1/state_ids/{quote(room_id)}",
                                      query={"event_id": on})
    [on_pdu] = (await client.get_json(tributary.server_name, f"/_matrix/federation/v1/event/{quote(on)}"))["pdus"]
    pdus: list[dict[str, Any]] = []
    prev, depth = on, int(on_pdu["depth"])
    for i in range(n):
        if i == 0 and rename_first:
            template = EventTemplate("m.room.member", {"membership": "join", "displayname": "renamed"}, sender)
        else:
            template = EventTemplate("m.room.message", {"msgtype": "m.text", "body": f"remote {i}"})
        depth += 1
        pdu = build_pdu(version, template, sender=sender, room_id=room_id, prev_event_ids=[prev],
                        auth_event_ids=select_auth_event_ids(version, template, sender, ids), depth=depth,
                        origin_server_ts=int(reactor.seconds() * 1000) + i)
        event = sign_pdu(version, pdu, server, peer.signing_key(server))
        if template.state_key is not None:
            ids[(template.type, template.state_key)] = event.event_id
        pdus.append(dict(event.get_pdu_json()))
        prev = event.event_id
    return pdus, state_ids, at_on


def _ids(peer: FederationPeer, pdus: list[dict[str, Any]]) -> list[str]:
    return [peer._event_id(p) for p in pdus]


async def _client_event(tributary: Tributary, token: str, room_id: str, event_id: str) -> int:
    """The status a client gets for the event: 200 only when it is in the room's timeline."""
    response = await tributary.client.request("GET", f"rooms/{quote(room_id)}/event/{quote(event_id)}", token=token)
    return response.status


async def _timeline(tributary: Tributary, token: str, room_id: str) -> list[str]:
    """Event IDs of the room's /sync timeline (up to 200 events), oldest first."""
    sync_filter = json.dumps({"room": {"timeline": {"limit": 200}}})
    response = await tributary.client.request("GET", f"sync?filter={quote(sync_filter)}", token=token)
    assert response.status == 200, response
    return [e["event_id"] for e in response.body["rooms"]["join"][room_id]["timeline"]["events"]]


async def _fed_status(call: Any) -> tuple[int, str]:
    try:
        await call
    except HttpResponseError as e:
        return e.code, str((e.json or {}).get("errcode"))
    return 200, ""


@pytest.mark.timeout(120)
async def test_a_sixty_event_gap_is_closed_by_get_missing_events_in_steps(
        tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    """The peer's user writes 60 messages, but only the last reaches us (a sender that crashed and
    caught up with just the room's latest event). We walk back with get_missing_events, ten events
    a call, until we reach our own timeline, and store all 60 in order."""
    peer, [server] = await started_peer(make_peer, 1)
    token, room_id, on, remote = await _room_with_peer(tributary, peer, server, "gap_alice")
    pdus, _, _ = await _chain(peer, server, tributary, room_id, on, 60, remote)
    peer.serve_history(server, pdus)
    filled = metric(tributary, "tributary_federation_gaps_filled_total", method="get_missing_events")

    last = _ids(peer, pdus)[-1]
    answer = await peer.send_transaction(server, tributary.server_name, "gap60", [pdus[-1]])
    assert answer["pdus"] == {last: {}}
    calls = peer.request_counts(server)["get_missing_events"]
    assert 6 <= calls <= 7, calls  # 59 missing events, 10 a call
    assert peer.request_counts(server)["state_ids"] == 0
    for event_id in _ids(peer, pdus):
        assert await _client_event(tributary, token, room_id, event_id) == 200, event_id
    timeline = await _timeline(tributary, token, room_id)
    assert timeline[-60:] == _ids(peer, pdus)
    assert metric(tributary, "tributary_federation_gaps_filled_total", method="get_missing_events") == filled + 1


@pytest.mark.timeout(120)
async def test_a_gap_the_origin_will_not_walk_is_closed_with_state_ids(
        tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    """The origin answers get_missing_events with 404. We take the state before the PDU from its
    /state_ids at the PDU's prev event, fetch the state event we lack (the user's rename) with
    /event and store it and the prev event as outliers, and place the PDU in the room: clients
    see it in /sync and the rename is current state. Outliers and rejected events get 404 from
    /state and /state_ids; /event serves outliers (as Synapse does) but not rejected events."""
    peer, [server] = await started_peer(make_peer, 1)
    token, room_id, on, remote = await _room_with_peer(tributary, peer, server, "state_alice")
    pdus, at_on, keyed = await _chain(peer, server, tributary, room_id, on, 5, remote, rename_first=True)
    ids = _ids(peer, pdus)
    rename = ids[0]
    # The state before each of the chain's events after the rename: what it was at ``on``, with
    # the remote member replaced by the rename.
    state_after_rename = {"pdu_ids": sorted({*at_on["pdu_ids"], rename} - {keyed[("m.room.member", remote)]}),
                          "auth_chain_ids": at_on["auth_chain_ids"]}
    peer.serve_history(server, pdus, state_ids={i: state_after_rename for i in ids[1:]}, missing_events=False)
    filled = metric(tributary, "tributary_federation_gaps_filled_total", method="state_ids")

    answer = await peer.send_transaction(server, tributary.server_name, "gap-state", [pdus[-1]])
    assert answer["pdus"] == {ids[-1]: {}}
    assert peer.request_counts(server)["state_ids"] == 1
    assert metric(tributary, "tributary_federation_gaps_filled_total", method="state_ids") == filled + 1
    assert ids[-1] in await _timeline(tributary, token, room_id)
    assert await _client_event(tributary, token, room_id, ids[-1]) == 200
    # The rename is current state; the events in between are not in the timeline (an outlier or unknown).
    member = await tributary.client.request(
        "GET", f"rooms/{quote(room_id)}/state/m.room.member/{quote(remote)}", token=token)
    assert member.status == 200 and member.body.get("displayname") == "renamed", member
    for event_id in ids[:-1]:
        assert await _client_event(tributary, token, room_id, event_id) == 404

    # The next PDU builds on the placed one: an ordinary event again, no fetching.
    more, _, _ = await _chain(peer, server, tributary, room_id, ids[-1], 1, remote)
    answer = await peer.send_transaction(server, tributary.server_name, "after-gap", more)
    assert answer["pdus"] == {_ids(peer, more)[0]: {}}
    assert peer.request_counts(server)["state_ids"] == 1

    # /event serves an outlier; /state and /state_ids at it are 404.
    client = peer.client(server)
    outlier = ids[-2]  # the PDU's prev event, fetched with /event and stored as an outlier
    served = await client.get_json(tributary.server_name, f"/_matrix/federation/v1/event/{quote(outlier)}")
    assert peer._event_id(served["pdus"][0]) == outlier
    for kind in ("state", "state_ids"):
        status = await _fed_status(client.get_json(
            tributary.server_name, f"/_matrix/federation/v1/{kind}/{quote(room_id)}", query={"event_id": outlier}))
        assert status == (404, "M_NOT_FOUND"), (kind, status)

    # The origin now walks: a PDU forking off the outlier brings the chain in with
    # get_missing_events, and the outliers among it (the rename, the PDU's old prev event) are
    # promoted into the timeline.
    version = peer.room_version(room_id)
    assert version is not None
    state = dict(keyed)
    state[("m.room.member", remote)] = rename
    fork = _signed(peer, server, room_id, outlier, int(pdus[-2]["depth"]) + 1,
                   EventTemplate("m.room.message", {"msgtype": "m.text", "body": "fork"}), remote, state)
    peer.serve_history(server, [*pdus, fork], missing_events=True)
    answer = await peer.send_transaction(server, tributary.server_name, "fork", [fork])
    assert answer["pdus"] == {peer._event_id(fork): {}}
    for event_id in [*ids, peer._event_id(fork)]:
        assert await _client_event(tributary, token, room_id, event_id) == 200, event_id
    status = await _fed_status(client.get_json(
        tributary.server_name, f"/_matrix/federation/v1/state_ids/{quote(room_id)}", query={"event_id": outlier}))
    assert status == (200, "")

    # A rejected event (a power-level-0 user changes the power levels): 404 everywhere, and
    # left out of what /backfill serves.
    pl = await client.get_json(tributary.server_name, f"/_matrix/federation/v1/event/{quote(keyed[('m.room.power_levels', '')])}")
    template = EventTemplate("m.room.power_levels", {**pl["pdus"][0]["content"], "users": {remote: 100}}, "")
    grab = _signed(peer, server, room_id, _ids(peer, more)[0], int(more[0]["depth"]) + 1, template, remote, state)
    grab_id = peer._event_id(grab)
    answer = await peer.send_transaction(server, tributary.server_name, "grab", [grab])
    assert "error" in answer["pdus"][grab_id]
    assert await _fed_status(client.get_json(
        tributary.server_name, f"/_matrix/federation/v1/event/{quote(grab_id)}")) == (404, "M_NOT_FOUND")
    for kind in ("state", "state_ids"):
        status = await _fed_status(client.get_json(
            tributary.server_name, f"/_matrix/federation/v1/{kind}/{quote(room_id)}", query={"event_id": grab_id}))
        assert status == (404, "M_NOT_FOUND"), (kind, status)
    served = await client.get_json(tributary.server_name, f"/_matrix/federation/v1/backfill/{quote(room_id)}",
                                   query={"v": [grab_id], "limit": "5"})
    assert grab_id not in _ids(peer, served["pdus"])


def _signed(peer: FederationPeer, server: str, room_id: str, prev: str, depth: int, template: EventTemplate,
            sender: str, state: dict[tuple[str, str], str]) -> dict[str, Any]:
    """A signed PDU of ``server`` on ``prev``, its auth events picked from ``state``."""
    version = peer.room_version(room_id)
    assert version is not None
    pdu = build_pdu(version, template, sender=sender, room_id=room_id, prev_event_ids=[prev],
                    auth_event_ids=select_auth_event_ids(version, template, sender, state), depth=depth,
                    origin_server_ts=int(reactor.seconds() * 1000))
    return dict(sign_pdu(version, pdu, server, peer.signing_key(server)).get_pdu_json())


@pytest.mark.timeout(120)
async def test_a_transaction_with_children_before_parents_is_accepted_whole(
        tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    peer, [server] = await started_peer(make_peer, 1)
    token, room_id, on, remote = await _room_with_peer(tributary, peer, server, "order_alice")
    pdus, _, _ = await _chain(peer, server, tributary, room_id, on, 5, remote)
    shuffled = [pdus[4], pdus[2], pdus[0], pdus[3], pdus[1]]
    answer = await peer.send_transaction(server, tributary.server_name, "shuffled", shuffled)
    assert answer["pdus"] == {i: {} for i in _ids(peer, pdus)}
    assert peer.request_counts(server)["get_missing_events"] == 0
    assert (await _timeline(tributary, token, room_id))[-5:] == _ids(peer, pdus)


@pytest.mark.timeout(120)
async def test_fifty_orphans_in_one_transaction_take_one_bounded_walk(
        tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    """100 remote messages; the transaction carries every second one, so each of its 50 PDUs
    has an unknown prev event. One walk fetches the 50 missing events, ten a call: five calls,
    not fifty."""
    peer, [server] = await started_peer(make_peer, 1)
    token, room_id, on, remote = await _room_with_peer(tributary, peer, server, "orphans_alice")
    pdus, _, _ = await _chain(peer, server, tributary, room_id, on, 100, remote)
    peer.serve_history(server, pdus)
    sent = pdus[1::2]
    answer = await peer.send_transaction(server, tributary.server_name, "orphans", sent)
    assert answer["pdus"] == {i: {} for i in _ids(peer, sent)}
    assert peer.request_counts(server)["get_missing_events"] <= 6
    assert (await _timeline(tributary, token, room_id))[-100:] == _ids(peer, pdus)


@pytest.mark.timeout(120)
async def test_a_server_with_only_an_invited_user_is_sent_no_room_events(
        tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    """Alice invites a user of the peer's first server (the invite goes by /invite) and a user of
    its second server joins: her messages go to the joined server only."""
    peer, [invited_server, joined_server] = await started_peer(make_peer, 2)
    token, room_id, on, _ = await _room_with_peer(tributary, peer, joined_server, "invite_alice")
    invitee = f"@guest:{invited_server}"
    invited = await tributary.client.request("POST", f"rooms/{quote(room_id)}/invite", {"user_id": invitee},
                                             token=token)
    assert invited.status == 200, invited
    assert [i.room_id for i in peer.received_invites(invited_server)] == [room_id]
    messages = [await _send(tributary, token, room_id, f"for the joined {i}") for i in range(3)]
    await peer.wait_for_pdus(joined_server, messages)
    assert peer.received_pdu_ids(invited_server) == []


@pytest.mark.timeout(120)
async def test_the_walk_and_the_origins_budget_are_bounded(postgres_template: str, tmp_path_factory: pytest.TempPathFactory,
                                                          make_peer: list[FederationPeer]) -> None:
    """With ``missing_events_max: 20`` and a budget of three requests, a 60-event gap takes two
    get_missing_events calls (20 events) and one /state_ids at the oldest fetched event's prev
    event: the PDU and the 20 events before it are placed, the older 39 are left to backfill.
    The next gap finds the budget spent: the transaction is answered 429 and nothing is fetched
    or stored."""
    limits = {"missing_events_max": 20, "rc_missing_events": {"per_second": 0.001, "burst_count": 3}}
    with running_tributary(postgres_template, tmp_path_factory.mktemp("bounded"), log_level="INFO",
                           federation_limits=limits) as tributary:
        await _bounded(tributary, make_peer)


async def _bounded(tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    peer, [server] = await started_peer(make_peer, 1)
    token, room_id, on, remote = await _room_with_peer(tributary, peer, server, "bounded_alice")
    pdus, at_on, _ = await _chain(peer, server, tributary, room_id, on, 60, remote)
    ids = _ids(peer, pdus)
    peer.serve_history(server, pdus, state_ids={i: at_on for i in ids})

    answer = await peer.send_transaction(server, tributary.server_name, "long", [pdus[-1]])
    assert answer["pdus"] == {ids[-1]: {}}
    counts = peer.request_counts(server)
    assert (counts["get_missing_events"], counts["state_ids"]) == (2, 1)
    assert metric(tributary, "tributary_federation_gaps_filled_total", method="state_ids") == 1
    assert metric(tributary, "tributary_federation_gaps_filled_total", method="get_missing_events") == 0
    for event_id in ids[-21:]:
        assert await _client_event(tributary, token, room_id, event_id) == 200, event_id
    for event_id in ids[:-21]:
        assert await _client_event(tributary, token, room_id, event_id) == 404, event_id
    assert (await _timeline(tributary, token, room_id))[-21:] == ids[-21:]

    more, _, _ = await _chain(peer, server, tributary, room_id, ids[-1], 3, remote)
    peer.serve_history(server, more, state_ids={i: at_on for i in _ids(peer, more)})
    with pytest.raises(HttpResponseError) as refused:
        await peer.send_transaction(server, tributary.server_name, "over-budget", [more[-1]])
    # The whole transaction is put off (429), so its sender sends it again later: slowed, not lost.
    assert (refused.value.code, refused.value.json["errcode"]) == (429, "M_LIMIT_EXCEEDED"), refused.value.json
    assert refused.value.json["retry_after_ms"] > 0
    counts = peer.request_counts(server)
    assert (counts["get_missing_events"], counts["state_ids"]) == (2, 1)
    assert await _client_event(tributary, token, room_id, _ids(peer, more)[-1]) == 404


@pytest.mark.timeout(120)
async def test_much_missing_state_is_taken_from_one_state_request(
        tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    """The peer's user (power 100 here) set 110 state events we never saw; the origin will not
    walk. The state at the PDU's prev event names all of them: rather than 110 /event requests we
    take them from one /state, store them as outliers, and the PDU lands with that state."""
    peer, [server] = await started_peer(make_peer, 1)
    remote = f"@u:{server}"
    token = (await tributary.client.register_ok("bulk_alice"))["access_token"]
    created = await tributary.client.request("POST", "createRoom", {
        "preset": "public_chat", "power_level_content_override": {"users": {remote: 100}}}, token=token)
    assert created.status == 200, created
    room_id = created.body["room_id"]
    await peer.join(server, remote, room_id, via=tributary.server_name)
    on = await _send(tributary, token, room_id, "after the join")
    client = peer.client(server)
    answer = await client.get_json(tributary.server_name, f"/_matrix/federation/v1/state/{quote(room_id)}",
                                   query={"event_id": on})
    state = {(p["type"], p["state_key"]): peer._event_id(p) for p in answer["pdus"]}
    at_on = await client.get_json(tributary.server_name, f"/_matrix/federation/v1/state_ids/{quote(room_id)}",
                                  query={"event_id": on})
    [on_pdu] = (await client.get_json(tributary.server_name, f"/_matrix/federation/v1/event/{quote(on)}"))["pdus"]
    pdus: list[dict[str, Any]] = []
    prev, depth = on, int(on_pdu["depth"])
    for i in range(112):
        template = (EventTemplate("org.example.bulk", {"n": i}, f"key{i}") if i < 110
                    else EventTemplate("m.room.message", {"msgtype": "m.text", "body": f"after state {i}"}))
        depth += 1
        pdus.append(_signed(peer, server, room_id, prev, depth, template, remote, state))
        prev = peer._event_id(pdus[-1])
        if template.state_key is not None:
            state[(template.type, template.state_key)] = prev
    ids = _ids(peer, pdus)
    at_prev = {"pdu_ids": sorted({*at_on["pdu_ids"], *ids[:110]}), "auth_chain_ids": at_on["auth_chain_ids"]}
    peer.serve_history(server, pdus, state_ids={ids[-2]: at_prev}, missing_events=False)

    answer = await peer.send_transaction(server, tributary.server_name, "bulk", [pdus[-1]])
    assert answer["pdus"] == {ids[-1]: {}}
    counts = peer.request_counts(server)
    assert (counts["state_ids"], counts["state"]) == (1, 1)
    assert counts["event"] <= 1  # the prev event itself, when /state does not carry it
    assert ids[-1] in await _timeline(tributary, token, room_id)
    bulk = await tributary.client.request(
        "GET", f"rooms/{quote(room_id)}/state/org.example.bulk/key109", token=token)
    assert bulk.status == 200 and bulk.body == {"n": 109}, bulk


@pytest.mark.timeout(120)
async def test_soft_failed_is_success_in_the_answer_and_rejected_is_an_error(
        tributary: Tributary, make_peer: list[FederationPeer]) -> None:
    """Two PDUs in one transaction: a message built before Alice banned its sender passes the auth
    rules at the state before it but not at the current state (soft-failed: ``{}``, stored, hidden
    from clients); a power-levels change by the same power-0 user fails at its own state
    (rejected: an error)."""
    peer, [server] = await started_peer(make_peer, 1)
    token, room_id, on, remote = await _room_with_peer(tributary, peer, server, "soft_alice")
    _, _, state = await _chain(peer, server, tributary, room_id, on, 0, remote)
    [on_pdu] = (await peer.client(server).get_json(
        tributary.server_name, f"/_matrix/federation/v1/event/{quote(on)}"))["pdus"]
    pl = (await peer.client(server).get_json(
        tributary.server_name,
        f"/_matrix/federation/v1/event/{quote(state[('m.room.power_levels', '')])}"))["pdus"][0]
    late = _signed(peer, server, room_id, on, int(on_pdu["depth"]) + 1,
                   EventTemplate("m.room.message", {"msgtype": "m.text", "body": "too late"}), remote, state)
    grab = _signed(peer, server, room_id, on, int(on_pdu["depth"]) + 1,
                   EventTemplate("m.room.power_levels", {**pl["content"], "users": {remote: 100}}, ""),
                   remote, state)
    banned = await tributary.client.request("POST", f"rooms/{quote(room_id)}/ban", {"user_id": remote}, token=token)
    assert banned.status == 200, banned

    answer = await peer.send_transaction(server, tributary.server_name, "soft", [late, grab])
    late_id, grab_id = peer._event_id(late), peer._event_id(grab)
    assert answer["pdus"][late_id] == {}
    assert "error" in answer["pdus"][grab_id]
    assert await _client_event(tributary, token, room_id, late_id) == 404
    assert late_id not in await _timeline(tributary, token, room_id)
    assert metric(tributary, "tributary_federation_pdus_received_total", outcome="soft_failed") >= 1


@pytest.mark.timeout(180)
async def test_two_tributaries_a_gap_longer_than_the_walk_is_bridged_then_backfilled(
        database_dsn: str, second_database_dsn: str, tmp_path: Path) -> None:
    """Issue 28's failure between two Tributaries: B cannot be reached while Alice (A) sends 150
    messages, and A's catch-up then sends B only the room's latest event. B walks back 100 events
    with get_missing_events (A serves them), bridges the rest with A's /state_ids at the oldest
    fetched event's prev event, and stores the latest event: nothing is refused. The 50 older
    messages then come with /backfill when B pages back, so B ends with all 151."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        assert a.process.room_events is not None and b.process.federation is not None
        assert a.process.federation is not None and a.process.federation_sender is not None
        alice, bob = f"@alice:{name(a)}", f"@bob:{name(b)}"
        room_id = await a.process.room_events.create_room(alice, parse_create_room_request({"preset": "public_chat"}))
        await b.process.federation.membership.join_remote(room_id, bob, [name(a)])
        hello = await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": "hello"}), alice)
        await eventually(lambda: stored(b, hello.event_id))

        resolver = a.process.federation.client.resolver
        real_target = await resolver.resolve(name(b))
        # B stores hello before it answers: the sender's transaction can still be in flight, its
        # connection out of the pool, where close() would miss it and the lost messages reach B.
        await a.process.federation_sender.wait_idle()
        await a.process.federation.client.close()
        resolver.remember(name(b), Target("127.0.0.1", free_port(), "localhost"))  # nothing listens there
        lost = [await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": f"lost {i}"}),
                                                 alice) for i in range(150)]
        await a.process.federation_sender.wait_idle()
        resolver.remember(name(b), real_target)
        last = await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": "last"}), alice)
        row = await eventually(lambda: stored(b, last.event_id), timeout=60)
        assert not row.outlier and row.rejection_reason is None
        sample = b.registry.get_sample_value
        assert sample("tributary_federation_gaps_filled_total", {"method": "state_ids"}) == 1
        assert (sample("tributary_federation_pdus_received_total", {"outcome": "missing_events"}) or 0) == 0
        in_timeline = [e.event_id for e in lost if (r := await stored(b, e.event_id)) is not None and not r.outlier]
        assert in_timeline == [e.event_id for e in lost[-100:]]

        while await b.process.federation.backfill.backfill(room_id, limit=100):
            pass
        for event in [*lost, last]:
            row = await stored(b, event.event_id)
            assert row is not None and not row.outlier and row.rejection_reason is None, event.event_id
