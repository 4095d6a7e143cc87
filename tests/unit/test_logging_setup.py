"""Log lines: one per record, with the process name and the request or destination context."""

# tests: homeserver/logging_setup.py

from __future__ import annotations

import contextvars
import io
import json
import logging
from collections.abc import Iterator

import pytest
from twisted.internet.defer import Deferred

from homeserver.logging_setup import LogContext, current_log_context, log_context, make_handler, set_log_context


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, io.StringIO, list[logging.Handler]]]:
    out = io.StringIO()
    logger = logging.getLogger("tributary.test.logging")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handlers: list[logging.Handler] = []
    try:
        yield logger, out, handlers
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
        logger.propagate = True


def use(capture: tuple[logging.Logger, io.StringIO, list[logging.Handler]], fmt: str) -> None:
    logger, out, handlers = capture
    handler = make_handler(fmt, "persister1", out)
    logger.addHandler(handler)
    handlers.append(handler)


def test_text_lines_carry_process_and_context_and_stay_one_line(
    capture: tuple[logging.Logger, io.StringIO, list[logging.Handler]],
) -> None:
    logger, out, _ = capture
    use(capture, "text")
    with log_context(destination="remote.example"):
        try:
            raise RuntimeError("boom\nsecond line")
        except RuntimeError:
            logger.exception("sending to %s failed", "remote.example")
    logger.info("outside")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert " ERROR persister1 tributary.test.logging [remote.example]: sending to remote.example failed\\n" in lines[0]
    assert "Traceback" in lines[0] and "boom\\nsecond line" in lines[0]
    assert lines[1].endswith(" INFO persister1 tributary.test.logging: outside")


def test_json_lines_have_context_fields(capture: tuple[logging.Logger, io.StringIO, list[logging.Handler]]) -> None:
    logger, out, _ = capture
    use(capture, "json")
    with log_context(request="GET-7", method="GET", servlet="sync"):
        logger.warning("slow %d", 3)
    entry = json.loads(out.getvalue())
    assert entry["process"] == "persister1"
    assert entry["level"] == "WARNING"
    assert entry["msg"] == "slow 3"
    assert (entry["request"], entry["method"], entry["servlet"]) == ("GET-7", "GET", "sync")
    assert "destination" not in entry


def test_context_set_in_a_coroutine_stays_in_that_coroutine() -> None:
    """The HTTP server sets the context at the top of each request's coroutine;
    Twisted runs each coroutine in its own copy of the context, so two
    interleaved requests never see each other's fields."""
    seen: dict[str, str | None] = {}
    gates: dict[str, Deferred[None]] = {"a": Deferred(), "b": Deferred()}

    async def request(name: str) -> None:
        with log_context(request=name):
            await gates[name]
            set_log_context(servlet="sync")
            seen[name] = current_log_context().request

    Deferred.fromCoroutine(request("a"))
    Deferred.fromCoroutine(request("b"))
    gates["b"].callback(None)
    gates["a"].callback(None)
    assert seen == {"a": "a", "b": "b"}
    assert current_log_context().request is None


def test_a_snapshot_of_a_finished_block_carries_no_fields() -> None:
    """asyncio snapshots the context when a callback is scheduled; a timer
    scheduled inside a request must not log as that request once it is over."""
    with log_context(request="GET-1", method="GET"):
        snapshot = contextvars.copy_context()
        assert snapshot.run(current_log_context).request == "GET-1"
    assert snapshot.run(current_log_context) == LogContext()
    with log_context(destination="remote.example"):
        with log_context(request="PUT-2"):
            inner = current_log_context()
        assert current_log_context() == LogContext(destination="remote.example")
    assert inner == LogContext(request="PUT-2", destination="remote.example")


def test_a_coroutine_closed_from_another_context_leaves_quietly() -> None:
    """A request coroutine that never resumes is closed by the garbage collector, in whatever
    context is current then: leaving its ``log_context`` block must not raise (an exception
    there surfaces as an unraisable-exception warning and upsets the interpreter)."""
    gate: Deferred[None] = Deferred()

    async def request() -> None:
        with log_context(request="GET-1"):
            await gate

    coro = request()
    contextvars.copy_context().run(coro.send, None)  # started in a context of its own
    coro.close()  # closed from this one
    assert current_log_context() == LogContext()
