"""Search and room directory figures: ``POST /search`` over many events (p50, p99, by rank and
by recent, for a rare and a common word) and ``/publicRooms`` over many published rooms.

Starts a ``tributary`` process on a new database of the PostgreSQL server at
``TRIBUTARY_TEST_POSTGRES`` (dropped at the end), makes a user and a few rooms through the
API, then bulk-loads synthetic messages (copies of a real one with generated bodies: the
insert trigger fills the search vector as for any event) and synthetic published rooms
straight into the tables, and times the endpoints over HTTP. Run by hand:

    .venv/bin/python bench/search_directory.py [--events 1000000] [--rooms 10000] [--requests 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psycopg2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import TributaryProcess  # noqa: E402

ADMIN_DSN = os.environ.get("TRIBUTARY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
PREFIX = "/_matrix/client/v3"
SEARCH_ROOMS = 10
# 5,000 made-up words; a body is 8 of them, so each word is in about 0.16% of the messages.
VOCABULARY = 5000


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def call(session: aiohttp.ClientSession, base: str, method: str, path: str, body: Any = None,
               token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.request(method, base + PREFIX + path, json=body, headers=headers) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{method} {path} -> {r.status} {data}")
        return data


def load_messages(dsn: str, room_ids: list[str], count: int) -> float:
    """``count`` messages spread over the rooms, each a copy of the room's first message with a
    body of 8 generated words ("w17 w4032 ..."; word "common" in every 10th), in one statement."""
    start = time.perf_counter()
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT coalesce(max(stream_ordering), 0) FROM events")
        base = int(cur.fetchone()[0]) + 1000  # type: ignore[index]
        cur.execute(
            """
            WITH template AS (
                SELECT e.room_id, e.json, s.state_group_before, row_number() OVER (ORDER BY e.room_id) - 1 AS n
                FROM events e JOIN event_state_groups s ON s.event_id = e.event_id
                WHERE e.event_id IN (SELECT DISTINCT ON (room_id) event_id FROM events
                                     WHERE type = 'm.room.message' AND room_id = ANY(%s)
                                     ORDER BY room_id, stream_ordering)
            ), generated AS (
                SELECT i, t.room_id, t.json, t.state_group_before,
                       (SELECT string_agg('w' || floor(random() * %s)::int, ' ') FROM generate_series(1, 8) WHERE i > 0)
                       || CASE WHEN i %% 10 = 0 THEN ' common' ELSE '' END AS body
                FROM generate_series(1, %s) AS i JOIN template t ON t.n = i %% %s
            ), inserted AS (
                INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender, depth,
                                    origin_server_ts, is_local, json)
                SELECT %s + i, 'master', '$bench' || i, room_id, 'm.room.message', NULL,
                       json::jsonb ->> 'sender', 10 + i, 1700000000000 + i, TRUE,
                       jsonb_set(jsonb_set(json::jsonb, '{content,body}', to_jsonb(body)),
                                 '{origin_server_ts}', to_jsonb(1700000000000 + i))::text
                FROM generated
                RETURNING event_id
            )
            INSERT INTO event_state_groups (event_id, state_group_before, state_group_after)
            SELECT '$bench' || i, state_group_before, state_group_before FROM generated
            """,
            (room_ids, VOCABULARY, count, len(room_ids), base),
        )
        cur.execute("ANALYZE events")
    return time.perf_counter() - start


def load_public_rooms(dsn: str, template_room: str, count: int) -> float:
    """``count`` published rooms, each with a name, a public join rule and one joined member,
    copied from ``template_room``'s state events."""
    start = time.perf_counter()
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT coalesce(max(stream_ordering), 0) FROM events")
        base = int(cur.fetchone()[0]) + 1000  # type: ignore[index]
        for offset, (event_type, state_key_sql, membership) in enumerate([
            ("m.room.join_rules", "''", None), ("m.room.name", "''", None), ("m.room.member", "c.state_key", "join"),
        ]):
            cur.execute(
                f"""
                WITH src AS (
                    SELECT c.state_key, e.json FROM current_state_events c JOIN events e ON e.event_id = c.event_id
                    WHERE c.room_id = %s AND c.type = %s LIMIT 1
                ), rooms AS (
                    SELECT i, '!benchroom' || i || ':localhost' AS room_id FROM generate_series(1, %s) AS i
                ), inserted AS (
                    INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender,
                                        depth, origin_server_ts, is_local, json)
                    SELECT %s + i * 3, 'master', '$benchroom' || i || '_' || %s, r.room_id, %s, src.state_key,
                           src.json::jsonb ->> 'sender', 1, 0, TRUE,
                           CASE WHEN %s = 'm.room.name'
                                THEN jsonb_set(src.json::jsonb, '{{content,name}}', to_jsonb('Bench room ' || i))::text
                                ELSE src.json END
                    FROM rooms r, src RETURNING event_id, room_id, state_key
                )
                INSERT INTO current_state_events (room_id, type, state_key, event_id, membership)
                SELECT room_id, %s, state_key, event_id, %s FROM inserted
                """,
                (template_room, event_type, count, base + offset, offset, event_type, event_type, event_type,
                 membership),
            )
        cur.execute(
            "INSERT INTO room_directory (room_id, published_ts) "
            "SELECT '!benchroom' || i || ':localhost', 0 FROM generate_series(1, %s) AS i",
            (count,),
        )
        cur.execute("ANALYZE")
    return time.perf_counter() - start


