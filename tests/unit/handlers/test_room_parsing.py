"""The pure parts of the room and sync handlers: filters, pagination tokens, the client event format."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.events import EventTemplate, FrozenEvent, get_room_version
from homeserver.events.event import make_event
from homeserver.handlers.rooms.client_events import format_event, strip_event
from homeserver.handlers.rooms.messages import parse_event_filter, parse_pagination_token, room_token
from homeserver.handlers.sync.sync import DEFAULT_TIMELINE_LIMIT, MAX_TIMELINE_LIMIT, SyncFilter
from storage.kernel.errors import MatrixError
from storage.room_tokens import RoomTokens
from storage.stores.timeline import RoomPosition
from storage.tokens import RoomStreamToken, StreamToken

V11 = get_room_version("11")


def _event(
    event_type: str = "m.room.message", content: dict[str, object] | None = None, state_key: str | None = None
) -> FrozenEvent:
    pdu: dict[str, object] = {
        "type": event_type,
        "room_id": "!r:hs",
        "sender": "@a:hs",
        "content": content if content is not None else {"body": "hello", "msgtype": "m.text"},
        "origin_server_ts": 1000,
        "depth": 3,
        "prev_events": [],
        "auth_events": [],
        "hashes": {"sha256": "x"},
        "signatures": {},
    }
    if state_key is not None:
        pdu["state_key"] = state_key
    return make_event(V11, pdu, trusted_event_id="$e")


def test_event_filter_matches_types_with_wildcards_and_senders() -> None:
    f = parse_event_filter({"types": ["m.room.*"], "not_types": ["m.room.member"], "not_senders": ["@b:hs"]})
    assert f.matches(_event())
    assert not f.matches(_event("m.room.member", {"membership": "join"}, "@a:hs"))
    assert not parse_event_filter({"senders": ["@b:hs"]}).matches(_event())
    assert parse_event_filter(None).matches(_event())


@pytest.mark.parametrize("bad", [[], {"limit": -1}, {"limit": True}, {"types": [1]}, {"lazy_load_members": "yes"}])
def test_event_filter_rejects_wrong_shapes_with_invalid_param(bad: object) -> None:
    with pytest.raises(MatrixError) as caught:
        parse_event_filter(bad)
    assert caught.value.status == 400 and caught.value.errcode == "M_INVALID_PARAM"


class KnownInstances:
    """The two instance IDs a test token uses (a fake of InstanceMap's lookups)."""

    names = {1: "p1", 2: "p2"}

    def get_cached_name(self, instance_id: int) -> str | None:
        return self.names.get(instance_id)

    async def get_name(self, instance_id: int) -> str | None:
        return self.names.get(instance_id)

    def ids(self) -> dict[str, int]:
        return {name: i for i, name in self.names.items()}


def run(coro: Any) -> Any:
    """Drive a coroutine that never waits (every lookup here is answered at once)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the coroutine waited")


def test_pagination_tokens_round_trip_and_accept_sync_tokens() -> None:
    tokens = RoomTokens(None, KnownInstances())  # type: ignore[arg-type]

    def parse(text: str) -> RoomPosition:
        return run(parse_pagination_token(text, tokens))

    assert parse(room_token(42)) == RoomPosition.at(42)
    # Backfilled history has negative stream orderings: "b{n}" is position -n.
    assert room_token(-3) == "b3"
    assert parse(room_token(-3)) == RoomPosition.at(-3)
    assert parse(StreamToken(RoomStreamToken.at(17)).to_string()) == RoomPosition.at(17)
    # With several event persisters: a position per writer, named as in events.instance_name.
    assert parse("m10~1.14~2.12") == RoomPosition(10, (("p1", 14), ("p2", 12)))
    assert tokens.token(parse("m10~1.14~2.12")).to_string() == "m10~1.14~2.12"
    for bad in ["", "garbage", "s-1", "s" + "9" * 40, "a_b", "b", "b-1", "bx", "b" + "9" * 40, "b\u0661",
                "m10~3.14"]:
        with pytest.raises(MatrixError):
            parse(bad)


def test_sync_filter_limits() -> None:
    assert SyncFilter.parse(None).timeline_limit == DEFAULT_TIMELINE_LIMIT
    assert SyncFilter.parse({"room": {"timeline": {"limit": 10**9}}}).timeline_limit == MAX_TIMELINE_LIMIT
    assert SyncFilter.parse({"room": {"timeline": {"limit": 0}}}).timeline_limit == 1
    assert SyncFilter.parse({"room": []}).timeline_limit == DEFAULT_TIMELINE_LIMIT
    assert SyncFilter.parse({"room": {"state": {"lazy_load_members": True}}}).state.lazy_load_members


def test_client_format_and_redaction() -> None:
    event = _event()
    plain = format_event(event, 1500, txn_id="t1")
    assert plain == {
        "event_id": "$e",
        "type": "m.room.message",
        "content": {"body": "hello", "msgtype": "m.text"},
        "sender": "@a:hs",
        "origin_server_ts": 1000,
        "room_id": "!r:hs",
        "unsigned": {"age": 500, "transaction_id": "t1"},
    }
    redacted = format_event(event, 1500, redacted_because={"event_id": "$r"}, include_room_id=False)
    assert redacted["content"] == {} and "room_id" not in redacted
    assert redacted["unsigned"]["redacted_because"] == {"event_id": "$r"}
    state = _event("m.room.name", {"name": "N"}, "")
    assert format_event(state, 1000)["state_key"] == ""
    assert strip_event(state) == {"type": "m.room.name", "state_key": "", "content": {"name": "N"}, "sender": "@a:hs"}
    assert EventTemplate(type="m.room.message", content={"body": "x"}).type == "m.room.message"
