"""Transactions on the reactor thread: each runs in a greenlet, over a non-blocking connection.

A transaction on a pool thread costs two thread wake-ups whatever it does: the hand-off to
the thread and the result's way back (88-129 us of the server's CPU for a function that
does nothing, measured; the wake-ups, not our code). Most transactions of the hot paths are
a round trip or two with little Python around them, and the GIL lets only one thread run
Python at a time anyway. So ``Database`` runs those here instead: the transaction function,
written as for a pool thread, runs in a greenlet of the reactor thread, on a connection in
psycopg2's asynchronous mode; where it would block on the server, the greenlet parks and the
reactor waits for the connection's socket with everything else it waits for, then switches
back into the greenlet. Nothing changes for the function: ``execute`` returns once the
statement has run, ``fetchone`` reads its rows.

The price is that the function's Python between its round trips holds the reactor: a
function with long stretches of Python (bulk state, big COPYs) stays on the pool threads,
where the interpreter switches threads every few milliseconds. COPY cannot run here at all
(psycopg2 has no COPY in asynchronous mode): ``copy_rows`` raises.

Greenlets (the ``greenlet`` package) are how a function written to block can be suspended
without a thread; SQLAlchemy runs its synchronous core over asyncio drivers the same way.
"""

# tests: tests/integration/test_database.py

from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import traceback
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import greenlet
import psycopg2
import psycopg2.extensions
from psycopg2.sql import Composable
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

logger = logging.getLogger(__name__)

# How long a task waits on its connection's socket before the socket is watched afresh and
# the connection polled (``LoopConnection.wait``).
STALL_CHECK_SECONDS = 1.0

T = TypeVar("T")

# For ``describe``: the connections open, and the tasks waiting to connect by their socket.
_OPEN: weakref.WeakSet[LoopConnection] = weakref.WeakSet()
_CONNECTING: dict[int, _Task] = {}


_POLL_OK: int = psycopg2.extensions.POLL_OK
_POLL_READ: int = psycopg2.extensions.POLL_READ
_POLL_WRITE: int = psycopg2.extensions.POLL_WRITE


class OffReactor(RuntimeError):
    """A wait of this module was called outside a task of ``start_task``."""


class _Task(greenlet.greenlet):
    """A function running in a greenlet of the reactor thread; ``done`` fires with its result.

    The loop resumes it only from its queue of ready callbacks (``wake``: call_soon), never
    straight from an I/O callback. A greenlet's stack is copied out and back at the depth
    where it first ran, so a task first run above libuv's polling frame (outside the loop, at
    start-up or in a test's first lines) and then resumed from inside that frame's callbacks
    would overwrite it, and libuv reads and writes its events while the task runs: a task
    opening a connection crashed the test process so (SIGSEGV in
    ``uv__platform_invalidate_fd``) while this was built. When the ready queue runs, no
    polling frame is live; a task started inside the loop (``start_task``) runs at once, its
    stack beginning below every frame the loop has live when it resumes it, and one started
    outside runs first from the ready queue too. Every wait of a task checks again what it
    waits for when it is resumed, so a wake-up that was not for it costs a poll, nothing
    more."""

    def __init__(self, loop: asyncio.AbstractEventLoop, func: Callable[..., Any], args: tuple[object, ...]) -> None:
        super().__init__(self._body)
        self._loop = loop
        self._func = func
        self._args = args
        self._waking = False
        self.done: Deferred[Any] = Deferred()

    def _body(self) -> Any:
        return self._func(*self._args)

    def park(self) -> None:
        """(In the task.) Give the reactor thread back until the task is woken."""
        hub = self.parent
        assert hub is not None  # a task's parent is the thread's main greenlet
        hub.switch()

    def wake(self) -> None:
        """Have the loop switch into the task from its ready queue; once, however often called
        before it has."""
        if not self._waking:
            self._waking = True
            self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        self._waking = False
        if self.dead:
            return
        try:
            value = self.switch()
        except BaseException:
            self.done.errback(Failure())
            return
        if self.dead:
            self.done.callback(value)


def reactor_loop(reactor: object) -> asyncio.AbstractEventLoop | None:
    """The asyncio loop under ``reactor`` (Twisted's asyncio reactor keeps it as
    ``_asyncioEventloop``: the one private name this module reads), or None for a reactor
    of another kind, whose transactions then all run on the pool threads."""
    loop = getattr(reactor, "_asyncioEventloop", None)
    return loop if isinstance(loop, asyncio.AbstractEventLoop) else None


def on_main_greenlet() -> bool:
    """Whether a task may be started here: on a thread's main greenlet, not inside a task."""
    return greenlet.getcurrent().parent is None


def start_task(loop: asyncio.AbstractEventLoop, func: Callable[..., T], *args: object) -> Deferred[T]:
    """Run ``func(*args)`` in a new task: at once when called from inside the running loop,
    else from its first turn; its result (or failure) fires the Deferred.

    Only on the reactor thread's main greenlet (``on_main_greenlet``): the task parks by
    switching back to it."""
    task = _Task(loop, func, args)
    done: Deferred[T] = task.done
    if loop.is_running():
        task._resume()  # inside one of the loop's callbacks: the task begins below its frames
    else:
        task.wake()
    return done


