"""RoomPosition's SQL bounds select exactly the events its per-writer rule covers, in PostgreSQL."""

from __future__ import annotations

import random

import psycopg2

from storage.stores.timeline import RoomPosition

WRITERS = ("p1", "p2", "p3")


def random_position(rng: random.Random) -> RoomPosition:
    minimum = rng.randint(0, 40)
    return RoomPosition.of(minimum, {w: minimum + rng.randint(0, 20) for w in WRITERS if rng.random() < 0.6})


def test_sql_bounds_match_covers(database_dsn: str) -> None:
    rng = random.Random(7)
    rows = [(so, rng.choice(WRITERS)) for so in range(1, 80)]
    with psycopg2.connect(database_dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TEMP TABLE t (stream_ordering BIGINT, instance_name TEXT)")
        cur.executemany("INSERT INTO t VALUES (%s, %s)", rows)
        for _ in range(300):
            after, upto = random_position(rng), random_position(rng)
            lower, lower_params = after.sql_after("t.")
            upper, upper_params = upto.sql_upto("t.")
            cur.execute(f"SELECT stream_ordering FROM t WHERE {lower} AND {upper} ORDER BY 1",
                        (*lower_params, *upper_params))
            expected = [so for so, w in rows if not after.covers(w, so) and upto.covers(w, so)]
            assert [r[0] for r in cur.fetchall()] == expected, (after, upto)


def test_one_writer_is_a_plain_stream_ordering_bound() -> None:
    assert RoomPosition.at(5).sql_upto() == ("stream_ordering <= %s", [5])
    assert RoomPosition.at(5).sql_after("e.") == ("e.stream_ordering > %s", [5])
    assert RoomPosition.of(5, {"p1": 5, "p2": 3}) == RoomPosition.at(5)  # nobody ahead of the minimum
    assert RoomPosition.of(5, {"p1": 9}).capped(7) == RoomPosition.of(5, {"p1": 7})
    assert RoomPosition.of(5, {"p1": 9}).capped(4) == RoomPosition.at(4)
