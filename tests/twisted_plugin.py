"""pytest plugin: run the suite on Twisted's asyncio reactor (uvloop).

The reactor is installed when pytest loads this plugin, before any test module
imports Twisted. ``async def`` tests run as Twisted coroutines (they may await
Deferreds and asyncio futures alike) with the loop driven until they finish;
sync fixtures use ``run_sync`` for async set-up.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from twisted.internet.defer import Deferred

from homeserver.reactor import install_reactor

reactor = install_reactor()

T = TypeVar("T")

DEFAULT_TIMEOUT_SECONDS = 120.0
HANG_GRACE_SECONDS = 30.0


def _ensure_running() -> None:
    # startRunning fires the reactor's start-up triggers (its thread pool, for
    # one) without blocking; the loop is then driven per test below.
    if not reactor.running:
        reactor.startRunning(installSignalHandlers=False)


def run_sync(coro: Coroutine[Any, Any, T] | Deferred[T], timeout: float = DEFAULT_TIMEOUT_SECONDS) -> T:
    """Run a Twisted coroutine (or wait for a Deferred) on the reactor's loop; return its result."""
    _ensure_running()
    loop = reactor._asyncioEventloop
    # A test that ran ``asyncio.run`` (nio in a worker-layout test) leaves no current loop
    # behind; code that asks asyncio for "the" loop (nio's clients) must find the reactor's,
    # also in the synchronous start of the coroutine below.
    asyncio.set_event_loop(loop)
    deferred = coro if isinstance(coro, Deferred) else Deferred.fromCoroutine(coro)
    deferred.addTimeout(timeout, reactor)
    future = deferred.asFuture(loop)
    # The timeout cancels the test, but what it waits for may ignore that (a transaction is
    # waited for once begun): past the grace the test fails with a report of what it waits
    # for, and the suite goes on, rather than hang to CI's limit with nothing to show.
    done, _ = loop.run_until_complete(asyncio.wait({future}, timeout=timeout + HANG_GRACE_SECONDS))
    if not done:
        raise TestDidNotEnd(_hang_report(coro, timeout))
    return future.result()  # type: ignore[no-any-return]


class TestDidNotEnd(AssertionError):
    """A test went on past its timeout and the grace after it."""


def _hang_report(coro: object, timeout: float) -> str:
    import sys
    import traceback

    from storage import on_reactor

    lines = [f"the test did not end within {timeout:.0f} s, nor {HANG_GRACE_SECONDS:.0f} s after its "
             "cancellation; what it waits for:"]
    awaited = getattr(coro, "cr_await", None)
    frame = getattr(coro, "cr_frame", None)
    if frame is not None:
        lines.append("".join(traceback.format_stack(frame, limit=3)).rstrip())
    while awaited is not None:
        lines.append(f"  awaits {awaited!r}")
        awaited = getattr(awaited, "cr_await", None)
    lines.append("the reactor thread's database connections:")
    lines.extend("  " + line for line in on_reactor.describe())
    for ident, thread_frame in sys._current_frames().items():
        lines.append(f"thread {ident}:")
        lines.append("".join(traceback.format_stack(thread_frame, limit=8)).rstrip())
    return "\n".join(lines)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    func = pyfuncitem.obj
    if not inspect.iscoroutinefunction(func):
        return None
    argnames = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in argnames}
    marker = pyfuncitem.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker else DEFAULT_TIMEOUT_SECONDS
    run_sync(func(**kwargs), timeout=timeout)
    return True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "timeout(seconds): time limit for an async test")


class _StallWarnings(logging.Handler):
    """The reactor side's stall-check warnings of the whole run (``storage/on_reactor.py``): each
    is a wake-up the loop lost and the check made good, which the tests then pass despite; the
    run's summary lists them so they are seen."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []
        self.test = "(outside a test)"

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{self.test}: {record.getMessage()}")


_STALLS = _StallWarnings()
logging.getLogger("storage.on_reactor").addHandler(_STALLS)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _STALLS.test = item.nodeid


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _STALLS.seen:
        terminalreporter.section("reactor-side stall warnings")
        for line in _STALLS.seen:
            terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    # Stop the reactor's thread pool: its threads are not daemons and would keep
    # the interpreter alive after the last test.
    if reactor.running:
        # The "shutdown" system event stops the reactor's thread pool.
        reactor.fireSystemEvent("shutdown")


async def eventually(check: Any, timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``check()`` (a plain function) every 50 ms on the reactor until it returns something
    truthy, and return that; AssertionError naming ``what`` after ``timeout`` seconds."""
    from twisted.internet import task

    for _ in range(int(timeout / 0.05)):
        result = check()
        if result:
            return result
        await task.deferLater(reactor, 0.05, lambda: None)
    raise AssertionError(f"{what} not met within {timeout}s")
