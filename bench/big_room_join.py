"""Joining a big room over federation: one Tributary (A) holds a room with N members'
state, a user of another Tributary (B) joins it, and, with ``--synapse``, a user of a
Synapse joins the same room in the same run. For each joining server it prints how
long the client's ``POST /join`` took to answer, how long until its first ``/sync``
holding the room, and how long until it holds the room's FULL membership.

All servers are real processes federating over TLS on loopback, as ``make interop``
does (tests/interop/synapse.py). The two Tributaries use fresh PostgreSQL databases;
Synapse uses SQLite (its virtualenv has no PostgreSQL driver). The room is made on A
through its client API (createRoom), then A is stopped and N signed member joins
(``@mN:A``, each with a display name) are added to its database in bulk, as a linear
run of events with real state groups, so that building a 50,000-member room takes
seconds rather than 50,000 client joins. A is started again; B, then Synapse, join
through their client APIs (``POST /join/{roomId}?server_name=A``).

The three figures, each counted from the ``POST /join``:

- ``join``: until the ``POST /join`` answers.
- ``first /sync``: until a ``/sync`` with ``lazy_load_members: true`` (what clients use
  for big rooms) holds the room under ``rooms.join``. Both servers are asked with that
  filter: Synapse joins with partial state (MSC3706: the resident omits the member
  events) and leaves a partial-state room out of a ``/sync`` that does not lazy-load
  members until it has the full state.
- ``full membership``: until ``GET /rooms/{id}/joined_members`` on the joining server
  lists every member A lists (N + the room's creator + the joiners so far). Polled
  until ``--synapse-timeout`` (Synapse answers that request only once its background
  state resync is done; a Tributary that joins with full state answers it at once),
  and reported as "not within Ns" if it never does.

Before each join the bench waits until the joining server and A are idle (and, for a
fresh Synapse, until its start-up background updates of its database are done). CPU
seconds are read from /proc/PID/stat for the joining process and the resident A, up to
full membership; for a Tributary, the CPU of its PostgreSQL backends is added (Synapse's
SQLite runs inside its process). The bench then also waits until the joining process is
idle again (under 0.1 s of CPU in 2 s: Synapse's user directory, room statistics and
presence handlers work through the new memberships for minutes after the resync) and
reports the CPU used by then. On a shared machine CPU seconds vary less than wall times.
Tributary's figures are also given over Synapse's (below 1: Tributary took less). Run
by hand:

    .venv/bin/python -u bench/big_room_join.py [--members 10000 50000] [--synapse [--synapse-timeout 900]] [--keep]

(``--synapse`` needs Synapse in ``.venv-synapse``, as ``make interop`` installs it.) It
also prints the servers' log lines about the join (the phases each took).
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
import attrs
import psycopg2
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.dataset import create_database, drop_database  # noqa: E402
from bench.client_api import cpu_seconds  # noqa: E402
from bench.search_directory import call  # noqa: E402
from tests.big_room import add_members_to_process  # noqa: E402
from tests.harness import TributaryProcess  # noqa: E402
from tests.interop.synapse import SynapseProcess  # noqa: E402

ADMIN_DSN = os.environ.get("TRIBUTARY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
GENEROUS = {"per_second": 100000, "burst_count": 100000}
LAZY_FILTER = '{"room":{"state":{"lazy_load_members":true},"timeline":{"limit":10}}}'
PREFIX = "/_matrix/client/v3"
SYNAPSE_PYTHON = Path(__file__).resolve().parent.parent / ".venv-synapse" / "bin" / "python"
# On top of tests/interop/synapse.py's loopback options (which already lift rc_joins,
# rc_joins_per_room, rc_message and the like): Synapse's limiter of inbound federation
# requests (by default it delays a server's requests past 10 a second and refuses past 50)
# must not slow A's transactions to it.
SYNAPSE_OPTIONS: dict[str, Any] = {
    "rc_federation": {"window_size": 1000, "sleep_limit": 100000, "sleep_delay": 500,
                      "reject_limit": 100000, "concurrent": 1000},
}
# A joining server is idle again when it used less than IDLE_CPU_S of CPU in SETTLE_S.
SETTLE_S, IDLE_CPU_S = 2.0, 0.1
# Lines of each server's log about the join and the phases it took.
TRIBUTARY_MARKERS = ("joined via", "joined through us", "join state stored", "partial state", "partial-state")
SYNAPSE_MARKERS = ("Syncing state for room", "Updating current state for", "State resync complete",
                   "Clearing partial-state flag")


@attrs.frozen
class Joiner:
    """A joining server as the bench sees it: its user's client API and its process."""

    label: str
    base_url: str
    token: str
    pid: int
    # The PostgreSQL database whose backends' CPU counts too (None: the server's database
    # is in-process, as Synapse's SQLite).
    database: str | None


