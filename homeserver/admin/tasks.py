"""Long admin operations (room deletion v2, history purges) run in the background and are
tracked here, so ``delete_status``, ``purge_history_status`` and
``/_synapse/admin/v1/scheduled_tasks`` can report them.

Tasks are rows of ``admin_tasks`` (schema 0025): the action, what it works on, the
parameters it needs to run again, its status and its result. Shutdown waits for running
tasks within its grace period; a task the process stopped (or crashed) under is run again
from its row when the main process starts (``resume``): both actions are idempotent (a room
deleted twice, history purged twice, ends the same). The most recent ``MAX_TASKS`` are kept.
"""

# tests: tests/integration/test_admin_api.py

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import attrs
from twisted.internet.defer import Deferred

from storage.kernel.errors import MatrixError
from storage.stores.admin import AdminTaskRow, AdminTaskStore

logger = logging.getLogger(__name__)

MAX_TASKS: Final = 1000
# In the parameters of a task run again after a restart (its work may have finished before).
RESUMED: Final = "resumed"

# An action's work: (task ID, the parameters it was started with) -> its result.
Work = Callable[[str, Mapping[str, Any]], Awaitable[dict[str, Any]]]


@attrs.frozen
class Task:
    id: str
    action: str
    resource_id: str
    timestamp_ms: int
    status: str = "scheduled"  # scheduled, active, complete, failed
    result: dict[str, Any] | None = None
    error: str | None = None

    @classmethod
    def from_row(cls, row: AdminTaskRow) -> Task:
        return cls(row.id, row.action, row.resource_id, row.timestamp_ms, row.status,
                   None if row.result is None else json.loads(row.result), row.error)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "action": self.action, "status": self.status, "timestamp_ms": self.timestamp_ms,
                "resource_id": self.resource_id, "result": self.result, "error": self.error}

    def delete_status(self) -> dict[str, Any]:
        """The reference server's room delete status object."""
        status = {"scheduled": "shutting_down", "active": "shutting_down", "complete": "complete",
                  "failed": "failed"}[self.status]
        body: dict[str, Any] = {"delete_id": self.id, "status": status, "shutdown_room": self.result or {
            "kicked_users": [], "failed_to_kick_users": [], "local_aliases": [], "new_room_id": None}}
        if self.error is not None:
            body["error"] = self.error
        return body


class TaskTracker:
    """Starts, runs, records and resumes admin tasks. The store comes with the admin API
    (``attach``), the work of each action with its servlets (``register``)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._store: AdminTaskStore | None = None
        self._actions: dict[str, Work] = {}
        self._running: set[Deferred[None]] = set()

    def attach(self, store: AdminTaskStore) -> None:
        self._store = store

    def register(self, action: str, work: Work) -> None:
        self._actions[action] = work

    @property
    def store(self) -> AdminTaskStore:
        if self._store is None:
            raise RuntimeError("admin tasks have no store: the admin API is not set up in this process")
        return self._store

    async def start(self, action: str, resource_id: str, params: Mapping[str, Any]) -> Task:
        """Record a new task and run it in the background. ``params`` must be JSON: they are
        what the task is run again with after a restart."""
        if action not in self._actions:
            raise ValueError(f"unknown admin task action {action!r}")
        task = Task(secrets.token_urlsafe(12), action, resource_id, int(self._clock() * 1000))
        await self.store.insert_task(task.id, action, resource_id, json.dumps(dict(params)), task.timestamp_ms,
                                     keep=MAX_TASKS)
        self._run(task.id, action, resource_id, params)
        return task

    async def resume(self) -> int:
        """Run again the tasks a stopped process left scheduled or active; how many."""
        unfinished = await self.store.unfinished_tasks()
        for row in unfinished:
            if row.action not in self._actions:
                await self.store.finish_task(row.id, "failed", None, f"unknown action {row.action}")
                continue
            logger.info("admin task %s (%s %s) was left unfinished: running it again", row.id, row.action,
                        row.resource_id)
            self._run(row.id, row.action, row.resource_id, {**json.loads(row.params), RESUMED: True})
        return len(unfinished)

    def _run(self, task_id: str, action: str, resource_id: str, params: Mapping[str, Any]) -> None:
        work = self._actions[action]
        store = self.store

        async def run() -> None:
            try:
                await store.set_task_status(task_id, "active")
                result = await work(task_id, params)
            except MatrixError as e:
                await self._finish(store, task_id, "failed", None, e.error)
            except Exception as e:  # a bug: reported on the task and in the log, never lost
                logger.exception("admin task %s (%s %s) failed", task_id, action, resource_id)
                await self._finish(store, task_id, "failed", None, f"internal error: {type(e).__name__}")
            else:
                await self._finish(store, task_id, "complete", result, None)

        running = Deferred.fromCoroutine(run())
        if running.called:
            return
        self._running.add(running)
        running.addBoth(lambda _: self._running.discard(running))

    @staticmethod
    async def _finish(store: AdminTaskStore, task_id: str, status: str, result: dict[str, Any] | None,
                      error: str | None) -> None:
        try:
            await store.finish_task(task_id, status, None if result is None else json.dumps(result), error)
        except Exception:
            # The database is gone (shutting down): the row still says active, and the next
            # start runs the task again, which is safe.
            logger.exception("admin task %s ended %s but could not be recorded", task_id, status)

    @property
    def running(self) -> int:
        return len(self._running)

    async def wait_idle(self) -> None:
        """Return once no task runs (tasks never fail the Deferred: errors end on the task)."""
        while self._running:
            await next(iter(self._running))

    async def get(self, task_id: str) -> Task | None:
        row = await self.store.get_task(task_id)
        return None if row is None else Task.from_row(row)

    async def list(self, *, action: str | None = None, status: str | None = None,
                   resource_id: str | None = None) -> list[Task]:
        """Newest first."""
        return [Task.from_row(row) for row in await self.store.list_tasks(action, status, resource_id)]

    async def active(self, action: str, resource_id: str) -> bool:
        return any(t.status in ("scheduled", "active") for t in await self.list(action=action, resource_id=resource_id))
