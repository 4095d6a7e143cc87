"""Process roles: what a kind of process serves, found by name among installed plug-ins.

A role is a ``WorkerRole`` published under the entry-point group
``tributary.workers`` (the roles of ``workers/`` are declared in
``pyproject.toml``). This module is the plug-in interface and the main
process's role; it imports no role, so ``homeserver/`` never imports ``workers/``. ``tributary worker --name NAME`` looks up the role named
by ``workers.NAME.app`` and the process is built from what the role declares:

- ``resources``: the HTTP resources its listeners may serve (``client``,
  ``federation``, ``keys``, ``replication``, ``health``);
- ``servlets``: which client and federation servlets it registers (all of
  them, or all but those that must run on the main process);
- ``streams``: the streams it may be named a writer of in ``stream_writers``
  (it follows every stream, through replication);
- ``sends_federation``: whether it runs a federation sender for its share of
  destinations;
- ``start``: an optional hook, run once the process's services exist, for
  whatever else the role does; it gets a ``RoleContext`` and returns what to
  stop at shutdown;
- ``main_runs_without_worker``: the main process runs the role's ``start``
  hook itself when no worker of the role is configured (periodic jobs that
  must run somewhere).

A new role is a module with a ``WorkerRole`` and an entry point; the launcher
does not change.
"""

# tests: tests/unit/test_roles.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from importlib.metadata import entry_points
from typing import Any, Final, Protocol

import attrs
from prometheus_client import CollectorRegistry

from homeserver.config import ENTRY_POINT_GROUP, HomeserverConfig, known_roles
from storage.database import Database
from storage.id_generators import StreamIdGenerator
from storage.kernel.written_events import WrittenEvents


# Servlets that write what only the main process writes (device lists, access
# tokens and devices): served by the main process alone; nginx sends them there.
MAIN_ONLY_SERVLETS: Final = frozenset({
    "client_register",
    "client_login",
    "client_logout",
    "client_logout_all",
    "client_change_password",
    "client_deactivate",
    "client_device_update",
    "client_device_delete",
    "client_delete_devices",
    "client_keys_upload",
    "client_keys_device_signing_upload",  # UIA sessions, and the device_lists stream
    "client_keys_signatures_upload",
    "client_3pid_request_token",
    "client_register_request_token",
    "client_password_request_token",
    "client_3pid_add",
    "client_3pid_bind",
    "client_3pid_delete",
    "client_3pid_unbind",
})


class Stoppable(Protocol):
    """What a role hook started; ``stop`` may return a Deferred that fires once it has stopped."""

    def stop(self) -> object: ...


@attrs.frozen
class RoleContext:
    """What a role's ``start`` hook may use of the process it runs in."""

    config: HomeserverConfig
    instance_name: str
    reactor: Any
    db: Database
    # Subscribe to FEDERATION_ACK (sender instance, federation stream position) from replication.
    on_federation_ack: Callable[[Callable[[str, int], None]], None]
    # The process's metrics registry, and its stream ID generators by stream name (positions
    # and position listeners, local or fed by replication).
    registry: CollectorRegistry = attrs.field(factory=CollectorRegistry)
    streams: Mapping[str, StreamIdGenerator] = attrs.field(factory=dict)
    # What this process persisted at recent events-stream positions (``storage/kernel/written_events.py``).
    written_events: WrittenEvents | None = None


RoleHook = Callable[[RoleContext], Awaitable[Stoppable]]


@attrs.frozen
class WorkerRole:
    name: str
    description: str
    resources: frozenset[str] = frozenset({"health"})
    # "all": every servlet; "worker": all but MAIN_ONLY_SERVLETS; "media": the media servlets
    # (names starting ``media_``: homeserver/http/client_api/media.py, homeserver/http/federation/media.py); "none".
    servlets: str = "none"
    streams: frozenset[str] = frozenset()
    sends_federation: bool = False
    start: RoleHook | None = None
    main_runs_without_worker: bool = False

    def serves_servlet(self, servlet: str) -> bool:
        if self.servlets == "all":
            return True
        if self.servlets == "worker":
            return servlet not in MAIN_ONLY_SERVLETS
        if self.servlets == "media":
            return servlet.startswith("media_")
        return False


MAIN: Final = WorkerRole(
    name="main",
    description="The main process: every API, and every stream not given to a worker.",
    resources=frozenset({"client", "federation", "keys", "replication", "health"}),
    servlets="all",
    streams=frozenset({"events", "typing", "receipts", "presence", "to_device", "account_data"}),
    sends_federation=True,
)

class UnknownRole(LookupError):
    pass


def load_role(name: str) -> WorkerRole:
    """The role registered as ``name`` in the ``tributary.workers`` entry-point group."""
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = known_roles()
        raise UnknownRole(f"no worker role {name!r} is installed (known: {', '.join(known) or 'none'}); "
                          "is the package installed (pip install -e .)?")
    role = found[0].load()
    if not isinstance(role, WorkerRole):
        raise UnknownRole(f"entry point {found[0].value} is not a WorkerRole")
    return role

