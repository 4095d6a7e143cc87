"""Joining a big room over federation: one Tributary (A) holds a room with N members'
state, a user of another Tributary (B) joins it; print how long the join took to return
and how long until B's first /sync holding the room.

Both servers are real ``tributary`` processes on fresh PostgreSQL databases, federating
over TLS on loopback. The room is made on A through its client API (createRoom), then
A is stopped and N signed member joins (``@mN:A``, each with a display name) are added to
its database in bulk, as a linear run of events with real state groups, so that
building a 50,000-member room takes seconds rather than 50,000 client joins. A is
started again; B joins through its client API (``POST /join/{roomId}?server_name=A``),
then syncs with lazy-loaded members (what clients use for big rooms; the full member
list is timed too). Run by hand:

    .venv/bin/python bench/big_room_join.py [--members 10000 50000]

It also prints the two servers' log lines about the join (the phases each took).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from storage.stores.dataset import create_database, drop_database  # noqa: E402
from bench.client_api import cpu_seconds  # noqa: E402
from bench.search_directory import call  # noqa: E402
from tests.big_room import add_members_to_process  # noqa: E402
from tests.harness import TributaryProcess  # noqa: E402

ADMIN_DSN = os.environ.get("TRIBUTARY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
GENEROUS = {"per_second": 100000, "burst_count": 100000}
LAZY_FILTER = '{"room":{"state":{"lazy_load_members":true},"timeline":{"limit":10}}}'


async def register(session: aiohttp.ClientSession, base: str, name: str) -> tuple[str, str]:
    data = await call(session, base, "POST", "/register",
                      {"username": name, "password": "pw", "auth": {"type": "m.login.dummy"}})
    return str(data["user_id"]), str(data["access_token"])


def _with_dbname(dsn: str, name: str) -> str:
    return dsn.rpartition("/")[0] + "/" + name


def build_room(process: TributaryProcess, dsn: str, room_id: str, members: int) -> float:
    """Append ``members`` signed joins to the room in A's database; the seconds it took."""
    started = time.perf_counter()
    add_members_to_process(process.config_path, dsn, room_id, members)
    return time.perf_counter() - started


def configure(tmp: Path, name: str, dsn: str) -> TributaryProcess:
    (tmp / name).mkdir()
    process = TributaryProcess.configure_federating(tmp / name, database_url=dsn, extra={
        "rc_message": GENEROUS, "rc_registration": GENEROUS, "log_level": "INFO",
        "rc_joins": {"local": GENEROUS, "remote": GENEROUS},
    })
    config = yaml.safe_load(process.config_path.read_text(encoding="utf-8"))
    config["database"] = {"url": dsn, "max_connections": 4}
    process.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return process


async def run_one(members: int, tmp: Path) -> dict[str, float]:
    suffix = f"{os.getpid()}_{members}"
    names = [f"bigjoin_a_{suffix}", f"bigjoin_b_{suffix}"]
    for name in names:
        create_database(ADMIN_DSN, name)
    dsn_a, dsn_b = (_with_dbname(ADMIN_DSN, n) for n in names)
    a, b = configure(tmp, f"a{members}", dsn_a), configure(tmp, f"b{members}", dsn_b)
    figures: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=1800)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            a.start()
            _, alice_token = await register(session, a.base_url, "alice")
            room = await call(session, a.base_url, "POST", "/createRoom", {"preset": "public_chat"}, alice_token)
            room_id = room["room_id"]
            assert a.stop() == 0
            figures["build_s"] = await asyncio.to_thread(build_room, a, dsn_a, room_id, members)
            a.start(timeout=120)
            b.start()
            _, bob_token = await register(session, b.base_url, "bob")
            assert a.process is not None and b.process is not None
            cpu_before = (cpu_seconds(a.process.pid), cpu_seconds(b.process.pid))
            started = time.perf_counter()
            await call(session, b.base_url, "POST",
                       f"/join/{quote(room_id, safe='')}?server_name={quote(a.server_name, safe='')}", {}, bob_token)
            figures["join_s"] = time.perf_counter() - started
            while True:
                data = await call(session, b.base_url, "GET", f"/sync?timeout=0&filter={quote(LAZY_FILTER)}",
                                  token=bob_token)
                if room_id in data.get("rooms", {}).get("join", {}):
                    break
                await asyncio.sleep(0.05)
            figures["first_sync_s"] = time.perf_counter() - started
            # Wall time on a shared machine depends on its load; the servers' own CPU time less so.
            figures["cpu_a_s"] = cpu_seconds(a.process.pid) - cpu_before[0]
            figures["cpu_b_s"] = cpu_seconds(b.process.pid) - cpu_before[1]
            sync_start = time.perf_counter()
            data = await call(session, b.base_url, "GET", "/sync?timeout=0", token=bob_token)
            figures["full_sync_s"] = time.perf_counter() - sync_start
            state = data["rooms"]["join"].get(room_id, {}).get("state", {}).get("events", [])
            figures["full_sync_state_events"] = float(len(state))
            count = await call(session, b.base_url, "GET", f"/rooms/{quote(room_id, safe='')}/joined_members",
                               token=bob_token)
            figures["joined_members_on_b"] = float(len(count.get("joined", {})))
        for process in (a, b):
            for line in process.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
                if any(m in line for m in ("joined via", "joined through us", "join state stored")):
                    print("   ", line[line.find("["):], flush=True)
    finally:
        for process in (b, a):
            if process.process is not None and process.process.poll() is None:
                process.stop()
        for name in names:
            drop_database(ADMIN_DSN, name)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[10_000, 50_000])
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bigjoin-") as tmp:
        for members in args.members:
            figures = asyncio.run(run_one(members, Path(tmp)))
            print(f"members={members} " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()), flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
