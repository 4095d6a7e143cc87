"""The log context: what the lines logged inside a block are about (a request, a destination).

A ``ContextVar`` holds the current ``LogContext``; ``with log_context(destination=...)``
adds fields for the lines logged inside the block, and the process's log
formatter (``homeserver/logging_setup.py``) prints them. Every layer may tag its
lines; only the process entry point decides how they are written.

Twisted runs each coroutine in its own copy of the context, so two requests
never see each other's fields. But asyncio snapshots the current context
whenever a callback is scheduled, so a snapshot taken inside a block could carry
its fields into unrelated callbacks: each block therefore closes its scope on
exit, and a snapshot of a finished block shows no fields.
"""

# tests: tests/unit/test_logging_setup.py

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Final

import attrs

LOG_FIELDS: Final = ("request", "method", "servlet", "destination")


@attrs.frozen
class LogContext:
    """What a log line is about: an HTTP request and/or a remote server. Never a token or a full URL."""

    request: str | None = None
    method: str | None = None
    servlet: str | None = None
    destination: str | None = None

    def fields(self) -> dict[str, str]:
        return {name: value for name in LOG_FIELDS if (value := getattr(self, name)) is not None}

    def render(self) -> str:
        return " ".join(self.fields().values())


_EMPTY: Final = LogContext()


@attrs.define(eq=False)
class _Scope:
    """One ``log_context`` block; closed when the block exits."""

    open: bool = True


_OUTSIDE: Final = _Scope()
_current: ContextVar[tuple[LogContext, _Scope]] = ContextVar("tributary_log_context", default=(_EMPTY, _OUTSIDE))


def current_log_context() -> LogContext:
    context, scope = _current.get()
    return context if scope.open else _EMPTY


def set_log_context(**fields: str | None) -> None:
    """Add ``fields`` to the innermost ``log_context`` block (or to the running coroutine's context)."""
    _, scope = _current.get()
    _current.set((attrs.evolve(current_log_context(), **fields), scope))


@contextmanager
def log_context(**fields: str | None) -> Iterator[LogContext]:
    """``with log_context(destination="remote.example"):`` tags the lines logged inside."""
    scope = _Scope()
    context = attrs.evolve(current_log_context(), **fields)
    token = _current.set((context, scope))
    try:
        yield context
    finally:
        scope.open = False
        try:
            _current.reset(token)
        except ValueError:
            # A coroutine closed by the garbage collector (never resumed, e.g. a request whose
            # client went away at shutdown) runs this in another context; the closed scope
            # already hides the fields, and that context is being discarded anyway.
            pass
