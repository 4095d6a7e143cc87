"""The worker layout's answers: who writes what, who owns a room or a destination."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from homeserver.config import parse_config
from storage.streams import StreamName
from homeserver.routing.layout import Layout, stable_shard


def layout(name: str = "master", **extra: Any) -> Layout:
    raw: dict[str, Any] = {
        "server_name": "example.org",
        "database": {"url": "postgresql://localhost/x"},
        "redis": {"enabled": True},
        "worker_replication_secret": "s",
        "send_federation": False,
        "listeners": [{"type": "http", "port": 8008}, {"type": "http", "port": 9000, "resources": ["replication"]}],
        "instance_map": {n: {"host": n, "port": 9000} for n in ("master", "p1", "p2", "fs1", "fs2")},
        "stream_writers": {"events": ["p1", "p2"], "typing": ["g1"]},
        "federation_sender_instances": ["fs1", "fs2"],
        "workers": {
            "p1": {"app": "event_persister", "listeners": [{"type": "http", "port": 9000, "resources": ["replication"]}]},
            "p2": {"app": "event_persister", "listeners": [{"type": "http", "port": 9000, "resources": ["replication"]}]},
            "g1": {"app": "generic", "listeners": [{"type": "http", "port": 9000, "resources": ["replication"]}]},
            "fs1": {"app": "federation_sender", "listeners": [{"type": "http", "port": 9000, "resources": ["replication"]}]},
            "fs2": {"app": "federation_sender", "listeners": [{"type": "http", "port": 9000, "resources": ["replication"]}]},
        },
        **extra,
    }
    raw["instance_map"]["g1"] = {"host": "g1", "port": 9000}
    return Layout(parse_config(raw), name)


def test_writers_follow_stream_writers_and_default_to_the_main_process() -> None:
    hs = layout()
    assert hs.writers(StreamName.EVENTS) == ("p1", "p2")
    assert hs.writers(StreamName.BACKFILL) == ("p1", "p2")  # the room's owner persists its history too
    assert hs.writers(StreamName.TYPING) == ("g1",)
    assert hs.writers(StreamName.RECEIPTS) == ("master",)
    assert hs.writers(StreamName.DEVICE_LISTS) == ("master",)
    assert hs.writers(StreamName.FEDERATION) == ("master",)
    # Every process that writes something may have caches to invalidate elsewhere.
    assert hs.writers(StreamName.CACHES) == ("master", "g1", "p1", "p2")
    assert layout("p1").writes(StreamName.EVENTS) and not layout("p1").writes(StreamName.RECEIPTS)
    assert layout("fs1").app == "federation_sender" and layout().app == "main"


def test_rooms_and_destinations_are_spread_and_every_process_agrees() -> None:
    views = {name: layout(name) for name in ("master", "p1", "p2", "g1", "fs1", "fs2")}
    main = views["master"]
    rooms = [f"!room{i}:example.org" for i in range(1000)]
    owners = Counter(main.events_writer_for_room(room) for room in rooms)
    assert set(owners) == {"p1", "p2"} and min(owners.values()) > 400
    for room in rooms[:50]:
        owner = main.events_writer_for_room(room)
        assert views[owner].owns_room(room)
        assert views["g1"].events_writer_for_room(room) == owner
    senders = Counter(main.federation_sender_for(f"server{i}.org") for i in range(1000))
    assert set(senders) == {"fs1", "fs2"}
    assert views["fs1"].sends_to("a.org") != views["fs2"].sends_to("a.org")


def test_without_workers_the_main_process_owns_everything() -> None:
    hs = Layout(parse_config({"server_name": "example.org"}))
    assert hs.owns_room("!any:example.org") and hs.sends_to("other.org") and not hs.has_workers
    assert hs.writers(StreamName.CACHES) == ("master",)


@given(st.text(min_size=1, max_size=80), st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=6, unique=True))
def test_stable_shard_is_a_pure_function_of_key_and_list(key: str, instances: list[str]) -> None:
    owner = stable_shard(key, instances)
    assert owner in instances
    assert stable_shard(key, list(instances)) == owner  # same answer, always (no process-seeded hash)


def test_stable_shard_is_fixed_across_releases() -> None:
    # Pinned values (SHA-256 of the key, first 8 bytes, modulo the count): a change here would
    # move rooms between persisters on upgrade.
    assert stable_shard("!abc:example.org", ["p1", "p2"]) == "p1"
    assert [stable_shard(f"!r{i}:x", ["a", "b", "c"]) for i in range(6)] == ["c", "c", "c", "b", "a", "a"]
