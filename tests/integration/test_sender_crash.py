"""The whole-system guarantee of the federation sender (issue 28), as a property of real processes.

The worker layout (main, two event persisters, a generic worker, a federation sender worker, over
Redis) sends to a destination that is another Tributary process with its own database, whose user
Bob has joined a room on the source. Alice fans out messages in that room through the generic
worker; meanwhile, at points chosen from a seed, a process is SIGKILLed and restarted a moment
later: the federation sender, the destination (mid-transaction: the source is sending all the
while), or both. Whatever the kill points, Bob's /sync on the destination ends, within a bounded
wait, with every message exactly once and in the order Alice sent it, and so does /messages
back-paginated from the end; and the destination never had to fetch a gap (no get_missing_events
or /state_ids): catch-up sends what it missed oldest first.

``make test`` runs two seeds per variant with 120 messages (gaps longer than one catch-up round of
50, about 35 s). By hand, more seeds and the issue's 200 messages::

    TRIBUTARY_CRASH_SEEDS=50 TRIBUTARY_CRASH_MESSAGES=200 \\
        .venv/bin/python -m pytest tests/integration/test_sender_crash.py -q

``bench/sender_crash.py`` runs the issue's exact scenario and prints its figures.
"""

# tests: federation_sender/sender.py, federation_sender/core.py, federation_sender/catch_up.py

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import attrs
import psycopg2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REDIS_URL, scratch_database
from tests.harness import TributaryProcess, configure_workers
from tests.integration.test_workers import Http, register
from tests.interop.matrix_client import MatrixUser
from tests.interop.synapse import SynapseProcess

VARIANTS = ("sender", "destination", "both")
SEEDS = int(os.environ.get("TRIBUTARY_CRASH_SEEDS", str(2 * len(VARIANTS))))
MESSAGES = int(os.environ.get("TRIBUTARY_CRASH_MESSAGES", "120"))
# How long the destination's /sync may take to show everything once every process is back.
CONVERGE_SECONDS = 60.0

# The source's sender, tuned so that a scenario takes seconds: a destination that is down backs
# off 300 ms, then about 0.6 s, 1.2 s, ... at most 3 s, and crosses the catch-up threshold after a
# few failures. A transaction gets 20 s: a receiving Tributary commits each event on its own.
SENDER: dict[str, Any] = {
    "transaction_timeout": "20s",
    "backoff": {"initial": "300ms", "max": "3s"},
    "catch_up": {"threshold": "1500ms", "scan_interval": "1s", "wakes_per_second": 100},
}
TIMELINE = quote(json.dumps({"room": {"timeline": {"limit": 1000}}}))


class Destination(Protocol):
    """The destination homeserver: a ``TributaryProcess`` or (bench/sender_crash.py) a ``SynapseProcess``."""

    process: Any
    client_port: int

    @property
    def log_path(self) -> Path: ...

    def start(self, *, timeout: float = ...) -> float: ...

    def stop(self) -> int | None: ...


def sigkill(process: TributaryProcess | Destination) -> None:
    """SIGKILL the process and reap it."""
    assert process.process is not None
    if process.process.poll() is None:
        process.process.send_signal(signal.SIGKILL)
    process.process.wait()


@attrs.define
class Layout:
    """The source's worker layout and the destination, started; Alice on the source, Bob on the destination."""

    main: TributaryProcess
    workers: dict[str, TributaryProcess]
    destination: Destination
    source_dsn: str
    destination_dsn: str | None  # None: a Synapse with its own SQLite database
    alice: Http
    bob: Http

    @property
    def sender(self) -> TributaryProcess:
        return self.workers["fs1"]


