"""Client-server API figures: sequential and concurrent sends, /sync wake latency, a message's
fan-out to members online, initial sync of a user in many rooms, server CPU per message and RSS.

Against a running server (``--base-url``, which must have generous ``rc_message``,
``rc_joins`` and ``rc_registration`` limits), or, by default, against a fresh
``tributary`` process it starts on the embedded PostgreSQL. With ``--synapse``, the same figures
for a Synapse in the same run (``make interop`` installs it, with psycopg2, into .venv-synapse), on a fresh
database of the PostgreSQL on 127.0.0.1:5432 (as Synapse is deployed; its SQLite is slower), with
its rate limits lifted, then the ratios. Run by hand:

    .venv/bin/python bench/client_api.py [--sends 500] [--rooms 50] [--events 100] [--py-spy FILE]
                                         [--online 20 [--online-messages 20]] [--elsewhere 100]
                                         [--synapse [--synapse-sends 300] [--rounds 10]]

With ``--synapse`` both servers then stay up for a last figure: sequential sends to each in
turn, in ``--rounds`` alternating blocks (``interleaved``), the ratio least moved by the
machine's speed, which drifts over the minutes between the two servers' own runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.profiling import start_py_spy, stop_py_spy  # noqa: E402
from tests.harness import TributaryProcess  # noqa: E402

GENEROUS = {"per_second": 100000, "burst_count": 100000}
PREFIX = "/_matrix/client/v3"


class Api:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | None = None) -> None:
        self.session, self.base_url, self.token = session, base_url, token

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        async with self.session.request(method, self.base_url + PREFIX + path, json=body, headers=headers) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{method} {path} -> {r.status} {data}")
            return data

    async def register(self, name: str) -> Api:
        data = await self.call("POST", "/register", {"username": name, "password": "pw", "auth": {"type": "m.login.dummy"}})
        return Api(self.session, self.base_url, data["access_token"])

    async def send(self, room_id: str, body: str) -> float:
        start = time.perf_counter()
        await self.call("PUT", f"/rooms/{room_id}/send/m.room.message/{secrets.token_hex(8)}", {"msgtype": "m.text", "body": body})
        return time.perf_counter() - start


class LeanSender:
    """``PUT /send`` over one kept-alive HTTP/1.1 connection of its own, written and read by hand.

    The sends are still whole HTTP requests, answered by the server's whole client API path;
    only the client is cheaper than aiohttp (about 0.1 ms of CPU a request where aiohttp takes
    0.5), which matters because the bench shares the server's cores. ``--aiohttp`` times the
    sends with aiohttp instead.
    """

    def __init__(self, base_url: str, token: str) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.host, self.port, self.token = url.hostname or "127.0.0.1", url.port or 80, token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, room_id: str, body: str) -> float:
        start = time.perf_counter()
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        payload = json.dumps({"msgtype": "m.text", "body": body}).encode()
        path = f"{PREFIX}/rooms/{urllib.parse.quote(room_id)}/send/m.room.message/{secrets.token_hex(8)}"
        self.writer.write(
            f"PUT {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        length, chunked = None, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                chunked = value.strip().lower() == b"chunked"
        if chunked:  # Synapse's answers
            data = b""
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                data += (await self.reader.readexactly(size + 2))[:-2]
            await self.reader.readuntil(b"\r\n")
        elif length is not None:
            data = await self.reader.readexactly(length)
        else:
            raise RuntimeError(f"no Content-Length in the answer: {head!r}")
        if status != b"200" or b'"event_id"' not in data:
            raise RuntimeError(f"PUT {path} -> {status!r} {data!r}")
        return time.perf_counter() - start

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int | None) -> float:
    """CPU seconds of process ``pid`` (the embedded PostgreSQL's postmaster) and its descendants
    (its backends); processes that ended in between are not counted."""
    if pid is None:
        return float("nan")
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        child = todo.pop()
        try:
            total += cpu_seconds(child)
        except OSError:
            continue
        todo.extend(children.get(child, []))
    return total


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def txn_totals(metrics_url: str | None) -> dict[str, tuple[float, float]]:
    """Per database transaction name: (count, total seconds), from the server's /metrics."""
    if metrics_url is None:
        return {}
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for suffix, index in (("_count{", 0), ("_sum{", 1)):
            prefix = "tributary_storage_txn_duration_seconds" + suffix
            if line.startswith(prefix):
                name = line.split('txn="', 1)[1].split('"', 1)[0]
                out.setdefault(name, [0.0, 0.0])[index] = float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


@attrs.frozen
class Figures:
    sequential: float  # sends/s, one sender
    concurrent: float  # sends/s, 8 senders in 8 rooms
    sequential_cpu: float  # seconds of the server's CPU a sequential send


async def bench(base_url: str, pid: int | None, args: argparse.Namespace, metrics_url: str | None = None,
                db_pid: int | None = None, sends: int | None = None) -> Figures:
    """Every figure of the module docstring for the server at ``base_url``; ``sends``: how many
    sequential sends (``--sends`` by default)."""
    sends = args.sends if sends is None else sends
    run = secrets.token_hex(3)
    print(f"RSS after start: {rss_mib(pid):.1f} MiB")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        anon = Api(session, base_url)
        alice = await anon.register(f"alice{run}")
        bob = await anon.register(f"bob{run}")
        print(f"RSS before (two users registered): {rss_mib(pid):.1f} MiB")
        room = (await alice.call("POST", "/createRoom", {"preset": "public_chat"}))["room_id"]
        await bob.call("POST", f"/rooms/{room}/join", {})

        for i in range(50):  # warm up (every pool connection prepares the send's statements)
            await alice.send(room, f"warm {i}")
        txn0 = txn_totals(metrics_url)
        profiler = start_py_spy(pid, args.py_spy)
        sender: Api | LeanSender = alice if args.aiohttp else LeanSender(base_url, alice.token or "")
        cpu0, db0, own0, start = cpu_seconds(pid), tree_cpu_seconds(db_pid), time.process_time(), time.perf_counter()
        latencies = [await sender.send(room, f"seq {i}") for i in range(sends)]
        elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu0
        db_cpu, own_cpu = tree_cpu_seconds(db_pid) - db0, time.process_time() - own0
        seq_elapsed, seq_cpu = elapsed, cpu
        stop_py_spy(profiler, args.py_spy)
        print(f"sequential sends: {sends / elapsed:.0f}/s, p50 {pct(latencies, 0.5) * 1000:.1f} ms, "
              f"p99 {pct(latencies, 0.99) * 1000:.1f} ms, server CPU {cpu / sends * 1000:.2f} ms/message")
        print(f"  CPU per send: server {cpu / sends * 1000:.2f} ms, its PostgreSQL "
              f"{db_cpu / sends * 1000:.2f} ms, this client {own_cpu / sends * 1000:.2f} ms; "
              f"wall {elapsed / sends * 1000:.2f} ms")
        txn1 = txn_totals(metrics_url)
        per_send = sorted(
            ((name, (c - txn0.get(name, (0, 0))[0]) / sends, (t - txn0.get(name, (0, 0))[1]) / sends * 1000)
             for name, (c, t) in txn1.items()),
            key=lambda item: -item[2],
        )
        for name, count, ms in per_send:
            if count > 0:
                print(f"  per send: {count:.2f} x {name}, {ms:.2f} ms")

        if isinstance(sender, LeanSender):
            sender.close()

        accounts = [await anon.register(f"s{i}x{run}") for i in range(8)]
        rooms = [(await s.call("POST", "/createRoom", {}))["room_id"] for s in accounts]
        senders = [s if args.aiohttp else LeanSender(base_url, s.token or "") for s in accounts]
        per = max(1, sends // 8)

        async def loop(api: Api | LeanSender, room_id: str) -> list[float]:
            return [await api.send(room_id, f"c {i}") for i in range(per)]

        cpu0, db0, own0, start = cpu_seconds(pid), tree_cpu_seconds(db_pid), time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(loop(s, r) for s, r in zip(senders, rooms)))
        elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu0
        db_cpu, own_cpu = tree_cpu_seconds(db_pid) - db0, time.process_time() - own0
        for s in senders:
            if isinstance(s, LeanSender):
                s.close()
        flat = [x for xs in results for x in xs]
        print(f"8 concurrent senders in 8 rooms: {len(flat) / elapsed:.0f}/s, p50 {pct(flat, 0.5) * 1000:.1f} ms, "
              f"p99 {pct(flat, 0.99) * 1000:.1f} ms")
        print(f"  CPU per send: server {cpu / len(flat) * 1000:.2f} ms, its PostgreSQL "
              f"{db_cpu / len(flat) * 1000:.2f} ms, this client {own_cpu / len(flat) * 1000:.2f} ms")

        since = (await bob.call("GET", "/sync"))["next_batch"]
        wakes = []
        for i in range(args.wakes):
            poll = asyncio.ensure_future(bob.call("GET", f"/sync?since={since}&timeout=30000"))
            await asyncio.sleep(0.01)  # let the long-poll reach the server
            await alice.send(room, f"wake {i}")
            sent_at = time.perf_counter()
            result = await poll
            wakes.append(time.perf_counter() - sent_at)
            since = result["next_batch"]
        print(f"sync wake after the send returns: p50 {pct(wakes, 0.5) * 1000:.1f} ms, p99 {pct(wakes, 0.99) * 1000:.1f} ms")
        if args.online > 0 and args.online_messages > 0:
            await fan_out_to_online_members(anon, alice, room, pid, db_pid, args.online, args.online_messages, run)
        if args.elsewhere > 0 and args.online_messages > 0:
            await online_elsewhere(anon, alice, pid, db_pid, args.elsewhere, args.online_messages, run)

        carol = await anon.register(f"carol{run}")
        for r in range(args.rooms):
            room_id = (await carol.call("POST", "/createRoom", {}))["room_id"]
            await asyncio.gather(*(carol.send(room_id, f"r{r} e{e}") for e in range(args.events)))
        start = time.perf_counter()
        initial = await carol.call("GET", "/sync")
        print(f"initial sync, {len(initial['rooms']['join'])} rooms x {args.events} events: "
              f"{(time.perf_counter() - start) * 1000:.0f} ms")
        print(f"RSS after: {rss_mib(pid):.1f} MiB")
        return Figures(sends / seq_elapsed, len(flat) / elapsed, seq_cpu / sends)


async def online_elsewhere(anon: Api, sender: Api, pid: int | None, db_pid: int | None, online: int,
                           messages: int, run: str) -> None:
    """``online`` users long-poll ``/sync`` in a room of their own while ``sender`` sends
    ``messages`` messages, one at a time, to a room none of them is in: the server's and its
    PostgreSQL's CPU per message (the send, and whatever the waiting syncs cost). On a busy
    server most messages are in rooms a given user is not in."""
    # A session of their own: the bench's pools fewer connections than there are long-polls.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=online + 8)) as session:
        anon = Api(session, anon.base_url)
        members = [await anon.register(f"e{i}x{run}") for i in range(online)]
        theirs = (await members[0].call("POST", "/createRoom", {"preset": "public_chat"}))["room_id"]
        for member in members[1:]:
            await member.call("POST", f"/rooms/{theirs}/join", {})
        elsewhere = (await sender.call("POST", "/createRoom", {}))["room_id"]

        async def wait(member: Api) -> None:
            since = (await member.call("GET", "/sync?timeout=0"))["next_batch"]
            while True:
                since = (await member.call("GET", f"/sync?since={since}&timeout=30000"))["next_batch"]

        polls = [asyncio.ensure_future(wait(member)) for member in members]
        # Every long-poll reaches the server and waits, once the members' presence (each came
        # online, which the others in their room hear of) has been answered: the server idle.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            before = cpu_seconds(pid)
            await asyncio.sleep(0.5)
            if cpu_seconds(pid) - before < 0.025:
                break
        async def measured(what: str, step: Callable[[int], Awaitable[None]]) -> None:
            """``step(i)`` for each of ``messages``, 20 ms apart: the server's and its PostgreSQL's
            CPU per step, printed after ``what``."""
            cpu0, db0, start = cpu_seconds(pid), tree_cpu_seconds(db_pid), time.perf_counter()
            for i in range(messages):
                await step(i)
                await asyncio.sleep(0.02)
            cpu, db_cpu, elapsed = cpu_seconds(pid) - cpu0, tree_cpu_seconds(db_pid) - db0, time.perf_counter() - start
            print(f"{what} (one every {elapsed / messages * 1000:.0f} ms): server {cpu / messages * 1000:.1f} ms, "
                  f"its PostgreSQL {db_cpu / messages * 1000:.1f} ms")

        sent: list[str] = []

        async def send(i: int) -> None:
            sent.append((await sender.call("PUT", f"/rooms/{elsewhere}/send/m.room.message/x{run}{i}",
                                           {"msgtype": "m.text", "body": f"elsewhere {i}"}))["event_id"])

        await measured(f"a message in a room none of {online} users long-polling /sync is in: CPU per message "
                       "(the send and the waits)", send)
        me = (await sender.call("GET", "/account/whoami"))["user_id"]

        async def type_and_read(i: int) -> None:  # two more streams' positions
            await sender.call("PUT", f"/rooms/{elsewhere}/typing/{urllib.parse.quote(me)}",
                              {"typing": True, "timeout": 30000})
            await sender.call("POST", f"/rooms/{elsewhere}/receipt/m.read/{urllib.parse.quote(sent[i])}", {})

        await measured("  a typing notice and a read receipt there: CPU per pair", type_and_read)

        async def mark_and_message(i: int) -> None:  # account data, and a to-device message to its own devices
            await sender.call("POST", f"/rooms/{elsewhere}/read_markers", {"m.fully_read": sent[i]})
            await sender.call("PUT", f"/sendToDevice/org.example.bench/d{run}{i}", {"messages": {me: {"*": {"i": i}}}})

        await measured("  a read marker and a to-device message to its own devices: CPU per pair", mark_and_message)
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)