@attrs.define
class JoinFigures:
    """Seconds from the ``POST /join``, and CPU seconds spent meanwhile."""

    label: str
    expected_members: int
    join_s: float = float("nan")
    first_sync_s: float | None = None
    full_members_s: float | None = None
    members_seen: int = 0
    waited_s: float = 0.0
    cpu_at_join_s: float = float("nan")
    cpu_s: float = float("nan")
    cpu_db_s: float | None = None
    cpu_resident_s: float = float("nan")
    # After full membership: until the joining process's CPU stops rising (background work
    # such as a user directory or device lists catching up), and the CPU it used by then.
    settled_s: float | None = None
    cpu_settled_s: float = float("nan")
    cpu_db_settled_s: float | None = None
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def describe(self) -> str:
        first = f"{self.first_sync_s:.2f} s" if self.first_sync_s is not None else f"not within {self.waited_s:.0f} s"
        full = (f"{self.full_members_s:.2f} s" if self.full_members_s is not None
                else f"not within {self.waited_s:.0f} s (reached {self.members_seen:,})")
        used = f"{self.cpu_settled_s:.1f} s" + (f" + {self.cpu_db_settled_s:.1f} s" if self.cpu_db_settled_s else "")
        settled = (f"joining server idle again after {self.settled_s:.1f} s, having used {used} CPU"
                   if self.settled_s is not None else f"joining server not idle by the deadline, {used} CPU by then")
        db = (f" + its PostgreSQL backends {self.cpu_db_s:.1f} s" if self.cpu_db_s is not None
              else " (SQLite in-process)")
        return (f"{self.label}: join {self.join_s:.2f} s, first /sync (lazy members) {first}, "
                f"full membership ({self.expected_members:,} joined) {full}; CPU of the joining server "
                f"{self.cpu_at_join_s:.1f} s by the join answer, {self.cpu_s:.1f} s in all{db}; "
                f"CPU of resident A {self.cpu_resident_s:.1f} s; {settled}; load {self.load[0]:.1f}")


async def request(session: aiohttp.ClientSession, base: str, method: str, path: str, body: Any = None,
                  token: str | None = None, timeout: float | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    client_timeout = aiohttp.ClientTimeout(total=timeout) if timeout is not None else None
    async with session.request(method, base + PREFIX + path, json=body, headers=headers,
                               timeout=client_timeout) as r:
        return r.status, await r.json(content_type=None)


async def register(session: aiohttp.ClientSession, base: str, name: str) -> tuple[str, str]:
    """Register through user-interactive auth: complete ``m.login.dummy`` (in the session the
    server hands out first, if it asks for one: Synapse does)."""
    body: dict[str, Any] = {"username": name, "password": "pw", "auth": {"type": "m.login.dummy"}}
    status, data = await request(session, base, "POST", "/register", body)
    if status == 401 and "session" in data:
        body["auth"]["session"] = data["session"]
        status, data = await request(session, base, "POST", "/register", body)
    if status != 200:
        raise RuntimeError(f"register {name} at {base} -> {status} {data}")
    return str(data["user_id"]), str(data["access_token"])


def _with_dbname(dsn: str, name: str) -> str:
    return dsn.rpartition("/")[0] + "/" + name


def backend_cpu(database: str | None) -> dict[int, float]:
    """CPU seconds so far of each PostgreSQL backend connected to ``database``, by PID."""
    if database is None:
        return {}
    with psycopg2.connect(ADMIN_DSN) as conn, conn.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (database,))
        pids = [int(row[0]) for row in cur.fetchall()]
    found = {}
    for pid in pids:
        try:
            found[pid] = cpu_seconds(pid)
        except OSError:  # the backend ended meanwhile
            pass
    return found


