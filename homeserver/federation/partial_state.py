"""Partial-state joins, as the joining server: checking the answer's ``servers_in_room``, and
the resync that makes the room's state whole afterwards.

A join asked with ``omit_members`` (send_join v2) gets the room's state without its member
events, and the servers in the room. ``MembershipHandler`` stores that and marks the room
partial (``partial_state_rooms``); the client's /join answers then. ``PartialStateResyncer``
then fetches the whole state at the join (``GET /state/{room}?event_id=``) from the servers
of the answer, one after the other with backoff, checks it in bulk as a send_join answer is
checked (``join_state.py``: signatures and hashes, then the auth rules in auth order) and has
the room's events writer store it (``EventPersister.complete_partial_state``), which fills in
what the partial state lacked and clears the mark. A restart resumes the rooms still marked.

``parse_servers_in_room`` is pure; the resyncer does the I/O through what it is given.
"""

# tests: tests/unit/federation/test_partial_state.py, tests/integration/test_federation_partial_join.py

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Final
from urllib.parse import quote

from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from homeserver.events import RoomVersion, get_room_version
from homeserver.events import constants as C
from homeserver.events.errors import EventsError
from homeserver.events.identifiers import is_valid_server_name
from homeserver.remote.client import FederationClient, FederationClientError
from homeserver.federation.join_state import RunInThread, order_and_check, run_inline, state_map, verify_batch
from homeserver.federation.keys import Keyring
from homeserver.remote.metrics import FederationMetrics
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister
from storage.kernel.background import run_in_background
from storage.kernel.backoff import BackoffPolicy
from storage.stores.events import EventsStore
from storage.stores.partial_state import PartialStateRow, PartialStateStore

logger = logging.getLogger(__name__)

# The most servers a send_join answer's ``servers_in_room`` may name: far more than any room
# on the public federation has; a longer list is refused (the join is made in full instead).
MAX_SERVERS_IN_ROOM: Final = 10_000

# The most events (state and auth chain together) a ``/state`` answer may hold, and its size.
MAX_STATE_EVENTS: Final = 500_000
MAX_STATE_RESPONSE_BYTES: Final = 500 * 1024 * 1024

# How often the main process looks for rooms partial for longer than this (their resync lost).
SWEEP_INTERVAL_S: Final = 600.0

# The servers asked in one round of a resync (then a backoff, then the next ones).
SERVERS_PER_ROUND: Final = 10

# Waits between rounds over the servers of a room whose resync failed on each of them.
RESYNC_BACKOFF: Final = BackoffPolicy(initial=2.0, multiplier=2.0, maximum=600.0, jitter=(0.8, 1.2))


class BadPartialAnswer(ValueError):
    """A send_join answer with ``members_omitted`` whose ``servers_in_room`` cannot be used."""


def parse_servers_in_room(raw: object, *, answered_by: str, own: str) -> list[str]:
    """The servers to resync from and send to: ``answered_by`` first (it is in the room), then
    the answer's ``servers_in_room`` in its order, each once, without ``own``. Raises
    ``BadPartialAnswer`` for anything but a list of at most ``MAX_SERVERS_IN_ROOM`` server names."""
    if not isinstance(raw, list):
        raise BadPartialAnswer(f"servers_in_room must be a list of server names, got {type(raw).__name__}")
    if len(raw) > MAX_SERVERS_IN_ROOM:
        raise BadPartialAnswer(f"servers_in_room names {len(raw)} servers, more than {MAX_SERVERS_IN_ROOM}")
    for i, item in enumerate(raw):
        if not is_valid_server_name(item):
            shown = repr(item)[:100]
            raise BadPartialAnswer(f"servers_in_room[{i}] is not a server name: {shown}")
    return [s for s in dict.fromkeys([answered_by, *raw]) if s != own]


