"""Long admin operations (room deletion, v2) run in the background and are tracked here,
so ``delete_status`` and ``/_synapse/admin/v1/scheduled_tasks`` can report them.

In memory, for this process's lifetime: shutdown waits for running tasks within its
grace period; a task still running after that is not resumed (the operator sees no status and repeats the request, which is
safe: deletion is idempotent). The most recent ``MAX_TASKS`` are kept.
"""

# tests: tests/integration/test_admin_api.py

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs
from twisted.internet.defer import Deferred

from storage.kernel.errors import MatrixError

logger = logging.getLogger(__name__)

MAX_TASKS: Final = 1000


@attrs.define
class Task:
    id: str
    action: str
    resource_id: str
    timestamp_ms: int
    status: str = "scheduled"  # scheduled, active, complete, failed
    result: dict[str, Any] | None = None
    error: str | None = None

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
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tasks: OrderedDict[str, Task] = OrderedDict()
        self._running: set[Deferred[None]] = set()

    def start(self, action: str, resource_id: str,
              work: Callable[[str], Awaitable[dict[str, Any]]]) -> Task:
        task = Task(secrets.token_urlsafe(12), action, resource_id, int(self._clock() * 1000))
        self._tasks[task.id] = task
        while len(self._tasks) > MAX_TASKS:
            self._tasks.popitem(last=False)

        async def run() -> None:
            task.status = "active"
            try:
                task.result = await work(task.id)
                task.status = "complete"
            except MatrixError as e:
                task.status, task.error = "failed", e.error
            except Exception as e:  # a bug: reported on the task and in the log, never lost
                logger.exception("admin task %s (%s %s) failed", task.id, action, resource_id)
                task.status, task.error = "failed", f"internal error: {type(e).__name__}"

        running = Deferred.fromCoroutine(run())
        self._running.add(running)
        running.addBoth(lambda _: self._running.discard(running))
        return task

    @property
    def running(self) -> int:
        return len(self._running)

    async def wait_idle(self) -> None:
        """Return once no task runs (tasks never fail the Deferred: errors end on the task)."""
        while self._running:
            await next(iter(self._running))

    def get(self, task_id: str) -> Task | None:
        return self._tasks.get(task_id)

    def list(self) -> list[Task]:
        return list(self._tasks.values())

    def active(self, action: str, resource_id: str) -> bool:
        return any(t.action == action and t.resource_id == resource_id and t.status in ("scheduled", "active")
                   for t in self._tasks.values())
