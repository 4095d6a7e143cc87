"""The one way to start work nobody awaits: ``run_in_background(name, work)``.

Work started here never fails silently: a failure is logged (with the task's
name and the traceback; an outage, ``Unavailable``, at debug level without it, since
it is logged once where it is noticed) and counted in
``tributary_background_task_failures_total{task}``, whose label is the name, a
constant from the code (never an ID). The returned Deferred fires with the
result, or ``None`` after a failure, and never errbacks, so a caller may await
it or drop it. Cancelling it cancels the work.
"""

# tests: tests/unit/storage/test_kernel.py

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

from prometheus_client import CollectorRegistry, Counter
from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure

from storage.kernel.errors import Unavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")

# One counter for the process; ``register_metrics`` adds it to the registry each process serves.
FAILURES: Final = Counter(
    "tributary_background_task_failures_total",
    "Background tasks (work nobody awaits) that failed, by task name.",
    ["task"],
    registry=None,
)


def register_metrics(registry: CollectorRegistry) -> None:
    """Serve the background-task counter on ``registry`` (once per registry)."""
    registry.register(FAILURES)


def run_in_background(name: str, work: Coroutine[Any, Any, T] | Deferred[T]) -> Deferred[T | None]:
    """Start ``work`` now (a coroutine is driven at once, up to its first wait); log and count a failure."""
    d: Deferred[T] = work if isinstance(work, Deferred) else Deferred.fromCoroutine(work)

    def failed(failure: Failure) -> None:
        if failure.check(CancelledError):
            return None
        FAILURES.labels(task=name).inc()
        if failure.check(Unavailable):  # an outage, logged once where it was noticed
            logger.debug("background task %s failed: %s", name, failure.getErrorMessage())
            return None
        logger.error("background task %s failed: %s\n%s", name, failure.getErrorMessage(), failure.getTraceback())
        return None

    return d.addErrback(failed)