@contextmanager
def started_layout(tmp_path: Path, postgres_template: str | None, redis_url: str, *,
                   sender: dict[str, Any] | None = None, synapse_python: Path | None = None) -> Iterator[Layout]:
    """Start the source's worker layout and the destination (another Tributary, or a Synapse run by
    ``synapse_python``), register Alice and Bob; stop all on exit."""
    with ExitStack() as stack:
        source_dsn = stack.enter_context(scratch_database(postgres_template))
        main, workers, generic_port = configure_workers(
            tmp_path / "source", source_dsn, redis_url, extra={"federation_sender": sender or SENDER})
        started: list[TributaryProcess | Destination] = []
        try:
            for process in (main, *workers.values()):
                started.append(process)
                process.start()
            # Configured once the source listens, so that no port it chose is chosen again.
            destination: Destination
            destination_dsn: str | None = None
            if synapse_python is None:
                destination_dsn = stack.enter_context(scratch_database(postgres_template))
                destination = TributaryProcess.configure_federating(tmp_path / "destination",
                                                                    database_url=destination_dsn)
            else:
                (tmp_path / "destination").mkdir(parents=True, exist_ok=True)
                destination = SynapseProcess.configure(synapse_python, tmp_path / "destination")
            started.append(destination)
            destination.start()
            layout = Layout(main, workers, destination, source_dsn, destination_dsn, Http(0), Http(0))
            # Registration is the main process's; everything else Alice does goes to the generic worker.
            layout.alice = Http(generic_port, register(main.client_port, "alice")[1])
            bob = MatrixUser(f"http://127.0.0.1:{destination.client_port}")
            bob.register("bob", "correct horse")  # through user-interactive auth, as Synapse wants
            layout.bob = Http(destination.client_port, bob.access_token)
            yield layout
        finally:
            for process in reversed(started):
                if process.process is not None:
                    process.stop()


@attrs.frozen
class Kill:
    """SIGKILL ``target`` ("sender" or "destination") once ``after_messages`` messages are sent
    (or ``after_seconds`` into the fan-out), and start it again ``down_seconds`` later."""

    target: str
    down_seconds: float
    after_messages: int | None = None
    after_seconds: float | None = None

    def due(self, sent: int, elapsed: float) -> bool:
        if self.after_messages is not None:
            return sent >= self.after_messages
        return self.after_seconds is not None and elapsed >= self.after_seconds


def plan_kills(seed: int, variant: str, messages: int) -> list[Kill]:
    """One or two kill points, chosen from ``seed``: each kills the sender, the destination or
    (``both``) the two at once, after a random number of messages, for up to 1.5 s."""
    rng = random.Random(seed)
    kills: list[Kill] = []
    for _ in range(rng.choice((1, 2))):
        after = rng.randrange(1, messages)
        targets = ("sender", "destination") if variant == "both" else (variant,)
        kills.extend(Kill(target, round(rng.uniform(0.0, 1.5), 2), after_messages=after) for target in targets)
    return sorted(kills, key=lambda kill: kill.after_messages or 0)


@attrs.define
class Outcome:
    """What a fan-out with kills ended with on the destination."""

    sent: list[str]
    synced: list[str]             # the room's messages in Bob's live /sync, in the order they came
    synced_since: list[str]       # the same from one /sync since a token taken before the fan-out
    paginated: list[str]          # /messages back-paginated from the end, oldest first
    limited: bool                 # that one /sync said its timeline was cut
    converged_seconds: float | None  # from the last restart until Bob's /sync had every message
    fan_out_seconds: float
    killed_after: list[int] = attrs.Factory(list)  # messages sent when each kill happened
    gap_fetches: float = 0.0  # get_missing_events and /state_ids requests the source answered meanwhile
    live_limited: int = 0  # live /sync answers whose timeline for the room was cut

    @property
    def complete(self) -> bool:
        return (self.synced == self.synced_since == self.paginated == self.sent and not self.limited
                and not self.live_limited)


class RoomFollower(threading.Thread):
    """Follows Bob's /sync on the destination (through its restarts) and keeps one room's messages."""

    def __init__(self, bob: Http, room_id: str, since: str) -> None:
        super().__init__(daemon=True)
        self.bob, self.room_id, self.since = bob, room_id, since
        self.seen: list[str] = []
        self.limited = 0  # syncs whose timeline the server cut (the client would back-paginate)
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            status, answer = self.bob.call("GET", f"sync?timeout=1000&filter={TIMELINE}&since={self.since}", timeout=10)
            if status != 200:  # the destination is down, or starting
                time.sleep(0.1)
                continue
            room = answer.get("rooms", {}).get("join", {}).get(self.room_id, {})
            self.limited += bool(room.get("timeline", {}).get("limited"))
            self.seen.extend(e["event_id"] for e in room.get("timeline", {}).get("events", [])
                             if e.get("type") == "m.room.message")
            self.since = answer["next_batch"]