async def fan_out_to_online_members(anon: Api, sender: Api, room: str, pid: int | None, db_pid: int | None,
                                    online: int, messages: int, run: str) -> None:
    """``online`` members long-poll ``/sync`` in ``room`` while ``sender`` sends ``messages``
    messages one at a time: how long until every member's ``/sync`` has returned with the
    message, and the server's and its PostgreSQL's CPU per message, send and wake-ups together
    (what a message costs in a room whose members are online)."""
    members = [await anon.register(f"m{i}x{run}") for i in range(online)]
    for member in members:
        await member.call("POST", f"/rooms/{room}/join", {})
    tokens = [(await member.call("GET", "/sync?timeout=0"))["next_batch"] for member in members]
    everyone: list[float] = []
    cpu = db_cpu = 0.0

    async def until_seen(member: Api, since: str, body: str) -> str:
        """Long-poll until a /sync brings ``body`` (one may return earlier with presence, say)."""
        while True:
            result = await member.call("GET", f"/sync?since={since}&timeout=30000")
            since = result["next_batch"]
            events = result.get("rooms", {}).get("join", {}).get(room, {}).get("timeline", {}).get("events", [])
            if any(e.get("content", {}).get("body") == body for e in events):
                return since

    cycle_cpu = cycle_db = 0.0
    for i in range(messages):
        arrive_cpu, arrive_db = cpu_seconds(pid), tree_cpu_seconds(db_pid)
        polls = [asyncio.ensure_future(until_seen(member, since, f"online {i}"))
                 for member, since in zip(members, tokens)]
        await asyncio.sleep(0.2)  # let every long-poll reach the server and wait
        cpu0, db0, start = cpu_seconds(pid), tree_cpu_seconds(db_pid), time.perf_counter()
        await sender.send(room, f"online {i}")
        tokens = list(await asyncio.gather(*polls))
        everyone.append(time.perf_counter() - start)
        cpu, db_cpu = cpu + cpu_seconds(pid) - cpu0, db_cpu + tree_cpu_seconds(db_pid) - db0
        cycle_cpu, cycle_db = cycle_cpu + cpu_seconds(pid) - arrive_cpu, cycle_db + tree_cpu_seconds(db_pid) - arrive_db
    print(f"a message to {online} members online (long-polling /sync): every /sync back p50 "
          f"{pct(everyone, 0.5) * 1000:.1f} ms, p99 {pct(everyone, 0.99) * 1000:.1f} ms; CPU per message "
          f"(the send and {online} /syncs): server {cpu / messages * 1000:.1f} ms, its PostgreSQL "
          f"{db_cpu / messages * 1000:.1f} ms")
    print(f"  with the {online} long-polls' arrivals (each member's next /sync, from its last answer): server "
          f"{cycle_cpu / messages * 1000:.1f} ms, its PostgreSQL {cycle_db / messages * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url")
    parser.add_argument("--sends", type=int, default=500)
    parser.add_argument("--wakes", type=int, default=100)
    parser.add_argument("--online", type=int, default=20, help="members online for the fan-out figure (0: none)")
    parser.add_argument("--online-messages", type=int, default=20, help="messages sent to the online members")
    parser.add_argument("--elsewhere", type=int, default=100,
                        help="users long-polling /sync in their own room while messages go to another (0: none)")
    parser.add_argument("--rooms", type=int, default=50)
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--aiohttp", action="store_true",
                        help="time the sends with aiohttp rather than the bench's own lean HTTP/1.1 client")
    parser.add_argument("--py-spy", metavar="FILE", help="profile the sequential sends with py-spy into FILE")
    parser.add_argument("--synapse", action="store_true", help="measure Synapse too (.venv-synapse)")
    parser.add_argument("--synapse-sends", type=int, default=300, help="sequential sends to Synapse")
    parser.add_argument("--rounds", type=int, default=10,
                        help="with --synapse: rounds of the interleaved sequential sends (0: none)")
    args = parser.parse_args()
    if args.base_url:
        asyncio.run(bench(args.base_url, None, args))
        return
    with contextlib.ExitStack() as stack:
        tributary = stack.enter_context(running_tributary())
        print("tributary:")
        ours = asyncio.run(bench(tributary.base_url, tributary.pid, args, tributary.metrics_url, tributary.db_pid))
        if not args.synapse:
            return
        synapse = stack.enter_context(running_synapse())
        theirs = asyncio.run(bench(synapse.base_url, synapse.pid, args, None, synapse.db_pid, sends=args.synapse_sends))
        print(f"tributary / synapse: sequential sends {ours.sequential / theirs.sequential:.1f}x "
              f"({ours.sequential:.0f}/s against {theirs.sequential:.0f}/s), server CPU a send "
              f"{ours.sequential_cpu * 1000:.2f} against {theirs.sequential_cpu * 1000:.2f} ms; 8 senders "
              f"{ours.concurrent / theirs.concurrent:.1f}x ({ours.concurrent:.0f}/s against {theirs.concurrent:.0f}/s)")
        if args.rounds > 0:
            asyncio.run(interleaved([tributary, synapse], [args.sends, args.synapse_sends], args.rounds))


