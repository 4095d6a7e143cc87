"""Fill a database with a synthetic federation backlog for the Spark catch-up report.

The shape is meant to look like a real homeserver's: room sizes (how many
remote servers share a room) and room activity follow a Zipf law, a few
popular servers are in most rooms, about half the events are local, and some
destinations have been down for hours (in backoff, with rooms and PDUs
waiting) while a few more failed only minutes ago. Everything goes in through
``bench/dataset.py`` (bulk ``INSERT ... unnest``), events streamed in
chunks so that millions of them never sit in memory at once. The same seed
gives the same dataset.

    python bench/gen_federation_dataset.py --dsn postgresql://postgres@127.0.0.1/mydb \\
        --destinations 5000 --rooms 50000 --events 5000000 --destination-rooms 1000000

``--create`` makes the database (and applies the schema) first.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs

if __package__ in (None, ""):
    # Run as a file: make the repository root importable (for bench.dataset).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dataset import (  # noqa: E402
    CHUNK_ROWS,
    DatasetStore,
    DestinationRoomRow,
    DestinationRow,
    EventRow,
    ForwardExtremityRow,
    RoomRow,
    StreamPositionRow,
)
from federation_sender.backoff import policy_from_config  # noqa: E402
from federation_sender.config import BackoffConfig  # noqa: E402
from storage.database import Database  # noqa: E402

T = TypeVar("T")

MINUTE_MS: Final = 60_000
HOUR_MS: Final = 60 * MINUTE_MS
#: The federation sender's default backoff (10 minutes doubling, capped at 7 days), here
#: without its jitter, so that the same seed gives the same dataset.
SENDER_BACKOFF: Final = policy_from_config(BackoffConfig())
EVENT_WRITERS: Final = ("event_persister-1", "event_persister-2")


@attrs.frozen
class DatasetShape:
    server_name: str = "hs.example"
    destinations: int = 200
    rooms: int = 1000
    events: int = 50_000
    #: About how many destination_rooms rows to make (rooms without local events get none).
    destination_rooms: int = 10_000
    #: Share of destinations down for hours (past the catch-up threshold) and for minutes.
    down_for_hours: float = 0.04
    down_for_minutes: float = 0.03
    local_share: float = 0.5
    #: Share of rooms whose graph has forked: two forward extremities.
    forked_rooms: float = 0.1
    zipf_exponent: float = 1.05
    span_ms: int = 7 * 24 * HOUR_MS
    now_ms: int = 1_800_000_000_000
    seed: int = 1


@attrs.frozen
class DatasetSummary:
    events: int
    local_events: int
    destination_rooms: int
    destinations_down: int
    max_stream_ordering: int


def _zipf_weights(n: int, exponent: float) -> list[float]:
    return [1.0 / (rank**exponent) for rank in range(1, n + 1)]


def _room_sizes(shape: DatasetShape, weights: Sequence[float]) -> list[int]:
    """Remote servers per room: Zipf-shaped, at least 1, at most every destination, summing to about the target."""
    total = sum(weights)
    scale = shape.destination_rooms / total
    for _ in range(30):  # capped rooms give back their excess: rescale until the sum fits
        sizes = [min(shape.destinations, max(1, round(w * scale))) for w in weights]
        got = sum(sizes)
        if abs(got - shape.destination_rooms) <= max(1, shape.destination_rooms // 200):
            break
        scale *= shape.destination_rooms / max(got, 1)
    return sizes


def _pick_destinations(rng: random.Random, k: int, n: int, cum_weights: Sequence[float]) -> list[int]:
    """``k`` distinct destinations, popular ones more likely."""
    if k * 2 >= n:
        return rng.sample(range(n), k)
    chosen: set[int] = set()
    while len(chosen) < k:
        chosen.update(rng.choices(range(n), cum_weights=cum_weights, k=(k - len(chosen)) * 2))
    return list(chosen)[:k] if len(chosen) > k else list(chosen)


def _backoff_interval(down_for_ms: int) -> int:
    """The retry interval a destination has reached after failing for ``down_for_ms``."""
    interval = elapsed = int(SENDER_BACKOFF.initial)
    while interval < SENDER_BACKOFF.maximum:
        grown = int(SENDER_BACKOFF.next_interval(interval, lambda low, high: 1.0))
        if elapsed + grown > down_for_ms:
            break
        interval, elapsed = grown, elapsed + grown
    return interval


async def generate_dataset(
    db: Database, shape: DatasetShape, progress: Callable[[str], None] = lambda _line: None
) -> DatasetSummary:
    """Write the dataset ``shape`` describes into ``db`` (a migrated, empty database)."""
    rng = random.Random(shape.seed)
    store = DatasetStore(db)
    server = shape.server_name
    start_ms = shape.now_ms - shape.span_ms
    await store.set_server_name(server, start_ms)

    destinations = [f"remote{i}.example" for i in range(shape.destinations)]
    rooms = [f"!room{i}:{server}" for i in range(shape.rooms)]
    room_weights = _zipf_weights(shape.rooms, shape.zipf_exponent)
    sizes = _room_sizes(shape, room_weights)
    dest_cum = list(itertools.accumulate(_zipf_weights(shape.destinations, 0.8)))
    members = [_pick_destinations(rng, k, shape.destinations, dest_cum) for k in sizes]
    await store.insert_rooms([RoomRow(r, "12", f"@admin:{server}", start_ms) for r in rooms])
    progress(f"rooms: {len(rooms):,}, remote servers per room {min(sizes)}-{max(sizes)}")

    # Events, in stream order; busy rooms are the big ones.
    activity_cum = list(itertools.accumulate(w**0.9 for w in room_weights))
    last_local: dict[int, int] = {}
    last_two: dict[int, list[tuple[int, str]]] = {}
    depth: dict[int, int] = {}
    local_count = 0
    started = time.monotonic()
    step_ms = shape.span_ms / max(shape.events, 1)
    for chunk_start in range(0, shape.events, CHUNK_ROWS):
        count = min(CHUNK_ROWS, shape.events - chunk_start)
        room_picks = rng.choices(range(shape.rooms), cum_weights=activity_cum, k=count)
        chunk: list[EventRow] = []
        for offset, room in enumerate(room_picks):
            so = chunk_start + offset + 1
            is_local = rng.random() < shape.local_share
            if is_local:
                sender = f"@user{rng.randrange(500)}:{server}"
                last_local[room] = so
                local_count += 1
            else:
                origin = destinations[members[room][rng.randrange(len(members[room]))]]
                sender = f"@user{rng.randrange(50)}:{origin}"
            ts = start_ms + int((so - 1) * step_ms) + rng.randrange(200)
            d = depth[room] = depth.get(room, 0) + 1
            event_id = f"$e{so}_{shape.seed}"
            room_id = rooms[room]
            chunk.append(
                EventRow(
                    stream_ordering=so,
                    instance_name=EVENT_WRITERS[room % len(EVENT_WRITERS)],
                    event_id=event_id,
                    room_id=room_id,
                    type="m.room.message",
                    state_key=None,
                    sender=sender,
                    depth=d,
                    origin_server_ts=ts,
                    is_local=is_local,
                    json=(
                        f'{{"type":"m.room.message","room_id":"{room_id}","sender":"{sender}",'
                        f'"origin_server_ts":{ts},"depth":{d},"content":{{"msgtype":"m.text","body":"message {so}"}}}}'
                    ),
                )
            )
            tail = last_two.setdefault(room, [])
            tail.append((so, event_id))
            if len(tail) > 2:
                tail.pop(0)
        await store.insert_events(chunk)
        done = chunk_start + count
        if done == shape.events or (chunk_start // CHUNK_ROWS) % 25 == 24:
            rate = done / max(time.monotonic() - started, 1e-9)
            progress(f"events: {done:,} of {shape.events:,} ({rate:,.0f}/s)")
    max_so = shape.events

    def stream_ordering_at(ts: int) -> int:
        """The last stream ordering written by ``ts`` (events are spread evenly over the span)."""
        return max(0, min(max_so, math.floor((ts - start_ms) / step_ms)))

    # Destinations: most caught up (some a few seconds behind), some down for minutes or hours.
    order = list(range(shape.destinations))
    rng.shuffle(order)
    hours_down = set(order[: round(shape.down_for_hours * shape.destinations)])
    minutes_down = set(order[len(hours_down) : len(hours_down) + round(shape.down_for_minutes * shape.destinations)])
    dest_rows = []
    for i, name in enumerate(destinations):
        if i in hours_down or i in minutes_down:
            down_for = rng.randrange(HOUR_MS, 36 * HOUR_MS) if i in hours_down else rng.randrange(MINUTE_MS, 50 * MINUTE_MS)
            failure_ts = shape.now_ms - down_for
            interval = _backoff_interval(down_for)
            retry_last = shape.now_ms - rng.randrange(0, min(interval, down_for))
            dest_rows.append(DestinationRow(name, retry_last, interval, failure_ts, stream_ordering_at(failure_ts)))
        else:
            behind_ms = rng.choice((0, 0, 0, rng.randrange(1000, 30_000)))
            dest_rows.append(DestinationRow(name, None, None, None, stream_ordering_at(shape.now_ms - behind_ms)))
    await store.insert_destinations(dest_rows)
    progress(f"destinations: {len(dest_rows):,} ({len(hours_down)} down for hours, {len(minutes_down)} for minutes)")

    # destination_rooms: every remote server in a room should have its latest local event.
    dr_rows = [
        DestinationRoomRow(destinations[d], rooms[room], so)
        for room, so in last_local.items()
        for d in members[room]
    ]
    await store.insert_destination_rooms(dr_rows)
    progress(f"destination_rooms: {len(dr_rows):,}")

    # Forward extremities: a room's latest event, and in forked rooms the one before it too.
    extremities: list[ForwardExtremityRow] = []
    for room, tail in last_two.items():
        forked = len(tail) == 2 and rng.random() < shape.forked_rooms
        extremities.extend(ForwardExtremityRow(rooms[room], event_id) for _so, event_id in (tail if forked else tail[-1:]))
    await store.insert_forward_extremities(extremities)

    # Stream positions: the events writers (one a little behind), and a few other streams.
    writer_max = {w: 0 for w in EVENT_WRITERS}
    for room, tail in last_two.items():
        writer = EVENT_WRITERS[room % len(EVENT_WRITERS)]
        writer_max[writer] = max(writer_max[writer], tail[-1][0])
    lagging = EVENT_WRITERS[-1]
    positions = [
        StreamPositionRow("events", w, pos - (max(1, max_so // 2000) if w == lagging else 0))
        for w, pos in writer_max.items()
    ]
    positions += [
        StreamPositionRow("typing", "master", 1_000 + rng.randrange(100)),
        StreamPositionRow("receipts", "master", 5_000),
        StreamPositionRow("receipts", "generic-1", 4_870),
        StreamPositionRow("to_device", "master", 800),
        StreamPositionRow("federation", "federation_sender-1", 12_000),
        StreamPositionRow("federation", "master", 12_045),
    ]
    await store.upsert_stream_positions(positions)
    await store.advance_events_sequence(max_so)
    await store.analyze()
    return DatasetSummary(
        events=shape.events,
        local_events=local_count,
        destination_rooms=len(dr_rows),
        destinations_down=len(hours_down) + len(minutes_down),
        max_stream_ordering=max_so,
    )


# --- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    defaults = DatasetShape()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dsn", required=True, help="postgresql:// URL of the database to fill")
    parser.add_argument("--create", action="store_true", help="create the database and apply the schema first")
    parser.add_argument("--server-name", default=defaults.server_name)
    parser.add_argument("--destinations", type=int, default=defaults.destinations)
    parser.add_argument("--rooms", type=int, default=defaults.rooms)
    parser.add_argument("--events", type=int, default=defaults.events)
    parser.add_argument("--destination-rooms", type=int, default=defaults.destination_rooms)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--now-ms", type=int, default=None, help="the dataset's 'now' (default: the current time)")
    return parser


def shape_from_args(args: argparse.Namespace) -> DatasetShape:
    return DatasetShape(
        server_name=args.server_name,
        destinations=args.destinations,
        rooms=args.rooms,
        events=args.events,
        destination_rooms=args.destination_rooms,
        seed=args.seed,
        now_ms=args.now_ms if args.now_ms is not None else int(time.time() * 1000),
    )


def create_database(dsn: str) -> None:
    """Create the database ``dsn`` names (it must not exist yet)."""
    from bench.dataset import create_database

    base, _, name = dsn.rpartition("/")
    create_database(f"{base}/postgres", name)


def run_with_database(dsn: str, work: Callable[[Database], Coroutine[Any, Any, T]]) -> T:
    """Start the reactor, open ``dsn``, run the coroutine ``work(db)`` makes; return its result."""
    from homeserver.reactor import install_reactor

    reactor = install_reactor()
    from prometheus_client import CollectorRegistry
    from twisted.internet.defer import Deferred

    from storage.metrics import StorageMetrics

    db = Database(reactor, dsn, metrics=StorageMetrics.create(CollectorRegistry()), max_connections=2)
    db.start()
    values: list[T] = []
    errors: list[BaseException] = []

    async def body() -> None:
        try:
            values.append(await work(db))
        except BaseException as e:  # reported after the reactor stops
            errors.append(e)
        finally:
            reactor.stop()

    reactor.callWhenRunning(lambda: Deferred.fromCoroutine(body()))
    reactor.run()
    db.close()
    if errors:
        raise errors[0]
    return values[0]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    shape = shape_from_args(args)
    if args.create:
        create_database(args.dsn)

    async def work(db: Database) -> DatasetSummary:
        if args.create:
            from storage.prepare import prepare_database

            await prepare_database(db)
        return await generate_dataset(db, shape, lambda line: print(line, file=sys.stderr, flush=True))

    started = time.monotonic()
    summary = run_with_database(args.dsn, work)
    print(f"{summary} in {time.monotonic() - started:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
