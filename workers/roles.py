"""The worker roles this package ships, published as plug-ins (``pyproject.toml``'s
``tributary.workers`` entry points) and looked up by name by ``homeserver.roles.load_role``.

Each is data: which resources and servlets the process serves, which streams it
may write, whether it sends federation, and an optional ``start`` hook for what
else it runs. Nothing in ``homeserver/`` imports this module.
"""

# tests: tests/unit/test_roles.py

from __future__ import annotations

from typing import Final

from homeserver.roles import WorkerRole
from workers.appservice import start_appservice_sender
from workers.background import start_background
from workers.pusher import start_pusher

GENERIC: Final = WorkerRole(
    name="generic",
    description="Client reads (/sync, simplified sliding sync, /messages, state, members, events, profiles) "
                "and inbound federation; "
                "writes are forwarded to their owners.",
    resources=frozenset({"client", "federation", "keys", "replication", "health"}),
    servlets="worker",
    streams=frozenset({"typing", "receipts", "presence", "to_device", "account_data"}),
)

EVENT_PERSISTER: Final = WorkerRole(
    name="event_persister",
    description="Writes the events stream for the rooms it owns (stable hash of the room ID).",
    resources=frozenset({"replication", "health"}),
    streams=frozenset({"events"}),
)

FEDERATION_SENDER: Final = WorkerRole(
    name="federation_sender",
    description="Sends to the destinations it owns (stable hash of the server name).",
    resources=frozenset({"replication", "health"}),
    sends_federation=True,
)

BACKGROUND: Final = WorkerRole(
    name="background",
    description="Periodic jobs (pruning stream tables: workers/pruning.py) and the user directory's updater "
                "(workers/background.py), taken off the main process.",
    resources=frozenset({"replication", "health"}),
    start=start_background,
    main_runs_without_worker=True,
)

PUSHER: Final = WorkerRole(
    name="pusher",
    description="Delivers notifications to push gateways (workers/pusher.py), taken off the main process.",
    resources=frozenset({"replication", "health"}),
    start=start_pusher,
    main_runs_without_worker=True,
)

MEDIA_REPOSITORY: Final = WorkerRole(
    name="media_repository",
    description="The media repository: uploads, downloads, thumbnails, remote media, URL previews and the media "
                "admin API (docs/media.md); the main process then serves none of it.",
    resources=frozenset({"client", "federation", "replication", "health"}),
    servlets="media",
)

APPSERVICE: Final = WorkerRole(
    name="appservice",
    description="Pushes events to application services (workers/appservice.py), taken off the main process.",
    resources=frozenset({"replication", "health"}),
    start=start_appservice_sender,
    main_runs_without_worker=True,
)
