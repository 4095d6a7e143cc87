# tests: tests/unit/replication/test_config.py
"""Replication's settings, as typed values: what ``start_replication`` is given.

This module owns the shape and the defaults of replication's configuration and
the one conversion replication needs from it (``connection_config``, for the
sans-I/O core). It deliberately does not read files or YAML: ``homeserver/config.py``
is the one loader, and it parses the ``replication`` and ``redis`` sections and
``allow_unauthenticated_replication`` of ``homeserver.yaml`` into a
``ReplicationConfig`` (reporting bad values with their dotted key path). Where a
process listens and connects are plain arguments of ``start_replication``, not
settings here: they come from the process's listeners and the worker layout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final

import attrs

from replication.connection import (
    KEEPALIVE_INTERVAL_SECONDS,
    MAX_OUTBOUND_BUFFER,
    PING_TIMEOUT_SECONDS,
    ConnectionConfig,
)

__all__ = ["DEFAULT_REDIS_URL", "RedisConfig", "ReplicationConfig", "connection_config"]

DEFAULT_REDIS_URL: Final = "redis://127.0.0.1:6379/0"


@attrs.frozen
class RedisConfig:
    """``redis``: with ``enabled``, every process publishes and subscribes on one
    Redis channel (named after the server) instead of the TCP connections."""

    enabled: bool = False
    url: str = DEFAULT_REDIS_URL


@attrs.frozen
class ReplicationConfig:
    """Everything replication reads from the configuration file.

    From the ``replication`` section: ``keepalive_interval`` (send something at
    least this often), ``timeout`` (close a connection silent this long, after
    its first PING) and ``max_outbound_buffer`` (commands held for a slow
    reader before it is cut off). ``redis`` is the ``redis`` section;
    ``allow_unauthenticated`` is ``allow_unauthenticated_replication``, the
    opt-in for TCP listeners on addresses other than loopback. The defaults
    are the protocol's constants in ``replication.connection``.
    """

    keepalive_interval: timedelta = timedelta(seconds=KEEPALIVE_INTERVAL_SECONDS)
    timeout: timedelta = timedelta(seconds=PING_TIMEOUT_SECONDS)
    max_outbound_buffer: int = MAX_OUTBOUND_BUFFER
    redis: RedisConfig = RedisConfig()
    allow_unauthenticated: bool = False


def connection_config(config: ReplicationConfig, *, expected_server_name: str | None = None) -> ConnectionConfig:
    """The core's ``ConnectionConfig``: keep-alive and timeout in seconds, the
    congestion bound, and (for a client) the server name it must be greeted with."""
    return ConnectionConfig(
        keepalive_interval=config.keepalive_interval.total_seconds(),
        timeout=config.timeout.total_seconds(),
        max_outbound_buffer=config.max_outbound_buffer,
        expected_server_name=expected_server_name,
    )
