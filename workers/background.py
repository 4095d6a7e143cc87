"""The ``background`` role's hook: periodic pruning (``workers/pruning.py``) and the user
directory's updater (``homeserver/handlers/directory/user_directory.py``).

Runs in one process of a deployment: the ``background`` worker when the config has one, else
the main process. The updater follows the events stream through the positions this process
knows, locally or by replication.
"""

# tests: tests/integration/test_directory.py

from __future__ import annotations

from typing import Any

import attrs
from twisted.internet.defer import DeferredList, maybeDeferred

from homeserver.handlers.directory.user_directory import UserDirectoryUpdater
from homeserver.roles import RoleContext
from storage.stores.user_directory import UserDirectoryStore
from workers.pruning import StreamPruner, start_pruning


@attrs.frozen
class BackgroundJobs:
    pruner: StreamPruner
    user_directory: UserDirectoryUpdater

    def stop(self) -> Any:
        return DeferredList([maybeDeferred(self.pruner.stop), maybeDeferred(self.user_directory.stop)])


async def start_background(context: RoleContext) -> BackgroundJobs:
    pruner = await start_pruning(context)
    events = context.streams["events"]
    updater = UserDirectoryUpdater(UserDirectoryStore(context.db), context.reactor, events.get_current_token,
                                   written=context.written_events)
    events.add_position_listener(lambda *_: updater.on_new_events())
    updater.on_new_events()
    return BackgroundJobs(pruner, updater)
