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
from workers.pruning import start_pruning

GENERIC: Final = WorkerRole(
    name="generic",
    description="Client reads (/sync, /messages, state, members, events, profiles) and inbound federation; "
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
    description="Periodic jobs (pruning stream tables: workers/pruning.py), taken off the main process.",
    resources=frozenset({"replication", "health"}),
    start=start_pruning,
    main_runs_without_worker=True,
)