async def timed(session: aiohttp.ClientSession, base: str, token: str, method: str, path: str, body: Any,
                n: int) -> tuple[float, float, Any]:
    times, last = [], None
    for _ in range(n):
        start = time.perf_counter()
        last = await call(session, base, method, path, body, token)
        times.append(time.perf_counter() - start)
    return pct(times, 0.5), pct(times, 0.99), last


async def main(args: argparse.Namespace) -> None:
    dbname = "bench_rel_" + secrets.token_hex(4)
    admin = psycopg2.connect(ADMIN_DSN)
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{dbname}"')
    dsn = ADMIN_DSN.rpartition("/")[0] + "/" + dbname
    tmp = Path(tempfile.mkdtemp(prefix="bench-search-"))
    hs = TributaryProcess.configure(tmp, database_url=dsn)
    hs.start()
    try:
        async with aiohttp.ClientSession() as session:
            base = hs.base_url
            alice = (await call(session, base, "POST", "/register", {
                "username": "alice", "password": "pw", "auth": {"type": "m.login.dummy"}}))["access_token"]
            rooms = []
            for i in range(SEARCH_ROOMS):
                created = await call(session, base, "POST", "/createRoom",
                                     {"preset": "public_chat", "name": f"seed {i}"}, alice)
                room = created["room_id"]
                await call(session, base, "PUT", f"/rooms/{room}/send/m.room.message/seed{i}",
                           {"msgtype": "m.text", "body": "seed"}, alice)
                rooms.append(room)
            print(f"loading {args.events} messages into {SEARCH_ROOMS} rooms ...", flush=True)
            took = load_messages(dsn, rooms, args.events)
            print(f"  {took:.1f} s ({args.events / took:.0f} events/s, search vector filled by the trigger)")
            print(f"POST /search over {args.events} events, {args.requests} requests each, limit 10:")
            for label, term in [("rare word", "w4242"), ("common word (10% of events)", "common"),
                                ("either of two words", "w17 or w4032")]:
                for order in ("rank", "recent"):
                    body = {"search_categories": {"room_events": {"search_term": term, "order_by": order}}}
                    p50, p99, last = await timed(session, base, alice, "POST", "/search", body, args.requests)
                    count = last["search_categories"]["room_events"]["count"]
                    print(f"  {label:28} {order:6}: p50 {p50 * 1000:7.1f} ms  p99 {p99 * 1000:7.1f} ms"
                          f"  ({count} matches)")
            print(f"loading {args.rooms} published rooms ...", flush=True)
            took = load_public_rooms(dsn, rooms[0], args.rooms)
            print(f"  {took:.1f} s")
            print(f"/publicRooms over {args.rooms} published rooms, {args.requests} requests each:")
            for label, method, body, path in [
                ("GET, first page of 100", "GET", None, "/publicRooms?limit=100"),
                ("POST, search term", "POST", {"limit": 100, "filter": {"generic_search_term": "room 99"}},
                 "/publicRooms"),
                ("GET, everything", "GET", None, "/publicRooms"),
            ]:
                p50, p99, last = await timed(session, base, alice, method, path, body, args.requests)
                print(f"  {label:28}: p50 {p50 * 1000:7.1f} ms  p99 {p99 * 1000:7.1f} ms"
                      f"  ({len(last['chunk'])} of {last['total_room_count_estimate']})")
    finally:
        hs.stop()
        admin.cursor().execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        admin.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rooms", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=50)
    asyncio.run(main(parser.parse_args()))
