"""The one bounded fan-out: ``map_concurrently(fn, items, limit=N)``.

Runs ``fn`` over ``items`` with at most ``limit`` calls in flight and returns
the results in the order of ``items``. The first failure cancels the calls
still running and is raised (callers that want per-item failures catch inside
``fn``); cancelling the caller cancels every call in flight. It knows nothing
of what the calls do: key fetches, backfill attempts, anything awaited.
"""

# tests: tests/unit/storage/test_kernel.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, FirstError, gatherResults

T = TypeVar("T")
R = TypeVar("R")


async def map_concurrently(fn: Callable[[T], Awaitable[R]], items: Iterable[T], *, limit: int) -> list[R]:
    """``[await fn(x) for x in items]``, but with up to ``limit`` calls at once."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    pending = list(enumerate(items))
    results: dict[int, R] = {}
    queue = iter(pending)

    async def worker() -> None:
        # Each worker takes the next item when its previous call is done, so exactly
        # min(limit, len(items)) calls run until the queue is empty.
        for index, item in queue:
            results[index] = await fn(item)

    workers: list[Deferred[Any]] = [Deferred.fromCoroutine(worker()) for _ in range(min(limit, len(pending)))]
    if not workers:
        return []
    try:
        await gatherResults(workers, consumeErrors=True)
    except FirstError as e:
        for d in workers:
            if not d.called:
                d.cancel()
        e.subFailure.raiseException()
    return [results[i] for i in range(len(pending))]