@attrs.frozen
class Target:
    """A server under measurement, running until its context ends."""

    name: str
    base_url: str
    pid: int | None
    db_pid: int | None  # its PostgreSQL's postmaster (the CPU of its process tree is counted)
    metrics_url: str | None = None


async def interleaved(targets: list[Target], sends: list[int], rounds: int) -> None:
    """Sequential sends to each target in turn, ``rounds`` times (each round a block of
    ``sends[i] // rounds`` sends to each, the order alternating): the machine's speed, which
    drifts over the minutes between two servers' own runs, weighs on every server alike, so
    the ratio is the servers' and not the moment's. Each target has a new room of two users."""
    run = secrets.token_hex(3)
    senders: list[LeanSender] = []
    rooms: list[str] = []
    async with aiohttp.ClientSession() as session:
        for target in targets:
            user = await Api(session, target.base_url).register(f"inter{run}")
            room_id = (await user.call("POST", "/createRoom", {"preset": "public_chat"}))["room_id"]
            # A second member, as in the sequential figure: each send is pushed for someone.
            await (await Api(session, target.base_url).register(f"other{run}")).call("POST", f"/rooms/{room_id}/join", {})
            rooms.append(room_id)
            senders.append(LeanSender(target.base_url, user.token or ""))
    totals = [[0, 0.0, 0.0, 0.0] for _ in targets]  # sends, wall, server CPU, its PostgreSQL's CPU
    try:
        for sender, room in zip(senders, rooms):
            for i in range(10):  # warm up
                await sender.send(room, f"warm {i}")
        for r in range(rounds):
            order = list(range(len(targets))) if r % 2 == 0 else list(reversed(range(len(targets))))
            for i in order:
                block = max(1, sends[i] // rounds)
                target, total = targets[i], totals[i]
                cpu0, db0, start = cpu_seconds(target.pid), tree_cpu_seconds(target.db_pid), time.perf_counter()
                for k in range(block):
                    await senders[i].send(rooms[i], f"round {r} {k}")
                total[0] += block
                total[1] += time.perf_counter() - start
                total[2] += cpu_seconds(target.pid) - cpu0
                total[3] += tree_cpu_seconds(target.db_pid) - db0
    finally:
        for sender in senders:
            sender.close()
    print(f"interleaved sequential sends, {rounds} rounds:")
    for target, (count, wall, cpu, db_cpu) in zip(targets, totals):
        print(f"  {target.name}: {count / wall:.0f}/s over {count} sends; CPU per send: server "
              f"{cpu / count * 1000:.2f} ms, its PostgreSQL {db_cpu / count * 1000:.2f} ms")
    if len(targets) == 2:
        (n0, w0, c0, _), (n1, w1, c1, _) = totals
        print(f"  {targets[0].name} / {targets[1].name}: sequential sends {(n0 / w0) / (n1 / w1):.1f}x, "
              f"server CPU a send {(c1 / n1) / (c0 / n0):.1f}x less")


@contextlib.contextmanager
def running_tributary() -> Iterator[Target]:
    """A fresh ``tributary`` process on its embedded PostgreSQL, with generous rate limits."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # the embedded PostgreSQL runs as another user when we are root
        limits = {"rc_message": GENEROUS, "rc_registration": GENEROUS,
                  "rc_joins": {"local": GENEROUS, "remote": GENEROUS}}  # fmt: skip
        hs = TributaryProcess.configure(Path(tmp), database_url=None, extra={**limits, "log_level": "WARNING"})
        hs.start(timeout=120)
        try:
            assert hs.process is not None
            postmaster = hs.data_dir / "postgres" / "postmaster.pid"
            db_pid = int(postmaster.read_text().split()[0]) if postmaster.exists() else None
            yield Target("tributary", hs.base_url, hs.process.pid, db_pid, f"http://127.0.0.1:{hs.metrics_port}/metrics")
        finally:
            hs.stop()


@contextlib.contextmanager
def running_synapse() -> Iterator[Target]:
    """A Synapse on a fresh PostgreSQL database (UTF8, C collation, as it asks for), dropped
    afterwards, once its start-up background updates are done; its PostgreSQL CPU is that of
    the whole cluster."""
    import psycopg2
    import yaml

    from bench.dataset import drop_database
    from tests.interop.synapse import SynapseProcess

    python = Path(__file__).resolve().parent.parent / ".venv-synapse" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: `make interop` installs Synapse there")
    admin_dsn = os.environ.get("TRIBUTARY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
    name = f"bench_synapse_{secrets.token_hex(4)}"
    admin = psycopg2.connect(admin_dsn)
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C'")
            cur.execute("SHOW data_directory")
            row = cur.fetchone()
        postmaster = Path(str(row[0]) if row else "") / "postmaster.pid"
        db_pid = int(postmaster.read_text().split()[0]) if postmaster.exists() else None
        url = urllib.parse.urlsplit(admin_dsn)
        with tempfile.TemporaryDirectory() as tmp:
            synapse = SynapseProcess.configure(python, Path(tmp) / "synapse")
            config = yaml.safe_load(synapse.config_path.read_text(encoding="utf-8"))
            config["database"] = {"name": "psycopg2", "args": {
                "user": url.username or "postgres", "host": url.hostname or "127.0.0.1", "port": url.port or 5432,
                "database": name, "cp_min": 5, "cp_max": 10}}
            synapse.config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
            synapse.start()
            try:
                assert synapse.process is not None
                waited = time.perf_counter()
                while not synapse.background_updates_done() and time.perf_counter() - waited < 600:
                    time.sleep(1.0)
                print(f"synapse {synapse.version()} (waited {time.perf_counter() - waited:.0f} s for its start-up "
                      "background updates):")
                yield Target("synapse", synapse.base_url, synapse.process.pid, db_pid)
            finally:
                synapse.stop()
    finally:
        admin.close()
        drop_database(admin_dsn, name)


if __name__ == "__main__":
    main()