def _current_task() -> _Task:
    task = greenlet.getcurrent()
    if not isinstance(task, _Task):
        raise OffReactor("a wait on the reactor thread needs a task of start_task")
    return task


def wait_connected(conn: psycopg2.extensions.connection, loop: asyncio.AbstractEventLoop) -> None:
    """Park the current task until ``conn``, opened in asynchronous mode, has connected;
    raises what connecting raised. (Its socket may change meanwhile, libpq trying one address
    after another, so each wait registers the socket of the moment.)

    Sockets are watched through the reactor's asyncio loop itself: Twisted's ``addReader``
    and its logging context cost more than a round trip's other Python."""
    task = _current_task()
    state = conn.poll()
    while state != _POLL_OK:
        if state == _POLL_READ:
            watch, unwatch = loop.add_reader, loop.remove_reader
        elif state == _POLL_WRITE:
            watch, unwatch = loop.add_writer, loop.remove_writer
        else:  # psycopg2 documents no other state
            raise psycopg2.OperationalError(f"unexpected connection poll state {state}")
        fd = conn.fileno()
        watch(fd, task.wake)
        # Connecting is rare and takes milliseconds, so a timer per wait costs nothing here (the
        # round trips of statements have LoopConnection's one check a second instead): woken
        # by it, the task polls and watches the socket afresh, so a wake-up the loop lost costs
        # a second, not the task.
        check = loop.call_later(STALL_CHECK_SECONDS, task.wake)
        _CONNECTING[fd] = task
        try:
            task.park()
        finally:
            del _CONNECTING[fd]
            if check.when() <= loop.time() and _ready(fd, state):
                logger.warning("connecting on database socket %d went on unseen by the loop, or just as the "
                               "check came", fd)
            check.cancel()
            unwatch(fd)
        state = conn.poll()


def _ready(fd: int, state: int) -> bool:
    """Whether ``fd`` is ready now for what ``state`` waits for (no wait)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN if state == _POLL_READ else select.POLLOUT)
    return bool(poller.poll(0))


def sleep(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Park the current task for at least ``seconds``, the reactor running on."""
    task = _current_task()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        timer = loop.call_later(left, task.wake)
        try:
            task.park()
        finally:
            timer.cancel()


