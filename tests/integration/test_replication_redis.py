# tests: replication/redis_transport.py replication/handler.py
"""Replication over a real Redis: several writers feed every reader through one
channel, readers survive losing their Redis connection and being too slow for
Redis, and a process never acts on its own echoes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from replication.commands import Row
from replication.handler import MemoryStream, ReplicationHandler
from replication.redis_transport import RedisTransport
from tests.integration.test_replication_support import (
    STREAMS,
    Producer,
    Recorder,
    assert_exactly_once,
    converged,
    make_handler,
    wait_until,
)
from tests.twisted_plugin import reactor


class Gate:
    """A reader's view of a stream whose reads wait while the gate is closed."""

    def __init__(self, stream: MemoryStream) -> None:
        self.stream = stream
        self.closed = False
        self.waiting: list[Deferred[None]] = []

    @property
    def name(self) -> str:
        return self.stream.name

    def current_position(self, instance: str) -> int:
        return 0

    async def get_updates_between(
        self, instance: str, from_token: int, to_token: int, limit: int
    ) -> tuple[list[tuple[int, Row]], int, bool]:
        if self.closed:
            waiter: Deferred[None] = Deferred()
            self.waiting.append(waiter)
            await waiter
        return await self.stream.get_updates_between(instance, from_token, to_token, limit)

    def open(self) -> None:
        self.closed = False
        waiting, self.waiting = self.waiting, []
        for waiter in waiting:
            waiter.callback(None)


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


def kill_clients(client: redis.Redis, prefix: str) -> int:
    """Drop every Redis connection whose client name starts with ``prefix``."""
    killed = 0
    for info in client.client_list():
        if info.get("name", "").startswith(prefix):
            client.client_kill_filter(_id=info["id"])
            killed += 1
    return killed


async def test_two_writers_feed_two_readers_through_a_lost_connection_and_a_slow_reader(
    redis_url: str, unique_name: str, sync_redis: redis.Redis
) -> None:
    """Two writers: ``master`` writes events and caches, ``persister1`` writes
    events (a multi-writer stream) and typing. They produce 12,000 rows.
    Reader A loses its Redis connections half-way; on reconnecting it sends
    REPLICATE, both writers answer with POSITION, and A fills the gap from the
    streams. Reader B becomes slow (its database reads stall while RDATA keeps
    coming): it stops reading, and is dropped as Redis drops a subscriber whose
    output buffer overflows; once its reads are fast again it reconnects and
    refills from the streams. Both readers end with every row of both writers exactly
    once, in order, at the writers' positions."""
    streams = {name: MemoryStream(name) for name in STREAMS}
    writes = {"master": ("events", "caches"), "persister1": ("events", "typing")}
    transports: list[RedisTransport] = []
    writers: dict[str, tuple[ReplicationHandler, tuple[str, ...]]] = {}

    def transport(handler: ReplicationHandler, name: str, metrics: object) -> RedisTransport:
        t = RedisTransport(
            url=redis_url, channel=unique_name, instance_name=name, handler=handler, clock=reactor,
            metrics=metrics,  # type: ignore[arg-type]
        )
        transports.append(t)
        t.start()
        return t

    for name, names in writes.items():
        handler, metrics, _ = make_handler(name, dict(streams), writes=names, announce_interval=1.0)
        handler.start()
        transport(handler, name, metrics)
        writers[name] = (handler, names)
    gates = {s: Gate(streams[s]) for s in STREAMS}
    readers = {}
    for name in ("reader_a", "reader_b"):
        sources: dict[str, object] = dict(gates) if name == "reader_b" else {s: streams[s].view() for s in STREAMS}
        handler, metrics, registry = make_handler(name, sources, max_queued=500)
        recorder = Recorder()
        handler.add_row_handler(recorder)
        readers[name] = (handler, recorder, transport(handler, name, metrics), registry)
    try:
        for t in transports:
            await t.wait_connected()
        producer = Producer(streams, writers)
        await producer.produce(2_000)
        # B becomes slow: its reads stall from now on, and it has to catch up.
        b_handler, _, b_transport, _ = readers["reader_b"]
        for gate in gates.values():
            gate.closed = True
        assert kill_clients(sync_redis, b_transport.client_name) == 2
        await wait_until(lambda: b_transport.sessions >= 2, 10, "reader B to reconnect after the kill")
        await wait_until(lambda: any(g.waiting for g in gates.values()), 10, "reader B's catch-up to stall")
        await producer.produce(6_000)
        await wait_until(lambda: b_handler.backlogged, 10, "reader B to hold too much and stop reading")
        # Redis would now drop B once its output buffer for B passed
        # client-output-buffer-limit; on loopback the kernel's socket buffers
        # take megabytes first, so do what Redis would do, now.
        assert kill_clients(sync_redis, b_transport.client_name) == 2
        assert kill_clients(sync_redis, readers["reader_a"][2].client_name) == 2
        await producer.produce(20_000)
        for gate in gates.values():
            gate.open()
        await wait_until(lambda: b_transport.sessions >= 3, 15, "Redis to drop slow reader B and B to reconnect")
        for name, (handler, recorder, _, _) in readers.items():
            await wait_until(lambda: converged(handler, streams), 30, f"{name} to catch up")
            assert_exactly_once(recorder, handler, streams)
            assert recorder.count == 20_000
        assert readers["reader_a"][2].sessions >= 2
    finally:
        for gate in gates.values():
            gate.open()
        for t in transports:
            await t.stop()
        for handler, _ in writers.values():
            handler.stop()


