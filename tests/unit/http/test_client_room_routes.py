"""The room-side client servlets' declarations: registration order, callers and guest narrowing.

The router matches in registration order and worker roles route by servlet name, so the
order and names are pinned here as they were when each servlet registered itself; the guest
narrowing is part of each declaration (``guests=``).
"""

from __future__ import annotations

from typing import Any, cast

from homeserver.http.client_api.directory import DirectoryServlets
from homeserver.http.client_api.relations import RelationsServlets
from homeserver.http.client_api.room_upgrade import RoomUpgradeServlet
from homeserver.http.client_api.rooms import EphemeralServlets, HistoryServlets, RedactionServlet, RoomServlets
from homeserver.http.client_api.search import SearchServlet
from homeserver.http.client_api.sliding_sync import SlidingSyncServlet
from homeserver.http.client_api.sync import LegacySyncServlets, SyncServlet
from homeserver.http.routes import Caller, Endpoint, endpoints

NOTHING = cast(Any, None)


def room_side() -> list[Endpoint]:
    return endpoints(
        RoomServlets(NOTHING), HistoryServlets(NOTHING), RedactionServlet(NOTHING),
        EphemeralServlets(NOTHING, NOTHING, NOTHING), RelationsServlets(NOTHING),
        DirectoryServlets(NOTHING, NOTHING), SearchServlet(NOTHING), RoomUpgradeServlet(NOTHING),
        SyncServlet(NOTHING, NOTHING), SlidingSyncServlet(NOTHING), LegacySyncServlets(NOTHING),
    )


def by_name(name: str) -> Endpoint:
    [endpoint] = [e for e in room_side() if e.name == name]
    return endpoint


def test_servlets_register_in_the_order_they_always_did() -> None:
    assert [(e.method, e.name) for e in room_side()] == [
        ("POST", "client_create_room"), ("GET", "client_room_alias"), ("PUT", "client_room_alias_put"),
        ("DELETE", "client_room_alias_delete"), ("POST", "client_join"), ("POST", "client_knock"),
        ("POST", "client_room_membership"), ("GET", "client_joined_rooms"), ("GET", "client_room_members"),
        ("GET", "client_room_joined_members"), ("PUT", "client_room_send"), ("POST", "client_room_send_no_txn"),
        ("PUT", "client_room_state_put"), ("GET", "client_room_state_event"), ("GET", "client_room_state"),
        ("GET", "client_room_event"), ("GET", "client_room_messages"), ("GET", "client_room_context"),
        ("PUT", "client_room_redact"), ("PUT", "client_room_typing"), ("POST", "client_room_receipt"),
        ("POST", "client_room_read_markers"),
        ("GET", "client_room_relations"), ("GET", "client_room_threads"),
        ("GET", "client_directory_visibility"), ("PUT", "client_directory_set_visibility"),
        ("GET", "client_public_rooms"), ("POST", "client_public_rooms_filtered"),
        ("POST", "client_user_directory_search"), ("GET", "client_room_hierarchy"),
        ("POST", "client_search"), ("POST", "client_room_upgrade"), ("GET", "client_sync"),
        ("POST", "client_sliding_sync"),
        ("GET", "client_initial_sync"), ("GET", "client_room_initial_sync"), ("GET", "client_events_stream"),
    ]


def test_only_directory_and_alias_reads_are_open_to_anyone() -> None:
    assert {e.name for e in room_side() if e.caller is Caller.NONE} == {
        "client_room_alias", "client_directory_visibility", "client_public_rooms"}


def test_guests_send_only_messages_and_only_join_or_leave() -> None:
    send = by_name("client_room_send")
    assert send.guest_allowed({"room_id": "!r:hs", "event_type": "m.room.message", "txn_id": "1"})
    assert not send.guest_allowed({"room_id": "!r:hs", "event_type": "m.room.encrypted", "txn_id": "1"})
    assert not send.guest_allowed({})
    assert not by_name("client_room_send_no_txn").guest_allowed({"event_type": "m.room.message"})
    membership = by_name("client_room_membership")
    assert membership.guest_allowed({"action": "leave"})
    assert not membership.guest_allowed({"action": "invite"})
    assert by_name("client_sync").guest_allowed({})
    assert not by_name("client_create_room").guest_allowed({})
