"""Keeping the embedded PostgreSQL alive: notice its postmaster's death, restart it with
backoff, and give up with one clear line when it cannot come back.

``Supervision`` decides, from what it is told (the postmaster is alive or not, a restart
worked or failed) and the time it is given; it does no I/O and reads no clock.
``EmbeddedSupervisor`` is the thin loop around it: every ``interval`` seconds on an injected
clock it asks the cluster whether its postmaster runs, restarts it on a thread when told to,
and calls ``on_fatal`` once when supervision gives up. Nothing acknowledged is lost by a
restart: an acknowledged write is a committed transaction, and PostgreSQL's crash recovery
replays its WAL before it accepts connections again. What this module does not know: how
the pool reconnects (storage/database.py re-makes connections once the server answers).
"""

# tests: tests/unit/storage/test_embedded_supervisor.py, tests/integration/test_embedded_postgres.py

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable
from typing import Any, Final, Protocol

import attrs
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThread

from storage.kernel.background import run_in_background
from storage.kernel.backoff import BackoffPolicy, Jitter

logger = logging.getLogger(__name__)

# Looked at twice a second: a death is noticed within a second.
CHECK_INTERVAL: Final = 0.5
# Restarts after 0.5 s, doubling to 10 s, with jitter.
RESTART_BACKOFF: Final = BackoffPolicy(initial=0.5, multiplier=2.0, maximum=10.0, jitter=(0.8, 1.2))
# Down this long without a successful restart: give up (the process exits non-zero).
GIVE_UP_AFTER: Final = 60.0


class Decision(enum.Enum):
    NOTHING = "nothing"
    RESTART = "restart"
    GIVE_UP = "give_up"


@attrs.define
class Supervision:
    """The postmaster's supervision state: up, or down since when, with the next restart's time."""

    policy: BackoffPolicy = RESTART_BACKOFF
    give_up_after: float = GIVE_UP_AFTER
    jitter: Jitter = random.uniform
    down_since: float | None = None
    failures: int = 0
    next_restart: float = 0.0
    restarting: bool = False
    given_up: bool = False

    def observe(self, alive: bool, now: float) -> Decision:
        """What to do after a look at the postmaster at ``now``."""
        if self.given_up or self.restarting:
            return Decision.NOTHING
        if alive:
            self.down_since = None
            self.failures = 0
            return Decision.NOTHING
        if self.down_since is None:
            self.down_since = now
            self.next_restart = now  # the first restart at once
        if now - self.down_since >= self.give_up_after:
            self.given_up = True
            return Decision.GIVE_UP
        if now >= self.next_restart:
            self.restarting = True
            return Decision.RESTART
        return Decision.NOTHING

    def restarted(self, ok: bool, now: float) -> None:
        """A restart finished: back up, or wait the next backoff interval before trying again."""
        self.restarting = False
        if ok:
            self.down_since = None
            self.failures = 0
            return
        self.failures += 1
        self.next_restart = now + self.policy.delay(self.failures, self.jitter)


class Cluster(Protocol):
    """The embedded cluster as the supervisor sees it (``EmbeddedPostgres``)."""

    def postmaster_running(self) -> bool: ...

    def restart(self) -> None: ...


class EmbeddedSupervisor:
    """Runs ``Supervision`` on a clock: looks, restarts on a thread, reports giving up once."""

    def __init__(self, cluster: Cluster, clock: Any, on_fatal: Callable[[str], None], *,
                 supervision: Supervision | None = None, interval: float = CHECK_INTERVAL,
                 restart_in_thread: Callable[[Callable[[], None]], Any] = deferToThread) -> None:
        self._cluster = cluster
        self._clock = clock
        self._on_fatal = on_fatal
        self._state = supervision or Supervision()
        self._interval = interval
        self._restart_in_thread = restart_in_thread
        self._loop = LoopingCall(self._look)
        self._loop.clock = clock
        self.restarts = 0

    @property
    def state(self) -> Supervision:
        return self._state

    def start(self) -> None:
        self._loop.start(self._interval, now=False)

    def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()

    def _look(self) -> None:
        now = self._clock.seconds()
        was_up = self._state.down_since is None
        decision = self._state.observe(self._cluster.postmaster_running(), now)
        if was_up and self._state.down_since is not None:
            logger.warning("embedded PostgreSQL has died; restarting it")
        if decision is Decision.RESTART:
            run_in_background("embedded_postgres_restart", self._restart())
        elif decision is Decision.GIVE_UP:
            self.stop()
            reason = (f"embedded PostgreSQL died and could not be restarted for {self._state.give_up_after:.0f}s "
                      f"({self._state.failures} attempts); see {self._log_hint()}")
            logger.critical("%s", reason)
            self._on_fatal(reason)

    async def _restart(self) -> None:
        ok = True
        try:
            await self._restart_in_thread(self._cluster.restart)
        except Exception as e:  # the adapter's catch: a failed attempt is retried with backoff
            ok = False
            logger.info("embedded PostgreSQL restart failed (attempt %d): %s", self._state.failures + 1, e)
        self._state.restarted(ok, self._clock.seconds())
        if ok:
            self.restarts += 1
            logger.warning("embedded PostgreSQL restarted")

    def _log_hint(self) -> str:
        return str(getattr(self._cluster, "log_path", "the embedded PostgreSQL's log"))
