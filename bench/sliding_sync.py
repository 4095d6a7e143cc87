"""Simplified sliding sync (MSC4186) figures: the first answer for a user in many rooms, and how
fast a waiting connection is woken by a send, next to /sync's wake.

A user in ``--rooms`` rooms (default 1,000, each with a message) asks for the top 20 by recency
with ``timeline_limit`` 1 and an Element X-like ``required_state``, ``--initial`` times, each on
a new connection (so each answer is a first one): p50/p99 ms. Then a connection waits with a
``pos`` and a 30 s timeout while another user sends to one of the rooms, ``--wakes`` times:
p50/p99 ms from the send's answer to the sync's; the same for ``GET /sync``.

Against a running server (``--base-url``, with generous ``rc_message`` and ``rc_registration``
limits), or, by default, a fresh ``tributary`` process on the embedded PostgreSQL. Run by hand:

    .venv/bin/python bench/sliding_sync.py [--rooms 1000] [--initial 50] [--wakes 50]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.client_api import GENEROUS, Api, pct, txn_totals  # noqa: E402
from tests.harness import TributaryProcess  # noqa: E402

SLIDING = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync"
REQUIRED_STATE = [
    ["m.room.encryption", ""], ["m.room.member", "$LAZY"], ["m.room.member", "$ME"], ["m.room.name", ""],
    ["m.room.avatar", ""], ["m.room.canonical_alias", ""], ["m.room.topic", ""], ["m.room.join_rules", ""],
    ["m.room.power_levels", ""], ["m.room.create", ""], ["m.room.history_visibility", ""],
]
TOP_20 = {"all": {"ranges": [[0, 19]], "timeline_limit": 1, "required_state": REQUIRED_STATE}}


async def sliding(api: Api, body: dict[str, Any], **query: Any) -> Any:
    suffix = "?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else ""
    headers = {"Authorization": f"Bearer {api.token}"}
    async with api.session.post(api.base_url + SLIDING + suffix, json=body, headers=headers) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"sliding sync -> {r.status} {data}")
        return data


def print_txns(what: str, before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
               n: int) -> None:
    """The server's database transactions between two /metrics readings, per operation."""
    rows = sorted(((name, (c - before.get(name, (0, 0))[0]) / n, (t - before.get(name, (0, 0))[1]) / n)
                   for name, (c, t) in after.items()), key=lambda item: -item[2])
    for name, count, seconds in rows:
        if count > 0:
            print(f"  {what}: {count:.2f} x {name}, {seconds * 1000:.2f} ms")


async def bench(base_url: str, args: argparse.Namespace, metrics_url: str | None = None) -> None:
    run = secrets.token_hex(3)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as session:
        anon = Api(session, base_url)
        user = await anon.register(f"many{run}")
        other = await anon.register(f"other{run}")
        started = time.perf_counter()
        rooms: list[str] = []

        async def make(i: int) -> None:
            # A creation_content of its own: rooms created in the same millisecond by the same user
            # otherwise have the same create event, so the same room ID (room version 12).
            room_id = (await user.call("POST", "/createRoom", {
                "preset": "public_chat", "name": f"room {i}", "creation_content": {"m.bench.room": i}}))["room_id"]
            await user.send(room_id, f"hello {i}")
            rooms.append(room_id)

        for start in range(0, args.rooms, 16):
            await asyncio.gather(*(make(i) for i in range(start, min(start + 16, args.rooms))))
        joined = len((await user.call("GET", "/joined_rooms"))["joined_rooms"])
        print(f"set-up: {len(rooms)} rooms ({joined} joined) with a message each in {time.perf_counter() - started:.0f} s")
        wake_room = rooms[0]
        await other.call("POST", f"/rooms/{wake_room}/join", {})

        for i in range(3):  # warm up
            await sliding(user, {"conn_id": f"warm{i}", "lists": TOP_20})
        firsts = []
        txn0 = txn_totals(metrics_url)
        for i in range(args.initial):
            start_at = time.perf_counter()
            answer = await sliding(user, {"conn_id": f"c{i}", "lists": TOP_20})
            firsts.append(time.perf_counter() - start_at)
        assert len(answer["rooms"]) == 20 and answer["lists"]["all"]["count"] == len(rooms), answer["lists"]
        print(f"first answer, top 20 of {len(rooms)} rooms, timeline_limit 1: "
              f"p50 {pct(firsts, 0.5) * 1000:.1f} ms, p99 {pct(firsts, 0.99) * 1000:.1f} ms")
        print_txns("per first answer", txn0, txn_totals(metrics_url), args.initial)

        pos = (await sliding(user, {"conn_id": "wake", "lists": TOP_20}))["pos"]
        wakes = []
        txn0 = txn_totals(metrics_url)
        for i in range(args.wakes):
            poll = asyncio.ensure_future(sliding(user, {"conn_id": "wake", "lists": TOP_20}, pos=pos, timeout=30000))
            await asyncio.sleep(0.01)  # let the long poll reach the server
            await other.send(wake_room, f"wake {i}")
            sent_at = time.perf_counter()
            result = await poll
            wakes.append(time.perf_counter() - sent_at)
            assert wake_room in result["rooms"], result
            pos = result["pos"]
        print(f"sliding sync wake after the send returns: p50 {pct(wakes, 0.5) * 1000:.1f} ms, "
              f"p99 {pct(wakes, 0.99) * 1000:.1f} ms")
        print_txns("per wake (the send's included)", txn0, txn_totals(metrics_url), args.wakes)

        since = (await user.call("GET", "/sync?filter=" + '{"room":{"timeline":{"limit":1}}}'))["next_batch"]
        sync_wakes = []
        for i in range(args.wakes):
            poll = asyncio.ensure_future(user.call("GET", f"/sync?since={since}&timeout=30000"))
            await asyncio.sleep(0.01)
            await other.send(wake_room, f"sync wake {i}")
            sent_at = time.perf_counter()
            result = await poll
            sync_wakes.append(time.perf_counter() - sent_at)
            since = result["next_batch"]
        print(f"/sync wake after the send returns (same user): p50 {pct(sync_wakes, 0.5) * 1000:.1f} ms, "
              f"p99 {pct(sync_wakes, 0.99) * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url")
    parser.add_argument("--database-url", help="a PostgreSQL database to start the server on (default: embedded)")
    parser.add_argument("--rooms", type=int, default=1000)
    parser.add_argument("--initial", type=int, default=50)
    parser.add_argument("--wakes", type=int, default=50)
    args = parser.parse_args()
    if args.base_url:
        asyncio.run(bench(args.base_url, args))
        return
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # the embedded PostgreSQL runs as another user when we are root
        limits = {"rc_message": GENEROUS, "rc_registration": GENEROUS,
                  "rc_joins": {"local": GENEROUS, "remote": GENEROUS}}  # fmt: skip
        hs = TributaryProcess.configure(Path(tmp), database_url=args.database_url, extra={**limits, "log_level": "WARNING"})
        hs.start(timeout=120)
        try:
            asyncio.run(bench(hs.base_url, args, f"http://127.0.0.1:{hs.metrics_port}/metrics"))
        finally:
            hs.stop()


if __name__ == "__main__":
    main()
