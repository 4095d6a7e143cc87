"""In-process waiting for streams to advance: ``/sync`` long-polls, the federation sender.

A waiter names the streams it follows and a condition (usually "the stream's
position is past my token"); it is a Deferred plus, with a timeout, one
delayed call, so it costs no CPU while it waits. The condition is checked only
when one of its streams advances (``notify``, called by the ID generators'
position listeners) and once more at the timeout. The notifier does not
know what a token means: callers pass the condition.
"""

# tests: tests/unit/storage/test_notifier.py, tests/integration/test_streams_generators.py

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from storage.id_generators import StreamIdGenerator
from storage.tokens import StreamToken, SyncStreamKey

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class _Waiter:
    streams: frozenset[str]
    condition: Callable[[], bool]
    deferred: Deferred[bool] | None = None
    timer: IDelayedCall | None = None


class Notifier:
    """Waiters keyed by stream name, woken when those streams advance."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._waiters: dict[str, set[_Waiter]] = {}
        self._generators: dict[str, StreamIdGenerator] = {}
        # Set by ``shut_down``: the process is stopping, so nobody waits any more.
        self.closed = False
        # How many ``notify`` calls are under way (one inside another when a woken waiter's work
        # moves a stream), and the positions one of them read for its sync waiters
        # (``_current_in_round``), dropped whenever a stream moves.
        self._notifying = 0
        self._current_token: tuple[Callable[[], StreamToken], StreamToken] | None = None

    def add_stream(self, generator: StreamIdGenerator) -> None:
        """Follow a stream: its position changes wake its waiters."""
        if generator.stream_name in self._generators:
            raise ValueError(f"stream {generator.stream_name!r} is already followed")
        self._generators[generator.stream_name] = generator
        generator.add_position_listener(self._on_position)

    def _on_position(self, stream_name: str, instance: str, old: int, new: int) -> None:
        self.notify(stream_name)

    def waiter_count(self, stream_name: str | None = None) -> int:
        if stream_name is not None:
            return len(self._waiters.get(stream_name, ()))
        return len({w for waiters in self._waiters.values() for w in waiters})

    def notify(self, stream_name: str) -> None:
        """``stream_name`` advanced: wake its waiters whose condition now holds."""
        self._current_token = None  # positions moved: a read of them is stale
        waiters = self._waiters.get(stream_name)
        if not waiters:
            return
        self._notifying += 1
        try:
            for waiter in list(waiters):
                self._check(waiter, timed_out=False)
        finally:
            self._notifying -= 1
            self._current_token = None

    def wait_until(
        self, streams: Iterable[str], condition: Callable[[], bool], timeout: float | None
    ) -> Deferred[bool]:
        """A Deferred firing True once ``condition()`` holds, checked when any of ``streams`` advances.

        Fires False at the timeout (seconds; None waits for ever) unless the
        condition holds by then. Cancelling the Deferred removes the waiter.
        """
        followed = frozenset(streams)
        if not followed:
            raise ValueError("a waiter must follow at least one stream")
        if condition():
            return succeed(True)
        if self.closed:
            return succeed(False)
        waiter = _Waiter(followed, condition)

        def cancel(_: Deferred[bool]) -> None:
            self._remove(waiter)

        waiter.deferred = Deferred(canceller=cancel)
        if timeout is not None:
            waiter.timer = self._clock.callLater(max(timeout, 0.0), self._time_out, waiter)
        for stream_name in followed:
            self._waiters.setdefault(stream_name, set()).add(waiter)
        return waiter.deferred

    def shut_down(self) -> None:
        """The process is stopping: fire every waiter now, as a timeout would (False unless its
        condition holds), and answer later waits at once; long-polls then end without waiting."""
        self.closed = True
        for waiter in {w for waiters in self._waiters.values() for w in waiters}:
            self._remove(waiter)  # cancels its timer too
            self._time_out(waiter)

    def _time_out(self, waiter: _Waiter) -> None:
        waiter.timer = None
        self._remove(waiter)
        self._check(waiter, timed_out=True)

    def _check(self, waiter: _Waiter, *, timed_out: bool) -> None:
        """Fire ``waiter`` with its condition when it holds, or when ``timed_out`` with whatever
        it says; a failing condition fails the waiter alone. Fired waiters are removed."""
        deferred = waiter.deferred
        if deferred is None or deferred.called:
            return
        try:
            ready = waiter.condition()
        except Exception:
            self._remove(waiter)
            deferred.errback()
            return
        if ready or timed_out:
            self._remove(waiter)
            deferred.callback(ready)

    def _remove(self, waiter: _Waiter) -> None:
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()
        waiter.timer = None
        for stream_name in waiter.streams:
            waiters = self._waiters.get(stream_name)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[stream_name]

    def _generator(self, stream_name: str) -> StreamIdGenerator:
        try:
            return self._generators[stream_name]
        except KeyError:
            raise ValueError(f"stream {stream_name!r} is not followed; call add_stream first") from None

    def wait_for_position(
        self, stream_name: str, position: int, timeout: float | None, *, instance: str | None = None
    ) -> Deferred[bool]:
        """Wait until the stream's linear position (or ``instance``'s position) is past ``position``."""
        generator = self._generator(stream_name)
        if instance is None:
            return self.wait_until((stream_name,), lambda: generator.get_current_token() > position, timeout)
        return self.wait_until((stream_name,), lambda: generator.get_position(instance) > position, timeout)

    def wait_for_sync_token(
        self, since: StreamToken, current: Callable[[], StreamToken], timeout: float | None,
        *, quiet: Mapping[SyncStreamKey, Callable[[int], bool]] | None = None,
    ) -> Deferred[bool]:
        """``/sync``: wait until ``current()`` is ahead of ``since`` in any stream it covers.

        ``quiet[key](upto)``: whether that stream's positions after ``since`` up to ``upto``
        hold nothing for this sync (``QuietWatch``); its moves are then slept through."""
        streams = [key.value for key, _ in since.components()]
        # Streams without a quiet check first: when one of them moved, no check need run.
        components = sorted(((key, token, (quiet or {}).get(key)) for key, token in since.components()),
                            key=lambda component: component[2] is not None)

        def ready() -> bool:
            now = self._current_in_round(current)
            for key, token, is_quiet in components:
                moved = now.get(key)
                if not moved.is_before_or_equal(token) and (is_quiet is None or not is_quiet(moved.max_position)):
                    return True
            return False

        return self.wait_until(streams, ready, timeout)

    def _current_in_round(self, current: Callable[[], StreamToken]) -> StreamToken:
        """``current()``, read once per ``notify`` for all the sync waiters it looks at (a read
        is seven streams' positions: every waiter read them at every move). Only inside a
        ``notify``: a stream that moves meanwhile (a woken waiter's work) notifies, which drops
        the read; outside one (a new waiter's first look) it is read afresh."""
        if not self._notifying:
            return current()
        cached = self._current_token
        # ``current`` is a bound method, a new object at each access: equal, not the same.
        if cached is not None and cached[0] == current:
            return cached[1]
        token = current()
        self._current_token = (current, token)
        return token
