"""What the pusher sends a push gateway: the spec's notification in full and
``event_id_only`` form, badge-only updates, and how it reads the gateway's answer; and the
pool's scheduling (a slow gateway, retries, rejection, stopping) with an in-memory store,
a gateway the test answers and a fake clock."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.web.client import URI

from homeserver.remote.client import IpFilter
from homeserver.handlers.push.pusher import (
    GatewayBlocked,
    PusherMetrics,
    PusherPool,
    badge_payload,
    notification_payload,
    rejected_pushkeys,
    _FilteredEndpoints,
    tweaks_of,
)
from storage.kernel.written_events import WrittenEvent, WrittenEvents
from storage.stores.push import Notification, PusherRow


def pusher(**data: object) -> PusherRow:
    return PusherRow(1, "@bob:example.org", None, "http", "org.example", "key1", "App", "Phone", None, "en",
                     json.dumps({"url": "https://gw.example/_matrix/push/v1/notify", **data}), 1_700_000_000_123, 0,
                     None)


NOTE = Notification("@bob:example.org", "!r:example.org", "$e", 7, True,
                    json.dumps(["notify", {"set_tweak": "sound", "value": "default"}, {"set_tweak": "highlight"}]), 1)
EVENT = {"type": "m.room.message", "sender": "@alice:example.org", "content": {"body": "hi bob"}}


def test_full_format() -> None:
    body = notification_payload(pusher(extra="x"), NOTE, EVENT, 3)["notification"]
    assert body == {
        "event_id": "$e", "id": "$e", "room_id": "!r:example.org", "counts": {"unread": 3}, "prio": "high",
        "type": "m.room.message", "sender": "@alice:example.org", "content": {"body": "hi bob"},
        "devices": [{"app_id": "org.example", "pushkey": "key1", "pushkey_ts": 1_700_000_000,
                     "data": {"extra": "x"}, "tweaks": {"sound": "default", "highlight": True}}],
    }


def test_event_id_only_format_carries_no_content() -> None:
    body = notification_payload(pusher(format="event_id_only"), NOTE, EVENT, 1)["notification"]
    assert set(body) == {"event_id", "room_id", "counts", "prio", "devices"}
    assert body["devices"][0]["data"] == {"format": "event_id_only"}


def test_badge_update_has_no_event() -> None:
    body = badge_payload(pusher(), 0)["notification"]
    assert body["counts"] == {"unread": 0} and body["id"] == "" and "tweaks" not in body["devices"][0]


def test_tweaks_and_gateway_answers() -> None:
    assert tweaks_of(["notify", {"set_tweak": "highlight", "value": False}, "x", 3]) == {"highlight": False}
    assert tweaks_of("nonsense") == {}
    assert rejected_pushkeys(200, {"rejected": ["a", 5]}) == ["a"]
    assert rejected_pushkeys(200, None) == [] and rejected_pushkeys(200, {"rejected": "a"}) == []
    assert rejected_pushkeys(500, {"rejected": ["a"]}) is None


# --- the pool, with an in-memory store, a gateway the test answers and a fake clock ------------

class MemoryStore:
    """The PushStore methods the pool uses, over lists."""

    def __init__(self, pushers: list[PusherRow], notes: list[Notification]) -> None:
        self.pushers = {p.id: p for p in pushers}
        self.notes = notes
        self.scans = 0

    async def get_pushers_with_pending(self, upto: int) -> list[PusherRow]:
        self.scans += 1
        return [p for p in self.pushers.values()
                if any(p.last_stream_ordering < n.stream_ordering <= upto and n.user_id == p.user_id
                       for n in self.notes)]

    async def get_notifications_between(self, user_id: str, after: int, upto: int, limit: int) -> list[Notification]:
        return sorted((n for n in self.notes if n.user_id == user_id and after < n.stream_ordering <= upto),
                      key=lambda n: n.stream_ordering)[:limit]

    async def get_badge_count(self, user_id: str) -> int:
        return 0

    async def advance_pusher(self, pusher_id: int, stream_ordering: int, *, failing_since: int | None) -> None:
        p = self.pushers[pusher_id]
        self.pushers[pusher_id] = attrs.evolve(p, last_stream_ordering=max(p.last_stream_ordering, stream_ordering))

    async def set_pusher_failing(self, pusher_id: int, failing_since: int | None) -> None:
        pass

    async def delete_pusher_by_id(self, pusher_id: int) -> None:
        self.pushers.pop(pusher_id, None)


class Gateway:
    """Holds each POST until the test answers it."""

    def __init__(self) -> None:
        self.waiting: list[tuple[str, Mapping[str, Any], Deferred[tuple[int, Any]]]] = []

    def post(self, url: str, body: Mapping[str, Any]) -> Deferred[tuple[int, Any]]:
        d: Deferred[tuple[int, Any]] = Deferred()
        self.waiting.append((url, body, d))
        return d

    def answer(self, index: int, status: int = 200, body: Any = None) -> str:
        url, sent, d = self.waiting.pop(index)
        d.callback((status, {} if body is None else body))
        return str(sent["notification"].get("event_id"))


def note(user: str, position: int) -> Notification:
    return Notification(user, "!r:x", f"${position}", position, False, '["notify"]', 0)


def pool(store: MemoryStore, gateway: Gateway, clock: Clock, position: list[int],
         written: WrittenEvents | None = None) -> PusherPool:
    async def load(ids: list[str]) -> Mapping[str, Mapping[str, Any]]:
        return {}

    return PusherPool(store=store, load_events=load, transport=gateway, clock=clock,  # type: ignore[arg-type]
                      metrics=PusherMetrics.create(CollectorRegistry()), events_position=lambda: position[0],
                      receipts_position=lambda: 0, written=written)


def test_events_persisted_here_that_notify_no_pusher_need_no_scan() -> None:
    """Positions 2 and 3 were persisted by this process and notified no one with a pusher: the
    stream moving over them starts no scan. Position 4 notified a user with a pusher: scanned,
    and pushed. Position 5 was written by another process (no note): scanned."""
    store = MemoryStore([user_pusher(1, "@a:x")], [])
    gateway, clock, position = Gateway(), Clock(), [1]
    written = WrittenEvents()
    p = pool(store, gateway, clock, position, written)
    p.start()
    assert store.scans == 1
    for n in (2, 3):
        written.note(n, WrittenEvent(state=False, fanout=False, pushes=False))
        position[0] = n
        p.on_events_moved()
    assert store.scans == 1
    written.note(4, WrittenEvent(state=False, fanout=False, pushes=True))
    store.notes.append(note("@a:x", 4))
    position[0] = 4
    p.on_events_moved()
    assert store.scans == 2 and gateway.answer(0) == "$4"
    position[0] = 5
    p.on_events_moved()
    assert store.scans == 4  # the delivery's end scanned once more, then position 5


def user_pusher(pusher_id: int, user: str) -> PusherRow:
    return attrs.evolve(pusher(), id=pusher_id, user_id=user, pushkey=f"k{pusher_id}")


def test_a_slow_gateway_holds_up_only_its_own_pusher_and_nothing_is_sent_twice() -> None:
    """Two users' pushers; the first gateway does not answer. The second user's pushes go
    out meanwhile, in order, once each, though the stream moves (and scans run) many times."""
    store = MemoryStore([user_pusher(1, "@a:x"), user_pusher(2, "@b:x")],
                        [note("@a:x", 1), note("@b:x", 2), note("@b:x", 3)])
    gateway, clock, position = Gateway(), Clock(), [3]
    p = pool(store, gateway, clock, position)
    p.start()
    assert [body["notification"]["event_id"] for _, body, _ in gateway.waiting] == ["$1", "$2"]
    for _ in range(3):
        p.on_new_events()  # a busy stream: the scan finds both pushers busy
    assert gateway.answer(1) == "$2"
    p.on_new_events()
    assert [body["notification"]["event_id"] for _, body, _ in gateway.waiting] == ["$1", "$3"]
    assert gateway.answer(1) == "$3" and gateway.answer(0) == "$1"
    p.on_new_events()
    assert gateway.waiting == []
    assert store.pushers[1].last_stream_ordering == 1 and store.pushers[2].last_stream_ordering == 3


def test_a_failed_push_is_retried_after_the_backoff_and_a_rejected_pushkey_removes_the_pusher() -> None:
    store = MemoryStore([user_pusher(1, "@a:x")], [note("@a:x", 1), note("@a:x", 2)])
    gateway, clock, position = Gateway(), Clock(), [2]
    p = pool(store, gateway, clock, position)
    p.start()
    gateway.answer(0, status=503)
    p.on_new_events()
    assert gateway.waiting == []  # backing off: not tried before its time
    clock.advance(60)
    assert gateway.answer(0) == "$1"  # the same notification, then the next
    assert gateway.answer(0, body={"rejected": ["k1"]}) == "$2"
    assert store.pushers == {}
    position[0] = 3
    store.notes.append(note("@a:x", 3))
    p.on_new_events()
    assert gateway.waiting == []


def test_stop_waits_for_the_push_in_flight() -> None:
    store = MemoryStore([user_pusher(1, "@a:x")], [note("@a:x", 1)])
    gateway, clock = Gateway(), Clock()
    p = pool(store, gateway, clock, [1])
    p.start()
    stopped = p.stop()
    assert not stopped.called
    gateway.answer(0)
    assert stopped.called and store.pushers[1].last_stream_ordering == 1



class Resolving:
    """A reactor that resolves every name to one address and connects nowhere."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.connected: list[tuple[str, int]] = []

    def resolve(self, name: str) -> Deferred[str]:
        d: Deferred[str] = Deferred()
        d.callback(self.address)
        return d

    def connectTCP(self, host: str, port: int, factory: Any, timeout: float = 30, bindAddress: Any = None) -> Any:
        self.connected.append((host, port))
        raise ConnectionRefusedError("test reactor")


def connect(endpoints: Any, url: bytes) -> Any:
    d = endpoints.endpointForURI(URI.fromBytes(url)).connect(object())
    failures: list[Any] = []
    d.addErrback(failures.append)
    return failures[0].value


def test_gateways_in_private_ranges_are_refused_unless_whitelisted() -> None:
    for address, url in [("10.1.2.3", b"http://gw.internal/_matrix/push/v1/notify"),
                         ("127.0.0.1", b"http://127.0.0.1:5000/_matrix/push/v1/notify"),
                         ("::1", b"http://[::1]:5000/_matrix/push/v1/notify")]:
        reactor = Resolving(address)
        assert isinstance(connect(_FilteredEndpoints(reactor, IpFilter(()), 5.0), url), GatewayBlocked)
        assert reactor.connected == []
    reactor = Resolving("10.1.2.3")
    assert isinstance(connect(_FilteredEndpoints(reactor, IpFilter(("10.0.0.0/8",)), 5.0),
                              b"http://gw.internal:8080/_matrix/push/v1/notify"), ConnectionRefusedError)
    assert reactor.connected == [("10.1.2.3", 8080)]  # the address it checked, not the name again