class LoopConnection:
    """A non-blocking connection, open and set up, with the names of the statements it has
    prepared.

    Its socket stays registered with the loop for reading while it is open: registering it
    for each wait and removing it after cost more than the round trip's other Python (uvloop
    makes a poll handle each time). A task waiting for a statement is resumed when it is
    readable; readable while nobody waits (the server closed the connection, or sent a
    notice), the connection is polled, and closed if that fails, so a dead socket cannot
    keep the loop busy."""

    __slots__ = ("conn", "prepared", "_loop", "_fd", "_waiter", "_watched", "_nudged", "_waits", "_waits_seen",
                 "_check", "__weakref__")

    def __init__(self, conn: psycopg2.extensions.connection, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.prepared: set[str] = set()
        self._loop = loop
        self._fd = conn.fileno()
        self._waiter: _Task | None = None
        self._nudged = False
        # Parks so far, and as the last stall check saw them: one check a second per
        # connection, rather than a timer set and cancelled on every round trip.
        self._waits = 0
        self._waits_seen = 0
        loop.add_reader(self._fd, self._readable)
        self._watched = True
        self._check = loop.call_later(STALL_CHECK_SECONDS, self._check_stall)
        _OPEN.add(self)

    def _readable(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            waiter.wake()
            return
        try:
            self.conn.poll()
        except psycopg2.Error:
            self.close()

    def wait(self) -> None:
        """Park the current task until the statement in progress has run; raises its error.
        The task is the socket's waiter also while it waits to write (a statement bigger than
        the socket's buffer), so that the socket turning readable then wakes it rather than
        polling the connection under it."""
        task = _current_task()
        conn = self.conn
        nudged = False
        while True:
            state = conn.poll()
            if state == _POLL_OK:
                if nudged:
                    logger.warning("a statement on database socket %d ended unseen by the loop, or just as it "
                                   "was watched afresh", self._fd)
                return
            writing = state == _POLL_WRITE
            if writing:
                self._loop.add_writer(self._fd, task.wake)
            elif state != _POLL_READ:  # psycopg2 documents no other state
                raise psycopg2.OperationalError(f"unexpected connection poll state {state}")
            self._waiter = task
            self._waits += 1
            try:
                task.park()
            finally:
                self._waiter = None
                if writing:
                    self._loop.remove_writer(self._fd)
            nudged, self._nudged = self._nudged, False

    def _check_stall(self) -> None:
        """Every ``STALL_CHECK_SECONDS`` while open: a task parked on the connection since the
        last check (between one and two checks' time) has the socket watched afresh and polls
        the connection. A registration the loop lost then costs a second or two, not a task
        waiting for good (a cancelled transaction is waited for, so nothing else ends it)."""
        task = self._waiter
        if task is not None and self._waits == self._waits_seen:
            if self._watched:
                self._loop.remove_reader(self._fd)
                self._loop.add_reader(self._fd, self._readable)
            self._nudged = True
            task.wake()
        self._waits_seen = self._waits
        self._check = self._loop.call_later(STALL_CHECK_SECONDS, self._check_stall)

    def cursor(self) -> GreenCursor:
        cursor = self.conn.cursor(cursor_factory=GreenCursor)
        cursor.held = self
        return cursor

    def close(self) -> None:
        """Stop watching the socket, also when psycopg2 has closed the connection already
        (after a fatal error): the socket's number will be another's, whose watch must not
        be mistaken for this one's; then close the connection."""
        self._check.cancel()
        _OPEN.discard(self)
        if self._watched:
            self._watched = False
            self._loop.remove_reader(self._fd)
        try:
            self.conn.close()
        except psycopg2.Error:
            pass


class GreenCursor(psycopg2.extensions.cursor):
    """A cursor of a ``LoopConnection`` (``LoopConnection.cursor``), as a blocking one looks to
    ``Transaction``: ``execute`` returns once the statement has run, the current task parked
    meanwhile. Everything else is psycopg2's own cursor."""

    __slots__ = ("held",)

    held: LoopConnection

    def execute(self, query: str | bytes | Composable, vars: Any = None) -> None:
        super().execute(query, vars)
        self.held.wait()

    def copy_expert(self, sql: str | bytes | Composable, file: Any, size: int = 8192) -> None:
        raise ValueError("COPY cannot run on the reactor thread (psycopg2 has no COPY in asynchronous mode): "
                         "run this transaction on the pool threads")


class LoopConnections:
    """The non-blocking connections of tasks, at most ``size`` open.

    A task takes the connection idle last (its server backend's caches are warm, as with
    the pool threads' connections) or, when none is idle and ``size`` are open, waits its
    turn; ``acquire`` gives None when the task is to open one (it counts as open already).
    """

    __slots__ = ("_size", "_open", "_idle", "_waiting", "_closed")

    def __init__(self, size: int) -> None:
        self._size = size
        self._open = 0
        self._idle: list[LoopConnection] = []
        self._waiting: collections.deque[Deferred[LoopConnection | None]] = collections.deque()
        self._closed = False

    def acquire(self) -> Deferred[LoopConnection | None]:
        if self._idle:
            return succeed(self._idle.pop())
        if self._open < self._size:
            self._open += 1
            return succeed(None)
        waiter: Deferred[LoopConnection | None] = Deferred(lambda d: self._waiting.remove(d))
        self._waiting.append(waiter)
        return waiter

    def release(self, held: LoopConnection | None) -> None:
        """Give back what ``acquire`` gave: the connection, or None when it was dropped
        (or never opened), which frees its place."""
        if held is not None and (self._closed or held.conn.closed):
            _close(held)
            held = None
        if self._waiting:
            self._waiting.popleft().callback(held)
            return
        if held is None:
            self._open -= 1
        else:
            self._idle.append(held)

    def close(self) -> None:
        """Close the idle connections; those in use close when given back."""
        self._closed = True
        idle, self._idle = self._idle, []
        self._open -= len(idle)
        for held in idle:
            _close(held)


def _close(held: LoopConnection) -> None:
    held.close()


def describe() -> list[str]:
    """What each open connection and each task still connecting waits for, and whether the
    kernel's epoll sets hold its socket (Linux; read from /proc): for the report of a test
    that did not end."""
    watched = _epoll_members()
    lines = []
    for held in list(_OPEN):
        waiter = "a task waits on it" if held._waiter is not None else "idle"
        lines.append(f"connection on socket {held._fd}: {waiter}, {held._waits} waits so far, "
                     f"psycopg2 closed={held.conn.closed}, {watched.get(held._fd, 'in no epoll set')}")
        lines.extend(_where(held._waiter))
    for fd, task in list(_CONNECTING.items()):
        lines.append(f"a task connecting on socket {fd}: {watched.get(fd, 'in no epoll set')}")
        lines.extend(_where(task))
    return lines or ["no connections open or connecting on the reactor thread"]


def _where(task: _Task | None) -> list[str]:
    frame = task.gr_frame if task is not None else None
    return [] if frame is None else ["  " + line.rstrip() for line in traceback.format_stack(frame, limit=6)]


def _epoll_members() -> dict[int, str]:
    members: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return members
    for name in fds:
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                for line in info:
                    if line.startswith("tfd:"):
                        parts = line.split()
                        members[int(parts[1])] = f"in epoll set {name} for events {parts[3]}"
        except (OSError, IndexError, ValueError):
            continue
    return members
