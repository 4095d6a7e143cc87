# tests: tests/integration/test_replication_tcp.py tests/integration/test_replication_processes.py
"""``start_replication``: builds one process's replication, on TCP or on Redis.

This module owns the choice of transport, made once from the configuration:
with Redis enabled every process joins the server's channel
(``replication.redis_transport``); else the main process listens and workers
connect over TCP (``replication.transport``). It sits above both transports,
which know nothing of each other, and returns a ``ReplicationService`` that
the composition root (``homeserver/app.py``) wires up and stops.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry
from twisted.internet.interfaces import IListeningPort, IReactorTCP

from replication.config import ReplicationConfig, connection_config
from replication.handler import ReplicationHandler, StreamSource
from replication.metrics import ReplicationMetrics
from replication.transport import (
    ReplicationClientFactory,
    ReplicationServerFactory,
    TwistedScheduler,
    check_listener_addresses,
)

__all__ = ["ReplicationService", "start_replication"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class ReplicationService:
    """Replication for one process, as built by ``start_replication``.

    ``handler`` is where the rest of the process plugs in (row handlers,
    callbacks, ``on_stream_advanced``). ``ports`` are the TCP listening ports
    (main process over TCP), ``client`` the TCP client factory (workers over
    TCP), ``redis`` the Redis transport (when Redis is enabled).
    """

    handler: ReplicationHandler
    metrics: ReplicationMetrics
    ports: list[IListeningPort] = attrs.field(factory=list)
    server: ReplicationServerFactory | None = None
    client: ReplicationClientFactory | None = None
    redis: Any = None  # RedisTransport; Any to keep redis imports out of TCP-only processes
    _stopped: bool = False

    async def stop(self) -> None:
        """Tell peers and stop: ``CLEAR_USER_SYNC`` from a worker, ``ERROR
        server stopping`` to connected workers, then close everything."""
        if self._stopped:
            return
        self._stopped = True
        self.handler.send_clear_user_sync()
        self.handler.stop()
        for port in self.ports:
            stopping = port.stopListening()
            if stopping is not None:
                await stopping
        self.ports.clear()
        if self.server is not None:
            self.server.close_all("server stopping")
        if self.client is not None:
            self.client.stop()
        if self.redis is not None:
            await self.redis.stop()


async def start_replication(
    reactor: Any,
    config: ReplicationConfig,
    registry: CollectorRegistry,
    *,
    server_name: str,
    instance_name: str,
    sources: Mapping[str, StreamSource],
    writes: Sequence[str] = (),
    listen: Sequence[tuple[str, int]] = (),
    connect_to: tuple[str, int] | None = None,
    redis_channel: str | None = None,
) -> ReplicationService:
    """Build and start replication for this process, named ``instance_name``,
    of the homeserver ``server_name``.

    - ``config``: replication's settings. With ``config.redis.enabled``, every
      process publishes and subscribes on the Redis channel named after the
      server (``redis_channel`` overrides the name, for tests), and ``listen``
      and ``connect_to`` are ignored; else this process listens on each
      ``(address, port)`` of ``listen`` (loopback only unless
      ``config.allow_unauthenticated``), and a worker connects to
      ``connect_to`` (the main process's listener).
    - ``sources``: every stream this process knows; ``writes``: those it writes.

    Returns the service; wire ``service.handler`` into the stream layer
    (``on_stream_advanced``) and the consumers (``add_row_handler``, ...), and
    ``await service.stop()`` at shutdown.
    """
    use_redis = bool(config.redis.enabled)
    metrics = ReplicationMetrics.create(registry, sources)
    handler = ReplicationHandler(
        instance_name,
        TwistedScheduler(reactor),
        sources=sources,
        writes=writes,
        metrics=metrics,
        announce_interval=1.0 if use_redis else None,
    )
    service = ReplicationService(handler, metrics)
    if use_redis:
        # Here, not at the top: a process on TCP never imports redis.
        from replication.redis_transport import RedisTransport

        service.redis = RedisTransport(
            url=config.redis.url,
            channel=redis_channel or server_name,
            instance_name=instance_name,
            handler=handler,
            clock=reactor,
            metrics=metrics,
        )
        handler.start()
        service.redis.start()
        return service
    check_listener_addresses([address for address, _port in listen], config.allow_unauthenticated)
    handler.start()
    if listen:
        service.server = ReplicationServerFactory(
            server_name, handler, reactor, metrics, connection_config(config)
        )
        tcp: IReactorTCP = reactor
        for address, port in listen:
            service.ports.append(tcp.listenTCP(port, service.server, interface=address))
            logger.info("listening for replication on %s:%d", address, port)
    if connect_to is not None:
        service.client = ReplicationClientFactory(
            instance_name, handler, reactor, metrics,
            connection_config(config, expected_server_name=server_name),
        )
        host, port = connect_to
        reactor.connectTCP(host, port, service.client)
    return service