def backend_cpu_since(database: str | None, before: dict[int, float]) -> float | None:
    """CPU the database's backends used since ``before`` (a backend that ended meanwhile is
    not counted; one that started is counted whole)."""
    if database is None:
        return None
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in backend_cpu(database).items())


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


async def joined_count(session: aiohttp.ClientSession, base: str, room_id: str, token: str,
                       timeout: float | None = None) -> int | None:
    """How many members ``GET /joined_members`` lists (None when it is not a 200)."""
    status, data = await request(session, base, "GET", f"/rooms/{quote(room_id, safe='')}/joined_members",
                                 token=token, timeout=timeout)
    return len(data.get("joined", {})) if status == 200 else None


async def wait_until_idle(pids: list[int], timeout: float = 300.0) -> float:
    """Wait until none of ``pids`` used IDLE_CPU_S of CPU in SETTLE_S; the seconds waited."""
    started = time.perf_counter()
    last = [cpu_seconds(pid) for pid in pids]
    while time.perf_counter() - started < timeout:
        await asyncio.sleep(SETTLE_S)
        now = [cpu_seconds(pid) for pid in pids]
        if all(b - a < IDLE_CPU_S for a, b in zip(last, now)):
            break
        last = now
    return time.perf_counter() - started


async def synapse_ready(synapse: SynapseProcess, timeout: float = 600.0) -> float:
    """Wait until a fresh Synapse has run its database's background updates (about a minute of
    index building after its first start, which would otherwise overlap the join); the seconds
    waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if synapse.background_updates_done():
            break
        await asyncio.sleep(1.0)
    return time.perf_counter() - started


async def measure_join(session: aiohttp.ClientSession, joiner: Joiner, room_id: str, resident: TributaryProcess,
                       alice_token: str, timeout: float) -> JoinFigures:
    """Join ``room_id`` through A as ``joiner``'s user; time the answer, the first lazy
    ``/sync`` holding the room and the full membership (A's count, the joiner included)."""
    assert resident.process is not None
    await wait_until_idle([joiner.pid, resident.process.pid])
    before = await joined_count(session, resident.base_url, room_id, alice_token)
    assert before is not None
    figures = JoinFigures(joiner.label, before + 1, load=os.getloadavg())
    cpu0, resident0, db0 = cpu_seconds(joiner.pid), cpu_seconds(resident.process.pid), backend_cpu(joiner.database)
    started = time.perf_counter()
    deadline = started + timeout
    status, data = await request(
        session, joiner.base_url, "POST",
        f"/join/{quote(room_id, safe='')}?server_name={quote(resident.server_name, safe='')}", {},
        joiner.token, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"{joiner.label}: POST /join -> {status} {data}")
    figures.join_s = time.perf_counter() - started
    figures.cpu_at_join_s = cpu_seconds(joiner.pid) - cpu0
    while time.perf_counter() < deadline:
        status, data = await request(session, joiner.base_url, "GET", f"/sync?timeout=0&filter={quote(LAZY_FILTER)}",
                                     token=joiner.token, timeout=max(1.0, deadline - time.perf_counter()))
        if status == 200 and room_id in data.get("rooms", {}).get("join", {}):
            figures.first_sync_s = time.perf_counter() - started
            break
        await asyncio.sleep(0.05)
    # A server joined with partial state may answer with the members it knows so far, or hold
    # the request until its resync is done (Synapse): poll, backing off so that listing tens of
    # thousands of members does not itself load the server much.
    pause = 0.1
    while (left := deadline - time.perf_counter()) > 0:
        try:
            seen = await joined_count(session, joiner.base_url, room_id, joiner.token, timeout=left)
        except asyncio.TimeoutError:
            break
        figures.members_seen = max(figures.members_seen, seen or 0)
        if seen is not None and seen >= figures.expected_members:
            figures.full_members_s = time.perf_counter() - started
            break
        await asyncio.sleep(min(pause, max(0.0, deadline - time.perf_counter())))
        pause = min(2.0, pause * 2)
    figures.waited_s = time.perf_counter() - started
    figures.cpu_s = cpu_seconds(joiner.pid) - cpu0
    figures.cpu_db_s = backend_cpu_since(joiner.database, db0)
    figures.cpu_resident_s = cpu_seconds(resident.process.pid) - resident0
    last = cpu_seconds(joiner.pid)
    while time.perf_counter() < deadline + SETTLE_S:
        await asyncio.sleep(SETTLE_S)
        now = cpu_seconds(joiner.pid)
        if now - last < IDLE_CPU_S:
            figures.settled_s = time.perf_counter() - started - SETTLE_S
            break
        last = now
    figures.cpu_settled_s = cpu_seconds(joiner.pid) - cpu0
    figures.cpu_db_settled_s = backend_cpu_since(joiner.database, db0)
    return figures


def ratios(ours: JoinFigures, theirs: JoinFigures) -> str:
    """Tributary's figures over Synapse's (below 1: Tributary took less)."""
    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a is not None and b else "n/a"

    ours_cpu = ours.cpu_s + (ours.cpu_db_s or 0.0)
    settled = "" if theirs.settled_s is not None and ours.settled_s is not None else " (not idle by the deadline)"
    return (f"tributary / synapse: join {ratio(ours.join_s, theirs.join_s)}, "
            f"first /sync {ratio(ours.first_sync_s, theirs.first_sync_s)}, "
            f"full membership {ratio(ours.full_members_s, theirs.full_members_s)}"
            f"{'' if theirs.full_members_s is not None else ' (synapse never got there)'}, "
            f"CPU of the joining server (Tributary with its PostgreSQL backends) "
            f"{ratio(ours_cpu, theirs.cpu_s)} to full membership, "
            f"{ratio(ours.cpu_settled_s + (ours.cpu_db_settled_s or 0.0), theirs.cpu_settled_s)} until idle{settled}")


def print_log_lines(path: Path, markers: tuple[str, ...]) -> None:
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if any(m in line for m in markers):
            print("   ", line[line.find("["):] if "[" in line else line, flush=True)


async def run_one(members: int, tmp: Path, with_synapse: bool, timeout: float) -> dict[str, float]:
    suffix = f"{os.getpid()}_{members}"
    names = [f"bigjoin_a_{suffix}", f"bigjoin_b_{suffix}"]
    for name in names:
        create_database(ADMIN_DSN, name)
    dsn_a, dsn_b = (_with_dbname(ADMIN_DSN, n) for n in names)
    a, b = configure(tmp, f"a{members}", dsn_a), configure(tmp, f"b{members}", dsn_b)
    synapse: SynapseProcess | None = None
    summary: dict[str, float] = {}
    try:
        if with_synapse:
            synapse = SynapseProcess.configure(SYNAPSE_PYTHON, tmp / f"synapse{members}", extra=SYNAPSE_OPTIONS)
            synapse.start()
            print(f"  synapse {synapse.version()} (SQLite) at {synapse.server_name}", flush=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            a.start()
            _, alice_token = await register(session, a.base_url, "alice")
            room = await call(session, a.base_url, "POST", "/createRoom", {"preset": "public_chat"}, alice_token)
            room_id = room["room_id"]
            assert a.stop() == 0
            summary["build_s"] = await asyncio.to_thread(build_room, a, dsn_a, room_id, members)
            a.start(timeout=120)
            b.start()
            _, bob_token = await register(session, b.base_url, "bob")
            assert b.process is not None
            ours = await measure_join(session, Joiner("tributary B", b.base_url, bob_token, b.process.pid, names[1]),
                                      room_id, a, alice_token, timeout=timeout)
            print("  " + ours.describe(), flush=True)
            summary.update(join_s=ours.join_s, first_sync_s=ours.first_sync_s or float("nan"),
                           full_members_s=ours.full_members_s or float("nan"), cpu_b_s=ours.cpu_s,
                           cpu_b_db_s=ours.cpu_db_s or 0.0, cpu_b_settled_s=ours.cpu_settled_s,
                           cpu_b_db_settled_s=ours.cpu_db_settled_s or 0.0, cpu_a_s=ours.cpu_resident_s)
            sync_start = time.perf_counter()
            data = await call(session, b.base_url, "GET", "/sync?timeout=0", token=bob_token)
            summary["full_sync_s"] = time.perf_counter() - sync_start
            state = data["rooms"]["join"].get(room_id, {}).get("state", {}).get("events", [])
            summary["full_sync_state_events"] = float(len(state))
            if synapse is not None:
                assert synapse.process is not None
                _, sam_token = await register(session, synapse.base_url, "sam")
                waited = await synapse_ready(synapse)
                print(f"  waited {waited:.0f} s for Synapse's start-up background updates", flush=True)
                theirs = await measure_join(session, Joiner("synapse", synapse.base_url, sam_token,
                                                            synapse.process.pid, None),
                                            room_id, a, alice_token, timeout=timeout)
                print("  " + theirs.describe(), flush=True)
                print("  " + ratios(ours, theirs), flush=True)
                summary.update(synapse_join_s=theirs.join_s, synapse_first_sync_s=theirs.first_sync_s or float("nan"),
                               synapse_full_members_s=theirs.full_members_s or float("nan"),
                               synapse_cpu_s=theirs.cpu_s, synapse_cpu_settled_s=theirs.cpu_settled_s,
                               cpu_a_for_synapse_s=theirs.cpu_resident_s)
        for process in (a, b):
            print_log_lines(process.log_path, TRIBUTARY_MARKERS)
        if synapse is not None:
            print_log_lines(synapse.log_path, SYNAPSE_MARKERS)
    finally:
        if synapse is not None:
            synapse.stop()
        for process in (b, a):
            if process.process is not None and process.process.poll() is None:
                process.stop()
        for name in names:
            drop_database(ADMIN_DSN, name)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[10_000, 50_000])
    parser.add_argument("--synapse", action="store_true", help="a Synapse user joins the room too (.venv-synapse)")
    parser.add_argument("--synapse-timeout", type=float, default=900.0,
                        help="seconds each joining server (Synapse, and Tributary B) is given to reach full "
                             "membership (default 900)")
    parser.add_argument("--keep", action="store_true", help="keep the servers' configs and logs")
    args = parser.parse_args()
    if args.synapse and not SYNAPSE_PYTHON.exists():
        raise SystemExit(f"{SYNAPSE_PYTHON} is missing: `make interop` installs Synapse there")
    print(f"load average before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bigjoin-") as scratch:
        tmp = Path(tempfile.mkdtemp(prefix="bigjoin-")) if args.keep else Path(scratch)
        for members in args.members:
            summary = asyncio.run(run_one(members, tmp, args.synapse, args.synapse_timeout))
            print(f"members={members} " + " ".join(f"{k}={v:.2f}" for k, v in summary.items()), flush=True)
            print(f"load average: {os.getloadavg()}", flush=True)
        if args.keep:
            print(f"configs and logs kept in {tmp}", flush=True)


if __name__ == "__main__":
    main()