async def test_cross_process_commands_and_own_echoes(redis_url: str, unique_name: str) -> None:
    """USER_SYNC, FEDERATION_ACK and REMOTE_SERVER_UP reach the other
    processes and never come back to their sender; every (re)connection sends
    REPLICATE, which writers answer and their sender ignores."""
    transports = []
    seen: dict[str, list[object]] = {"sync1": [], "master": []}
    handlers = {}
    for name in ("sync1", "master"):
        handler, metrics, registry = make_handler(name, {"events": MemoryStream("events")}, writes=["events"])
        handler.add_user_sync_listener(seen[name].append)
        handler.add_federation_ack_listener(lambda i, t, name=name: seen[name].append(("ack", i, t)))
        handler.add_remote_server_up_listener(lambda s, name=name: seen[name].append(("up", s)))
        t = RedisTransport(
            url=redis_url, channel=unique_name, instance_name=name, handler=handler, clock=reactor, metrics=metrics
        )
        t.start()
        transports.append((t, registry))
        handlers[name] = handler
    try:
        for t, _ in transports:
            await t.wait_connected()
        handlers["sync1"].send_user_sync("@a:hs", "DEV", True, 5)
        handlers["sync1"].send_federation_ack(9)
        handlers["sync1"].send_remote_server_up("other.example")
        await wait_until(lambda: len(seen["master"]) == 3, 10, "the commands to reach master")
        assert seen["master"][1:] == [("ack", "sync1", 9), ("up", "other.example")]
        await deferLater(reactor, 0.2)
        assert seen["sync1"] == []
        # Each process got the other's REPLICATE (and not its own) and the
        # other's POSITION (and not its own, or it would track itself).
        for t, registry in transports:
            assert registry.get_sample_value(
                "tributary_replication_commands_received_total", {"transport": "redis", "command": "REPLICATE"}
            ) == 1
        assert handlers["master"].position("events", "master") is None
        assert handlers["master"].position("events", "sync1") == 0
    finally:
        for t, _ in transports:
            await t.stop()


async def test_one_command_per_message_and_foreign_lines(
    redis_url: str, unique_name: str, sync_redis: redis.Redis
) -> None:
    """Lines published one per message (as Synapse does) are understood; a
    line that does not parse is ignored and counted, not fatal; with
    ``max_lines_per_message=1`` this process publishes one line per message."""
    stream = MemoryStream("events")
    handler, metrics, registry = make_handler("worker1", {"events": stream.view()})
    recorder = Recorder()
    handler.add_row_handler(recorder)
    t = RedisTransport(
        url=redis_url, channel=unique_name, instance_name="worker1", handler=handler, clock=reactor,
        metrics=metrics, max_lines_per_message=1,
    )
    pubsub = sync_redis.pubsub()
    pubsub.subscribe(unique_name)
    t.start()
    try:
        await t.wait_connected()
        stream.write("master", 1, [("a",)])
        stream.write("master", 2, [("b",)])
        ours = ("POSITION events master 0 0", "HELLO world", 'RDATA events master 2 ["b"]')
        for line in ours:
            sync_redis.publish(unique_name, line)
        await wait_until(lambda: handler.position("events", "master") == 2, 10, "the rows")
        # RDATA 2 after POSITION 0: row 1 was missed, but only a POSITION shows
        # gaps; the next periodic POSITION would. Here the writer's RDATA is
        # applied as it comes.
        assert recorder.rows[("events", "master")] == [(2, ("b",))]
        assert registry.get_sample_value("tributary_replication_lines_ignored_total", {"transport": "redis"}) == 1
        handler.send_user_sync("@a:hs", None, True, 1)
        handler.send_federation_ack(3)
        messages = []
        for _ in range(20):
            message = pubsub.get_message(timeout=0.2)
            if message and message["type"] == "message" and message["data"].decode() not in ours:
                messages.append(message["data"])
            await deferLater(reactor, 0.01)
            if len(messages) >= 3:
                break
        assert messages == [b"REPLICATE ", b"USER_SYNC worker1 @a:hs None start 1", b"FEDERATION_ACK worker1 3"]
    finally:
        pubsub.close()
        await t.stop()
