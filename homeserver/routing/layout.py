"""Who does what in a worker deployment: pure answers from the config.

``Layout`` reads the worker layout of ``homeserver.yaml`` (``workers``,
``instance_map``, ``stream_writers``, ``federation_sender_instances``) as seen
by one process, and answers the questions every process asks: which processes
write a stream, does this one, which event persister owns a room, which
federation sender owns a destination, and where another process's internal
API listens. No I/O here, so every process (and every test) gets the same
answers from the same config.

Rooms and destinations are mapped by a stable hash (SHA-256 of the ID, modulo
the number of instances), the same in every process and across restarts. The
mapping depends on the list's length and order: changing
``stream_writers.events`` or ``federation_sender_instances`` moves rooms or
destinations between instances, so every process must restart together with
the new list (docs/workers.md).
"""

# tests: tests/unit/routing/test_layout.py

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs

from homeserver.config import MAIN_INSTANCE, HomeserverConfig, InstanceLocation
from storage.streams import StreamName

# Streams whose writers follow another stream's: backfilled events are written
# by the events writers, since the room's owner persists them.
_WRITERS_OF: dict[StreamName, str] = {
    StreamName.EVENTS: "events",
    StreamName.BACKFILL: "events",
    StreamName.TYPING: "typing",
    StreamName.RECEIPTS: "receipts",
    StreamName.PRESENCE: "presence",
    StreamName.TO_DEVICE: "to_device",
    StreamName.ACCOUNT_DATA: "account_data",
}


def stable_shard(key: str, instances: Sequence[str]) -> str:
    """The instance among ``instances`` that owns ``key``: the same answer everywhere, always."""
    if not instances:
        raise ValueError("no instances to shard over")
    if len(instances) == 1:
        return instances[0]
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return instances[int.from_bytes(digest[:8], "big") % len(instances)]


@attrs.frozen
class Layout:
    config: HomeserverConfig
    instance_name: str = MAIN_INSTANCE

    @property
    def is_main(self) -> bool:
        return self.instance_name == MAIN_INSTANCE

    @property
    def app(self) -> str:
        """This process's role: ``main`` or the worker's ``app``."""
        if self.is_main:
            return "main"
        return self.config.workers[self.instance_name].app

    @property
    def processes(self) -> tuple[str, ...]:
        return (MAIN_INSTANCE, *self.config.workers)

    @property
    def has_workers(self) -> bool:
        return bool(self.config.workers)

    def writers(self, stream: StreamName) -> tuple[str, ...]:
        """The processes that write ``stream``, in configured order."""
        configurable = _WRITERS_OF.get(stream)
        if configurable is not None:
            return self.config.stream_writers.get(configurable, (MAIN_INSTANCE,))
        if stream == StreamName.CACHES:
            # Every process that writes anything may need to invalidate others' caches.
            writers = {MAIN_INSTANCE}
            for name in _WRITERS_OF.values():
                writers.update(self.config.stream_writers.get(name, ()))
            return tuple(sorted(writers, key=lambda w: (w != MAIN_INSTANCE, w)))
        return (MAIN_INSTANCE,)  # device_lists, federation

    def writes(self, stream: StreamName) -> bool:
        return self.instance_name in self.writers(stream)

    def events_writer_for_room(self, room_id: str) -> str:
        """The event persister that owns ``room_id``: it alone persists the room's events."""
        return stable_shard(room_id, self.writers(StreamName.EVENTS))

    def owns_room(self, room_id: str) -> bool:
        return self.events_writer_for_room(room_id) == self.instance_name

    def federation_sender_for(self, destination: str) -> str:
        """The process that sends to ``destination``: a federation sender worker, or the main process."""
        senders = self.config.federation_sender_instances
        return stable_shard(destination, senders) if senders else MAIN_INSTANCE

    def sends_to(self, destination: str) -> bool:
        return self.federation_sender_for(destination) == self.instance_name

    def location(self, instance: str) -> InstanceLocation:
        """Where ``instance``'s internal API listens (``instance_map``)."""
        try:
            return self.config.instance_map[instance]
        except KeyError:
            raise LookupError(f"{instance!r} is not in instance_map: no way to reach its internal API") from None
