# tests: tests/unit/replication/test_transport.py tests/unit/replication/test_handler.py
"""Prometheus metrics of replication, declared against a given registry.

This module owns the names, help texts and label sets of every
``tributary_replication_*`` metric. Labels come from closed sets only: the
transport kind (``TRANSPORTS``), the command name (``COMMAND_TYPES``), the
disconnect reason (``DISCONNECT_REASONS``), the stream name (the process's
stream registry), the writer instance (the configured writers) and the callback
kind (``CALLBACKS``); never a peer address, a user or a room. The state machine and the handler never import Prometheus themselves:
transports and the handler call the helpers here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge

from replication.commands import COMMAND_TYPES
from replication.connection import Trigger

__all__ = ["CALLBACKS", "DISCONNECT_REASONS", "ReplicationMetrics", "TRANSPORTS", "TransportCounters"]

#: Transport kinds: the main process's end of a TCP connection, a worker's end,
#: and the Redis channel.
TRANSPORTS: Final = ("tcp_server", "tcp_client", "redis")

#: Why a connection ended: the state machine's triggers, the transport going
#: away without either side deciding to (``connection_lost``), and a bug in a
#: handler caught by the adapter (``internal_error``).
DISCONNECT_REASONS: Final = tuple(t.value for t in Trigger if t is not Trigger.START) + (
    "connection_lost",
    "internal_error",
)

#: Kinds of callback the handler runs for other modules.
CALLBACKS: Final = ("rows", "user_sync", "clear_user_sync", "federation_ack", "remote_server_up")


@attrs.frozen
class TransportCounters:
    """The children of the per-command counters for one transport kind,
    resolved once so the hot path does a dict lookup, not a label lookup."""

    sent: Mapping[str, Counter]
    received: Mapping[str, Counter]
    connections: Gauge
    outbound_buffer: Gauge
    lines_ignored: Counter
    disconnects: Mapping[str, Counter]


@attrs.frozen
class ReplicationMetrics:
    connections: Gauge
    commands_sent: Counter
    commands_received: Counter
    outbound_buffer: Gauge
    disconnects: Counter
    lines_ignored: Counter
    commands_dropped: Counter
    reader_lag: Gauge
    rows_sent: Counter
    rows_applied: Counter
    rows_skipped: Counter
    gap_fills: Counter
    gap_fill_rows: Counter
    callback_failures: Counter
    redis_messages_published: Counter
    _transports: dict[str, TransportCounters] = attrs.field(factory=dict)

    @classmethod
    def create(cls, registry: CollectorRegistry, streams: Iterable[str] = ()) -> ReplicationMetrics:
        """Declare every metric on ``registry``; ``streams`` are the stream
        names of this process, pre-initialised so their series start at 0."""
        metrics = cls(
            connections=Gauge(
                "tributary_replication_connections",
                "Replication connections open now, by transport (tcp_server, tcp_client, redis).",
                ["transport"],
                registry=registry,
            ),
            commands_sent=Counter(
                "tributary_replication_commands_sent_total",
                "Replication commands queued for the peer, by transport and command name.",
                ["transport", "command"],
                registry=registry,
            ),
            commands_received=Counter(
                "tributary_replication_commands_received_total",
                "Replication commands received from peers, by transport and command name.",
                ["transport", "command"],
                registry=registry,
            ),
            outbound_buffer=Gauge(
                "tributary_replication_outbound_buffer_commands",
                "Commands held in memory because a peer (or Redis) is not taking them yet, by transport.",
                ["transport"],
                registry=registry,
            ),
            disconnects=Counter(
                "tributary_replication_disconnects_total",
                "Replication connections that ended, by transport and reason.",
                ["transport", "reason"],
                registry=registry,
            ),
            lines_ignored=Counter(
                "tributary_replication_lines_ignored_total",
                "Lines that did not parse and were dropped without closing (Redis only), by transport.",
                ["transport"],
                registry=registry,
            ),
            commands_dropped=Counter(
                "tributary_replication_commands_dropped_total",
                "Commands not sent because the transport was down; readers recover from the database.",
                ["transport"],
                registry=registry,
            ),
            reader_lag=Gauge(
                "tributary_replication_reader_lag",
                "Stream IDs between the newest position a writer announced and what this process applied, "
                "by stream and writer (series appear when the writer is first heard from).",
                ["stream", "writer"],
                registry=registry,
            ),
            rows_sent=Counter(
                "tributary_replication_rows_sent_total",
                "Stream rows this process sent as RDATA (once per row, whatever the number of peers), by stream.",
                ["stream"],
                registry=registry,
            ),
            rows_applied=Counter(
                "tributary_replication_rows_applied_total",
                "Stream rows from other writers handed to this process's handlers, by stream.",
                ["stream"],
                registry=registry,
            ),
            rows_skipped=Counter(
                "tributary_replication_rows_skipped_total",
                "RDATA rows dropped because a database catch-up had already applied them, by stream.",
                ["stream"],
                registry=registry,
            ),
            gap_fills=Counter(
                "tributary_replication_gap_fills_total",
                "Catch-ups from the database after a POSITION showed missed rows, by stream.",
                ["stream"],
                registry=registry,
            ),
            gap_fill_rows=Counter(
                "tributary_replication_gap_fill_rows_total",
                "Rows read from the database to fill gaps, by stream.",
                ["stream"],
                registry=registry,
            ),
            callback_failures=Counter(
                "tributary_replication_callback_failures_total",
                "Exceptions raised by callbacks that replication runs for other modules, by callback kind.",
                ["callback"],
                registry=registry,
            ),
            redis_messages_published=Counter(
                "tributary_replication_redis_messages_published_total",
                "Redis PUBLISH calls made (each carries one or more command lines).",
                registry=registry,
            ),
        )
        for stream in streams:
            metrics.add_stream(stream)
        for callback in CALLBACKS:
            metrics.callback_failures.labels(callback)
        for kind in TRANSPORTS:
            metrics.transport(kind)
        return metrics

    def add_stream(self, stream: str) -> None:
        """Start the per-stream series of ``stream`` at 0."""
        for metric in (self.rows_sent, self.rows_applied, self.rows_skipped, self.gap_fills, self.gap_fill_rows):
            metric.labels(stream)

    def transport(self, kind: str) -> TransportCounters:
        """The pre-resolved counters of one transport kind (one of ``TRANSPORTS``)."""
        counters = self._transports.get(kind)
        if counters is None:
            if kind not in TRANSPORTS:
                raise ValueError(f"transport kind must be one of {TRANSPORTS}, got {kind!r}")
            counters = TransportCounters(
                sent=MappingProxyType({name: self.commands_sent.labels(kind, name) for name in COMMAND_TYPES}),
                received=MappingProxyType(
                    {name: self.commands_received.labels(kind, name) for name in COMMAND_TYPES}
                ),
                connections=self.connections.labels(kind),
                outbound_buffer=self.outbound_buffer.labels(kind),
                lines_ignored=self.lines_ignored.labels(kind),
                disconnects=MappingProxyType(
                    {reason: self.disconnects.labels(kind, reason) for reason in DISCONNECT_REASONS}
                ),
            )
            self.commands_dropped.labels(kind)
            self._transports[kind] = counters
        return counters
