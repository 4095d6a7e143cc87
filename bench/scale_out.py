"""Scale-out figures: the same send load with 1 and with 2 event persisters.

For each layout it starts real processes on a scratch PostgreSQL database and
Redis (main + N event persisters + a generic worker + a federation sender,
so the main process has no part in sending), registers users, creates rooms through the generic worker, then sends
``--messages`` messages from ``--senders`` concurrent senders (one room each)
through the generic worker, and prints: messages persisted per second, send
latency p50/p99, the CPU seconds each process used during the load (the main
process's is the point: no message passes through it), and /sync wake latency
through the generic worker (send returns -> another user's waiting long-poll
returns), p50/p99. Run by hand:

    .venv/bin/python bench/scale_out.py [--messages 2000] [--senders 8] [--wakes 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.client_api import Api, cpu_seconds, pct  # noqa: E402
from tests.conftest import PG_ADMIN_DSN, REDIS_URL, scratch_database  # noqa: E402
from tests.harness import TributaryProcess, configure_workers  # noqa: E402

GENEROUS = {"per_second": 100000, "burst_count": 100000}
LIMITS = {"rc_message": GENEROUS, "rc_registration": GENEROUS, "rc_joins": {"local": GENEROUS, "remote": GENEROUS}}


async def run_layout(persisters: int, args: argparse.Namespace) -> dict[str, Any]:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
    with tempfile.TemporaryDirectory() as tmp, scratch_database(None) as dsn:
        main, workers, generic_port = configure_workers(Path(tmp), dsn, REDIS_URL, persisters=persisters,
                                                        senders=1, extra=LIMITS)
        processes: list[TributaryProcess] = [main, *workers.values()]
        try:
            for process in processes:
                process.start(timeout=60)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
                on_main = Api(session, main.base_url)
                generic_url = f"http://127.0.0.1:{generic_port}"
                users = []
                for i in range(args.senders + 1):
                    registered = await on_main.register(f"u{i}_{secrets.token_hex(3)}")
                    users.append(Api(session, generic_url, registered.token))
                listener = users[-1]
                rooms = []
                for user in users[:-1]:
                    room = (await user.call("POST", "/createRoom", {"preset": "public_chat"}))["room_id"]
                    await listener.call("POST", f"/join/{quote(room, safe='')}", {})
                    rooms.append(quote(room, safe=""))
                for user, room in zip(users, rooms):  # warm up every path once
                    await user.send(room, "warm-up")

                pids = {p.worker_name or "main": p.process.pid for p in processes if p.process is not None}
                cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                per_sender = args.messages // args.senders
                latencies: list[float] = []

                async def sender(user: Api, room: str) -> None:
                    for i in range(per_sender):
                        latencies.append(await user.send(room, f"m{i}"))

                start = time.perf_counter()
                await asyncio.gather(*(sender(u, r) for u, r in zip(users, rooms)))
                elapsed = time.perf_counter() - start
                cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}

                # Sync wake latency through the generic worker.
                flt = quote(json.dumps({"room": {"timeline": {"limit": 1}}, "presence": {"types": []}}))
                since = (await listener.call("GET", f"/sync?timeout=0&filter={flt}"))["next_batch"]
                wakes: list[float] = []

                def poll_from(token: str) -> asyncio.Future[Any]:
                    return asyncio.ensure_future(listener.call("GET", f"/sync?timeout=10000&since={token}&filter={flt}"))

                def event_ids(answer: Any) -> set[str]:
                    return {e["event_id"] for room in answer.get("rooms", {}).get("join", {}).values()
                            for e in room["timeline"]["events"]}

                while len(wakes) < args.wakes:
                    poll = poll_from(since)
                    await asyncio.sleep(0.01)
                    if poll.done():  # something older was still arriving: not a measurement
                        since = (await poll)["next_batch"]
                        continue
                    sent_id = (await users[0].call(
                        "PUT", f"/rooms/{rooms[0]}/send/m.room.message/{secrets.token_hex(8)}",
                        {"msgtype": "m.text", "body": "wake"}))["event_id"]
                    sent = time.perf_counter()
                    while True:
                        answer = await poll
                        since = answer["next_batch"]
                        if sent_id in event_ids(answer):
                            break
                        poll = poll_from(since)
                    wakes.append(time.perf_counter() - sent)
            return {
                "persisters": persisters, "sent": per_sender * args.senders, "seconds": elapsed,
                "per_second": per_sender * args.senders / elapsed,
                "p50_ms": pct(latencies, 0.5) * 1000, "p99_ms": pct(latencies, 0.99) * 1000,
                "cpu": cpu, "wake_p50_ms": pct(wakes, 0.5) * 1000, "wake_p99_ms": pct(wakes, 0.99) * 1000,
            }
        finally:
            for process in reversed(processes):
                if process.process is not None:
                    process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--senders", type=int, default=8)
    parser.add_argument("--wakes", type=int, default=100)
    parser.add_argument("--layouts", default="1,2", help="event persister counts to run, e.g. 1,2")
    args = parser.parse_args()
    print(f"cores available: {os.cpu_count()} (PostgreSQL and Redis on the same machine); "
          f"database {PG_ADMIN_DSN.rsplit('@', 1)[-1]}, redis {REDIS_URL}")
    for persisters in (int(n) for n in args.layouts.split(",")):
        result = asyncio.run(run_layout(persisters, args))
        cpu = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in result["cpu"].items())
        print(f"{persisters} event persister(s): {result['sent']} messages from {args.senders} senders in "
              f"{result['seconds']:.2f}s = {result['per_second']:.0f} persisted/s; send p50 {result['p50_ms']:.1f} ms "
              f"p99 {result['p99_ms']:.1f} ms; CPU during the load: {cpu}; sync wake through the generic worker "
              f"p50 {result['wake_p50_ms']:.1f} ms p99 {result['wake_p99_ms']:.1f} ms")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
