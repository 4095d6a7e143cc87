# tests: tests/integration/test_replication_processes.py
"""A replication reader as its own OS process, for test_replication_processes.py.

``python -m tests.integration.replication_reader_proc CONFIG_JSON``, where the
JSON object has: ``name`` (instance name), ``server_name``, ``dsn``,
``streams`` (names), ``writer`` (the writer's instance name), ``out`` (the output file), ``control`` (a path: while a
file exists there, this reader is slow), and either ``redis_url`` plus
``channel`` (Redis) or ``port`` (TCP to 127.0.0.1).

The output file is the reader's record of what it applied, one line per
(stream, writer, token) its row handler was given, written with one
``os.write`` each so that a SIGKILL leaves whole lines (and at most one torn
last line, which the next start cuts off)::

    caches main 17 [["get_user_by_id",["@u17_0:hs"],1000]]

Lines starting with ``#`` are markers: ``# start {...}`` (the positions this
incarnation starts from), ``# ready`` (connected), ``# end {...}`` (positions
and counters, written on SIGTERM). Nothing else is persisted: a (re)started
reader starts each (stream, writer) from the last token in its file, so the
file as a whole is what it applied, and must hold every row exactly once.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: While slow, each call of the row handler blocks the reactor this long, so
#: the process stops reading its socket most of the time.
SLOW_SECONDS = 0.05
#: A slow reader's socket receive buffer (TCP), so that the writer sees it
#: fall behind within a few hundred commands, not megabytes.
SLOW_RCVBUF = 4096
FAST_RCVBUF = 1 << 20


def load_positions(out: Path) -> dict[tuple[str, str], int]:
    """The last token per (stream, writer) in ``out``; cuts off a torn last line."""
    positions: dict[tuple[str, str], int] = {}
    if not out.exists():
        return positions
    data = out.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete != len(data):
        with open(out, "r+b") as f:
            f.truncate(complete)
    for line in data[:complete].decode().splitlines():
        if line.startswith("#") or not line:
            continue
        stream, instance, token, _ = line.split(" ", 3)
        positions[(stream, instance)] = int(token)
    return positions


class StartPositions:
    """The reader's view of a stream's writers, as replication's
    ``IdGeneratorLike``: starts at the positions found in the output file and
    follows the applied rows (``GeneratorAdvancer``)."""

    def __init__(self, instance_name: str, stream: str, positions: dict[tuple[str, str], int]) -> None:
        self.instance_name = instance_name
        self._positions = {w: t for (s, w), t in positions.items() if s == stream}

    def get_position(self, instance: str) -> int:
        return self._positions.get(instance, 0)

    def advance(self, instance: str, position: int) -> None:
        self._positions[instance] = max(position, self._positions.get(instance, 0))

    def add_position_listener(self, listener: Any) -> None:
        pass


def main(spec: dict[str, Any]) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from homeserver.reactor import install_reactor

    reactor = install_reactor()

    from prometheus_client import CollectorRegistry
    from twisted.internet.task import LoopingCall

    from replication.config import RedisConfig, ReplicationConfig
    from replication.commands import Row
    from replication.service import start_replication
    from replication.stream_sources import connect_streams, stream_sources
    from storage.database import Database
    from storage.metrics import StorageMetrics
    from storage.streams import STREAMS, StreamName

    name: str = spec["name"]
    out = Path(spec["out"])
    control = Path(spec["control"])
    positions = load_positions(out)
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    record("# start " + json.dumps({f"{s} {w}": t for (s, w), t in sorted(positions.items())}))

    config = ReplicationConfig()
    if "redis_url" in spec:
        config = ReplicationConfig(redis=RedisConfig(enabled=True, url=spec["redis_url"]))
    db = Database(reactor, spec["dsn"], metrics=StorageMetrics.create(CollectorRegistry()), max_connections=2)
    db.start()
    definitions = {n: STREAMS[StreamName(n)] for n in spec["streams"]}
    gens = {n: StartPositions(name, n, positions) for n in spec["streams"]}
    registry = CollectorRegistry()
    state: dict[str, Any] = {"service": None, "ready": False, "slow": False}

    class Writer:
        """The row handler: what this reader applied, to the output file."""

        def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
            record(f"{stream} {instance} {token} {json.dumps(rows, separators=(',', ':'))}")
            if state["slow"]:
                time.sleep(SLOW_SECONDS)

    def set_rcvbuf(protocol: Any, size: int) -> None:
        if protocol is not None and protocol.transport is not None:
            protocol.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

    def watch() -> None:
        slow = control.exists()
        service = state["service"]
        protocol = service.client.protocol_instance if service is not None and service.client is not None else None
        if slow != state["slow"]:
            state["slow"] = slow
            # TCP: a small receive buffer while slow, so that the writer sees
            # this reader fall behind within hundreds of commands, not megabytes.
            set_rcvbuf(protocol, SLOW_RCVBUF if slow else FAST_RCVBUF)
        if service is None:
            return
        if service.client is not None:
            connected = protocol is not None and protocol.peer_name is not None
        else:
            connected = bool(service.redis.connected)
        if connected and not state["ready"]:
            state["ready"] = True
            record("# ready")

    async def start() -> None:
        sources = stream_sources(definitions, gens, db)
        service = await start_replication(
            reactor, config, registry, server_name=spec["server_name"], instance_name=name, sources=sources,
            connect_to=("127.0.0.1", spec["port"]) if "port" in spec else None,
            redis_channel=spec.get("channel"),
        )  # fmt: skip
        service.handler.add_row_handler(Writer())
        connect_streams(service.handler, gens)
        state["service"] = service

    def run() -> None:
        from twisted.internet.defer import Deferred

        d = Deferred.fromCoroutine(start())
        d.addErrback(lambda f: (f.printTraceback(file=sys.stderr), reactor.stop()))
        LoopingCall(watch).start(0.02)

    reactor.callWhenRunning(run)
    reactor.run()  # until SIGTERM
    service = state["service"]
    end: dict[str, Any] = {"positions": {}, "counters": {}}
    if service is not None:
        for stream in spec["streams"]:
            end["positions"][stream] = service.handler.position(stream, spec["writer"])
        for metric in registry.collect():
            for sample in metric.samples:
                if sample.name.startswith("tributary_replication_gap_fill") and sample.name.endswith("_total"):
                    key = f"{sample.name}:{sample.labels.get('stream', '')}"
                    end["counters"][key] = sample.value
    record("# end " + json.dumps(end))
    os.close(fd)
    db.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