def servers_for_round(servers: Sequence[str], attempt: int, per_round: int = SERVERS_PER_ROUND) -> list[str]:
    """The servers a resync asks in round ``attempt`` (0-based): the one that answered the join
    (first of ``servers``) every round, then ``per_round - 1`` of the others, taking the next
    ones each round, so a long (or hostile) ``servers_in_room`` costs a bounded round."""
    if not servers:
        return []
    first, others = servers[0], list(servers[1:])
    if not others:
        return [first]
    size = per_round - 1
    start = (attempt * size) % len(others)
    rotated = others[start:] + others[:start]
    return [first, *rotated[: min(size, len(others))]]


class ResyncFailed(Exception):
    """One server could not give us the room's state (the message says why)."""


def quote_path(value: str) -> str:
    return quote(value, safe="")


class PartialStateResyncer:
    """Fetches and stores the full state of the rooms joined with partial state, one task per
    room, in the process that made the join (or, after a restart, the main process)."""

    def __init__(
        self,
        *,
        server_name: str,
        partial: PartialStateStore,
        store: EventsStore,
        loader: EventLoader,
        persister: EventPersister,
        keyring: Keyring,
        client: FederationClient,
        clock: Any,
        metrics: FederationMetrics,
        run_in_thread: RunInThread | None = None,
        backoff: BackoffPolicy = RESYNC_BACKOFF,
    ) -> None:
        self._metrics = metrics
        self._server_name = server_name
        self._partial = partial
        self._store = store
        self._loader = loader
        self._persister = persister
        self._keyring = keyring
        self._client = client
        self._clock = clock
        self._run_in_thread = run_in_thread
        self._backoff = backoff
        self._running: dict[str, Deferred[None]] = {}
        self._stopped = False
        self._paused = False
        self._waiting: set[str] = set()
        self._sweep_call: Any = None
        # Called with each room made whole here (tests and waiters in this process).
        self.on_complete: list[Callable[[str], None]] = []

    def pause(self) -> None:
        """Start no resync until ``unpause`` (the rooms asked for meanwhile wait): for tests that
        look at a room while it is partial. Resyncs under way go on."""
        self._paused = True

    def unpause(self) -> None:
        self._paused = False
        waiting, self._waiting = self._waiting, set()
        for room_id in sorted(waiting):
            self.start(room_id)

    def start(self, room_id: str) -> None:
        """Resync ``room_id`` in the background, unless a resync of it runs here already."""
        if self._stopped or room_id in self._running:
            return
        if self._paused:
            self._waiting.add(room_id)
            return
        done = run_in_background("partial_state_resync", self._resync(room_id))
        if not done.called:
            self._running[room_id] = done

    async def is_partial(self, room_id: str) -> bool:
        return await self._partial.is_partial(room_id)

    async def resume(self, *, joined_before_ms: int | None = None) -> None:
        """Start the resync of every room still marked partial (at start-up), or of those joined
        before ``joined_before_ms`` (the sweep)."""
        rooms = await self._partial.partial_rooms()
        if joined_before_ms is not None:
            rooms = {r: row for r, row in rooms.items() if row.joined_ts < joined_before_ms}
        rooms = {r: row for r, row in rooms.items() if r not in self._running}
        if rooms:
            logger.info("resuming the state resync of %d partial-state rooms", len(rooms))
        for room_id in sorted(rooms):
            self.start(room_id)

    def sweep(self, interval: float = SWEEP_INTERVAL_S) -> None:
        """Every ``interval`` seconds, resume the rooms partial for longer than that: a resync
        whose process died (a worker's: only the main process resumes them at its start) is
        taken up here, at the cost of a second fetch should that process be merely slow."""
        async def once() -> None:
            try:
                await self.resume(joined_before_ms=int((self._clock.seconds() - interval) * 1000))
            finally:
                self.sweep(interval)

        if not self._stopped:
            self._sweep_call = self._clock.callLater(
                interval, lambda: run_in_background("partial_state_sweep", once()))

    def stop(self) -> None:
        self._stopped = True
        if self._sweep_call is not None and self._sweep_call.active():
            self._sweep_call.cancel()
        for done in list(self._running.values()):
            done.cancel()
        self._running.clear()

    async def _resync(self, room_id: str) -> None:
        started = self._clock.seconds()
        try:
            attempt = 0
            while not self._stopped:
                # Read again each round: a later partial join of the room (after a leave) makes
                # another row, whose resync this task then does.
                row = (await self._partial.get_rows([room_id])).get(room_id)
                if row is None or not row.partial:
                    return
                stored = False
                for server in servers_for_round(row.servers, attempt):
                    if self._stopped:
                        return
                    try:
                        await self.resync_from(row, server)
                    except (ResyncFailed, FederationClientError, EventsError) as e:
                        logger.warning("[%s] resyncing the room's state from %s failed: %s", room_id, server, e)
                        self._metrics.partial_state_resyncs.labels(outcome="failed").inc()
                        continue
                    self._metrics.partial_state_resyncs.labels(outcome="completed").inc()
                    self._metrics.partial_state_resync_duration.observe(self._clock.seconds() - started)
                    stored = True
                    break
                if stored:
                    continue
                attempt += 1
                delay = self._backoff.delay(attempt)
                logger.info("[%s] no server gave the room's state (round %d); trying again in %.0fs", room_id,
                            attempt, delay)
                await deferLater(self._clock, delay, lambda: None)
        finally:
            self._running.pop(room_id, None)

    async def resync_from(self, row: PartialStateRow, server: str) -> None:
        """Fetch the state before our join from ``server``, check it and store it."""
        room_id = row.room_id
        identifier = await self._store.get_room_version(room_id)
        if identifier is None:
            raise ResyncFailed(f"room {room_id} is not known here")
        room_version = get_room_version(identifier)
        answer = await self._client.request(
            "GET", server, f"/_matrix/federation/v1/state/{quote_path(room_id)}",
            query={"event_id": row.join_event_id}, max_bytes=MAX_STATE_RESPONSE_BYTES,
        )
        if not isinstance(answer, dict):
            raise ResyncFailed("the /state answer is not an object")
        raw_state, raw_chain = answer.get("pdus"), answer.get("auth_chain")
        if not isinstance(raw_state, list) or not isinstance(raw_chain, list):
            raise ResyncFailed("the /state answer lacks its pdus or auth_chain list")
        if len(raw_state) + len(raw_chain) > MAX_STATE_EVENTS:
            raise ResyncFailed(f"the /state answer holds more than {MAX_STATE_EVENTS} events")
        await self._check_and_store(room_version, row, server, raw_state, raw_chain)

    async def _check_and_store(self, room_version: RoomVersion, row: PartialStateRow, server: str,
                               raw_state: Sequence[object], raw_chain: Sequence[object]) -> None:
        room_id = row.room_id
        verified, state_ids, foreign = await verify_batch(self._keyring, room_version, room_id, raw_state, raw_chain,
                                                          source=server, run_in_thread=self._run_in_thread)
        if foreign is not None:
            raise ResyncFailed(f"the /state answer holds event {foreign} of another room")
        ours = await self._store.get_current_state_for_keys(room_id, [(C.CREATE, "")])
        creates = [verified[i] for i in state_ids if verified[i].type == C.CREATE and verified[i].state_key == ""]
        if len(creates) != 1 or creates[0].event_id != ours.get((C.CREATE, "")):
            raise ResyncFailed("the /state answer's create event is not the room's")
        run = self._run_in_thread or run_inline
        cited = {a for e in verified.values() for a in e.auth_event_ids if a not in verified}
        known = await self._loader.load_events(cited) if cited else {}
        order, rejected = await run(order_and_check, room_version, verified.values(), known)
        state = state_map((verified[i] for i in state_ids), rejected)
        if (C.CREATE, "") not in state:
            raise ResyncFailed(f"the /state answer's create event fails the auth rules: {rejected}")
        done = await self._persister.complete_partial_state(room_version, room_id, row.join_event_id, order,
                                                            rejected, state)
        members = sum(1 for key in state if key[0] == C.MEMBER)
        logger.info("[%s] resynced the room's state from %s: %d state events (%d members), %d rejected%s", room_id,
                    server, len(state), members, len(rejected), "" if done.position is not None else
                    " (the room was not partial any more)")
        for listener in self.on_complete:
            try:
                listener(room_id)
            except Exception:
                logger.exception("partial-state listener %r failed for %s", listener, room_id)