def gap_fetches(layout: Layout) -> float:
    """get_missing_events and /state_ids requests the source's main process (its federation
    listener) has answered: what a destination asks when it has a gap to fill."""
    status, body = layout.main.get("/metrics", port=layout.main.metrics_port)
    assert status == 200, body
    return sum(sample.value for family in text_string_to_metric_families(body.decode()) for sample in family.samples
               if sample.name == "tributary_http_requests_total"
               and sample.labels.get("servlet") in ("federation_get_missing_events", "federation_state_ids"))


def paginate(bob: Http, room_id: str) -> list[str]:
    """The room's messages by /messages, back-paginated from the end, oldest first."""
    found: list[str] = []
    query = "dir=b&limit=100"
    for _ in range(1000):
        answer = bob.ok("GET", f"rooms/{quote(room_id, safe='')}/messages?{query}")
        found.extend(e["event_id"] for e in answer["chunk"] if e["type"] == "m.room.message")
        if not answer["chunk"] or "end" not in answer:
            return found[::-1]
        query = f"dir=b&limit=100&from={quote(answer['end'])}"
    raise AssertionError("/messages never reached the start of the room")


def fan_out_with_kills(layout: Layout, messages: int, kills: list[Kill], label: str,
                       converge_seconds: float = CONVERGE_SECONDS) -> Outcome:
    """A new room that Bob joins; Alice sends ``messages`` messages in it while ``kills`` happen;
    then wait (at most ``converge_seconds`` after the last restart) for Bob's /sync to show them all."""
    alice, bob = layout.alice, layout.bob
    room_id = alice.ok("POST", "createRoom", {"preset": "public_chat"})["room_id"]
    bob.ok("POST", f"join/{quote(room_id, safe='')}?via={quote(layout.main.server_name)}", {})
    # A Tributary destination joins with partial state; its member list waits for the resync,
    # after which a non-lazy /sync would send the room once more as newly joined (limited).
    bob.ok("GET", f"rooms/{quote(room_id, safe='')}/joined_members")
    since = bob.ok("GET", f"sync?timeout=0&filter={TIMELINE}")["next_batch"]
    follower = RoomFollower(bob, room_id, since)
    follower.start()
    fetches_before = gap_fetches(layout)
    processes: dict[str, TributaryProcess | Destination] = {"sender": layout.sender, "destination": layout.destination}
    restarts: dict[str, threading.Thread] = {}
    failures: list[BaseException] = []

    def restart(process: TributaryProcess | Destination, delay: float) -> None:
        time.sleep(delay)
        try:
            process.start()
        except BaseException as e:  # reported by the test, not lost in the thread
            failures.append(e)

    def kill(k: Kill) -> None:
        killed_after.append(len(sent))
        if k.target in restarts:  # still down from an earlier kill: let it come back first
            restarts.pop(k.target).join()
        sigkill(processes[k.target])
        restarts[k.target] = threading.Thread(target=restart, args=(processes[k.target], k.down_seconds))
        restarts[k.target].start()

    sent: list[str] = []
    killed_after: list[int] = []
    waiting = list(kills)
    started = time.monotonic()
    try:
        for i in range(messages):
            while waiting and waiting[0].due(i, time.monotonic() - started):
                kill(waiting.pop(0))
            deadline = time.monotonic() + 60
            while True:  # a client retries with the same transaction ID until it gets an answer
                status, answer = alice.call("PUT", f"rooms/{quote(room_id, safe='')}/send/m.room.message/{label}-{i}",
                                            {"msgtype": "m.text", "body": f"{label} {i}"})
                if status == 200:
                    sent.append(answer["event_id"])
                    break
                assert time.monotonic() < deadline, (status, answer)
                time.sleep(0.1)
        for k in waiting:  # kill points past the end of the fan-out
            kill(k)
        fan_out_seconds = time.monotonic() - started
        for thread in restarts.values():
            thread.join()
        assert not failures, failures
        back = time.monotonic()
        converged: float | None = None
        while time.monotonic() < back + converge_seconds:
            if set(sent) <= set(follower.seen):
                converged = time.monotonic() - back
                break
            time.sleep(0.1)
        time.sleep(0.5)  # anything that would arrive twice has had its chance to
    finally:
        follower.stop_flag.set()
        follower.join(timeout=15)
    once = bob.ok("GET", f"sync?timeout=0&filter={TIMELINE}&since={quote(since)}")
    timeline = once.get("rooms", {}).get("join", {}).get(room_id, {}).get("timeline", {})
    synced_since = [e["event_id"] for e in timeline.get("events", []) if e["type"] == "m.room.message"]
    return Outcome(sent, follower.seen, synced_since, paginate(bob, room_id), bool(timeline.get("limited")),
                   converged, fan_out_seconds, killed_after, gap_fetches(layout) - fetches_before, follower.limited)


def diagnosis(layout: Layout, outcome: Outcome) -> str:
    """What the logs say about refused PDUs and gaps, for a failure message."""
    missing = [e for e in outcome.sent if e not in set(outcome.synced)]
    lines = [f"{len(set(outcome.synced) & set(outcome.sent))}/{len(outcome.sent)} delivered to /sync, "
             f"{len(outcome.synced) - len(set(outcome.synced))} duplicates, {len(missing)} missing "
             f"(first {missing[:3]}); /sync since: {len(outcome.synced_since)} (limited {outcome.limited}); "
             f"/messages: {len(outcome.paginated)}; gap fetches: {outcome.gap_fetches:.0f}"]
    with psycopg2.connect(layout.source_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT destination, retry_last_ts, retry_interval, last_successful_stream_ordering, "
                    "catch_up_from FROM destinations")
        lines.append(f"source destinations: {cur.fetchall()}")
        cur.execute("SELECT destination, room_id, stream_ordering FROM destination_rooms ORDER BY stream_ordering")
        lines.append(f"source destination_rooms: {cur.fetchall()}")
        cur.execute("SELECT stream_name, instance_name, stream_id FROM stream_positions WHERE stream_name = 'events'")
        lines.append(f"source events positions: {cur.fetchall()}; max stream_ordering: ")
        cur.execute("SELECT max(stream_ordering) FROM events")
        lines[-1] += str(cur.fetchone())
    conn.close()
    for process in (layout.sender, layout.destination):
        text = process.log_path.read_text(encoding="utf-8", errors="replace")
        wanted = [line for line in text.splitlines()
                  if any(word in line for word in ("refused", "rejected", "missing", "catch", "Traceback", "Error"))]
        lines.append(f"--- {process.log_path.name}: {len(wanted)} lines of note, the last 25:")
        lines.extend(wanted[-25:])
    return "\n".join(lines)


@pytest.fixture(scope="module")
def layout(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    # The module shares one layout; Redis's logical test database is flushed once, for it.
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    client.flushdb()
    client.close()
    with started_layout(tmp_path_factory.mktemp("crash"), postgres_template, REDIS_URL) as started:
        yield started


CASES = [(VARIANTS[seed % len(VARIANTS)], seed) for seed in range(SEEDS)]


@pytest.mark.timeout(60 + 3 * MESSAGES)
@pytest.mark.parametrize(("variant", "seed"), CASES, ids=[f"{v}-seed{s}" for v, s in CASES])
def test_every_message_reaches_the_destination_once_in_order_whatever_is_killed(
    layout: Layout, variant: str, seed: int
) -> None:
    """Kill points from the seed (see ``plan_kills``): the sender, the destination or both are
    SIGKILLed during the fan-out and started again; the destination's /sync (live, and once since
    before the fan-out) and /messages end with every message exactly once, in send order."""
    kills = plan_kills(seed, variant, MESSAGES)
    outcome = fan_out_with_kills(layout, MESSAGES, kills, f"s{seed}")
    assert len(outcome.sent) == len(set(outcome.sent)) == MESSAGES
    assert outcome.converged_seconds is not None, f"{kills}: " + diagnosis(layout, outcome)
    assert outcome.complete, f"{kills}: " + diagnosis(layout, outcome)
    # Catch-up sends each room's missed events oldest first: the sender never leaves the destination
    # a gap of its own making to fetch (issue 28), whatever the receiver could bridge.
    assert outcome.gap_fetches == 0, f"{kills}: " + diagnosis(layout, outcome)
    assert layout.destination_dsn is not None
    with psycopg2.connect(layout.destination_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM events WHERE event_id = ANY(%s) AND NOT outlier", (outcome.sent,))
        assert cur.fetchone() == (MESSAGES,)
    conn.close()
