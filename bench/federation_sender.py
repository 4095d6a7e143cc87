"""Federation sender figures, from a real ``tributary`` process to the test federation peer
(tests/federation_peer.py: many virtual remote servers that verify every transaction).

Prints:
- PDUs delivered per second to 1, 10 and 100 destinations (every event in rooms with all of them),
  with the transactions it took;
- latency from an event's creation (its origin_server_ts) to the destination receiving it, on an
  idle link, p50 and p99;
- catch-up of a destination that missed ROOMS x EVENTS messages, with the missed-events bound on
  and off: time, transactions, PDUs, and the rooms whose gap a receiver would still have to fetch
  with get_missing_events (a PDU arrived whose prev_events it never got);
- a real receiving Tributary down while 500 messages go to 20 rooms: time from it coming back until
  all 500 are in its user's /sync, and the get_missing_events requests it made;
- CPU and RSS of the sending process, idle and under load;
- the fan-out cost: server CPU per PDU per destination with 1,000 destinations in a room
  (``--cost-destinations``, ``--cost-events``; ``--only-cost`` runs it alone).

Needs PostgreSQL on 127.0.0.1:5432 (trust auth for ``postgres``), as the tests do. Run by hand:

    .venv/bin/python bench/federation_sender.py [--events 500] [--rooms 1000] [--per-room 10]
    .venv/bin/python bench/federation_sender.py --only-cost [--cost-destinations 1000] [--cost-events 200]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg2
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.twisted_plugin import reactor, run_sync  # noqa: E402  (installs the reactor first)

from twisted.internet import task  # noqa: E402
from twisted.internet.defer import Deferred, gatherResults  # noqa: E402

from bench.profiling import start_py_spy, stop_py_spy  # noqa: E402
from tests.conftest import scratch_database  # noqa: E402
from tests.federation_peer import Behaviour, FederationPeer  # noqa: E402
from tests.harness import TributaryProcess, free_port  # noqa: E402
from tests.integration.test_client_support import Client  # noqa: E402

FED = {"verify_certificates": False, "ip_range_whitelist": ["127.0.0.0/8"]}
GENEROUS = {"per_second": 100000, "burst_count": 100000}
TICK = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def metric(proc: TributaryProcess, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    _, body = proc.get("/metrics", port=proc.metrics_port)
    return sum(s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def start_tributary(tmp: Path, dsn: str, sender: dict[str, Any]) -> tuple[TributaryProcess, str]:
    fed_port = free_port()
    name = f"127.0.0.1:{fed_port}"
    proc = TributaryProcess.configure(tmp, database_url=dsn, server_name=name, extra={
        "federation": FED, "log_level": "WARNING", "federation_sender": sender,
        "rc_message": GENEROUS, "rc_joins": {"local": GENEROUS, "remote": GENEROUS},
    })
    config = yaml.safe_load(proc.config_path.read_text())
    config["listeners"].append({"type": "http", "port": fed_port, "tls": True, "resources": ["federation", "keys"]})
    config["database"]["max_connections"] = 20
    proc.config_path.write_text(yaml.safe_dump(config))
    proc.start(timeout=60)
    return proc, name


class User:
    def __init__(self, client: Client, token: str) -> None:
        self.client, self.token = client, token
        self._ids = itertools.count()

    @classmethod
    async def register(cls, client: Client, name: str) -> User:
        return cls(client, (await client.register_ok(name))["access_token"])

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        r = await self.client.request(method, path, body, token=self.token)
        if r.status != 200:
            raise RuntimeError(f"{method} {path}: {r.status} {r.body}")
        return r.body

    async def room(self) -> str:
        return str((await self.call("POST", "createRoom", {"preset": "public_chat"}))["room_id"])

    async def send(self, room_id: str, body: str) -> str:
        path = f"rooms/{quote(room_id, safe='')}/send/m.room.message/b{next(self._ids)}"
        return str((await self.call("PUT", path, {"msgtype": "m.text", "body": body}))["event_id"])


async def parallel(jobs: list[Any], width: int) -> list[Any]:
    """Run coroutine factories ``width`` at a time, keeping their order in the results."""
    results: list[Any] = [None] * len(jobs)
    it = iter(enumerate(jobs))

    async def worker() -> None:
        for i, job in it:
            results[i] = await job()

    await gatherResults([Deferred.fromCoroutine(worker()) for _ in range(width)], consumeErrors=True)
    return results


async def sleep(seconds: float) -> None:
    await task.deferLater(reactor, seconds, lambda: None)


async def say_up(peer: FederationPeer, server: str, destination: str, tag: str) -> None:
    """Virtual ``server`` sends ``destination`` an empty transaction: it is up (its backoff ends)."""
    for attempt in range(3):  # a pooled connection the destination has since closed fails once
        try:
            await peer.send_transaction(server, destination, f"{tag}-{server}-{attempt}")
            return
        except Exception:
            if attempt == 2:
                raise


async def throughput(peer: FederationPeer, proc: TributaryProcess, name: str, alice: User, n: int,
                     events: int) -> None:
    servers = peer.servers[:n]
    rooms = [await alice.room() for _ in range(8)]
    for room in rooms:
        await parallel([lambda s=s, room=room: peer.join(s, f"@u:{s}", room, via=name) for s in servers], 8)
    await sleep(1.0)
    before_txns = sum(len(peer.transactions(s)) for s in servers)
    pid = proc.process.pid  # type: ignore[union-attr]
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    sent = await parallel([lambda i=i: alice.send(rooms[i % len(rooms)], f"m{i}") for i in range(events)], 8)
    for s in servers:
        await peer.wait_for_pdus(s, sent, timeout=300)
    elapsed = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0
    txns = sum(len(peer.transactions(s)) for s in servers) - before_txns
    pdus = len(sent) * n
    print(f"  {n:>3} destinations, live: {pdus} PDUs in {elapsed:.2f}s = {pdus / elapsed:,.0f} PDUs/s "
          f"(as fast as the client API persisted them: {len(sent) / elapsed:.0f} events/s), {txns} transactions "
          f"({pdus / max(txns, 1):.1f} PDUs each), process CPU {cpu:.2f}s, RSS {rss_mib(pid):.1f} MiB")

    # The sender alone: the destinations are down while the events are persisted (their queues
    # hold them, backing off), then each says it is back with a request of its own.
    for s in servers:
        await peer.set_behaviour(s, Behaviour.DOWN)
    sent = await parallel([lambda i=i: alice.send(rooms[i % len(rooms)], f"d{i}") for i in range(events)], 8)
    await sleep(1.0)
    before_txns = sum(len(peer.transactions(s)) for s in servers)
    for s in servers:
        await peer.set_behaviour(s, Behaviour.OK)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    await parallel([lambda s=s: say_up(peer, s, name, f"up-{t0}") for s in servers], 8)
    for s in servers:
        await peer.wait_for_pdus(s, sent, timeout=300)
    elapsed = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0
    txns = sum(len(peer.transactions(s)) for s in servers) - before_txns
    print(f"  {n:>3} destinations, backlog drain: {pdus} PDUs in {elapsed:.2f}s = {pdus / elapsed:,.0f} PDUs/s, "
          f"{txns} transactions ({pdus / max(txns, 1):.1f} PDUs each), sender CPU {cpu:.2f}s "
          f"({1000 * cpu / pdus:.3f} ms/PDU), RSS {rss_mib(pid):.1f} MiB")


async def latency(peer: FederationPeer, name: str, alice: User, count: int) -> None:
    server = peer.servers[0]
    room = await alice.room()
    await peer.join(server, f"@u:{server}", room, via=name)
    await sleep(0.5)
    lags = []
    for i in range(count):
        event_id = await alice.send(room, f"idle {i}")
        await peer.wait_for_pdus(server, [event_id], timeout=30)
        txn = next(t for t in reversed(peer.transactions(server)) if event_id in t.pdu_ids)
        created = next(p["origin_server_ts"] for e, p in zip(txn.pdu_ids, txn.pdus) if e == event_id)
        lags.append(txn.arrived_at * 1000 - created)
        await sleep(0.02)
    print(f"  idle link, 1 destination, {count} events: created -> received p50 {pct(lags, 0.5):.1f} ms, "
          f"p99 {pct(lags, 0.99):.1f} ms")


async def settle(pid: int, *, quiet: float = 0.05, step: float = 2.0, limit: float = 1800.0) -> None:
    """Wait until the process uses under ``quiet`` of a core over ``step`` seconds (its sender idle)."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        cpu0 = cpu_seconds(pid)
        await sleep(step)
        if cpu_seconds(pid) - cpu0 < quiet * step:
            return


async def fanout_cost(tmp: Path, dsn: str, n: int, events: int, profile: str | None = None) -> None:
    """Server CPU per PDU per destination with ``n`` destinations in one room.

    Each virtual server answers 500 once it has joined (its port stays open: a closed one may
    be taken by another process meanwhile), so the sender backs off from it and what the room
    sends it from then on (the joins of the servers after it, then ``events`` messages) waits
    in its queue. Then every server answers again and says so with a transaction of its own,
    and the backlogs drain
    in full transactions: the sender's CPU over the drain, less what ``n`` such inbound
    wake-up transactions cost when nothing waits (measured after), divided by the PDUs the
    servers received, is the figure."""
    peer = FederationPeer(reactor, request_timeout_seconds=120)
    t0 = time.perf_counter()
    servers = await peer.start(n)
    proc, name = start_tributary(tmp / "fanout", dsn, {})
    try:
        pid = proc.process.pid  # type: ignore[union-attr]
        alice = await User.register(Client(proc.base_url), "alice")
        room = await alice.room()

        async def join(s: str) -> None:
            await peer.join(s, f"@u:{s}", room, via=name)
            await peer.set_behaviour(s, Behaviour.ERROR_500)

        await parallel([lambda s=s: join(s) for s in servers], 8)
        sent = await parallel([lambda i=i: alice.send(room, f"fan-out {i}") for i in range(events)], 8)
        await settle(pid)
        print(f"  set-up: {n} virtual servers joined one room and began to fail, {events} messages sent, "
              f"in {time.perf_counter() - t0:.0f}s")

        await parallel([lambda s=s: peer.set_behaviour(s, Behaviour.OK) for s in servers], 8)
        first = {s: len(peer.transactions(s)) for s in servers}
        spy = start_py_spy(pid, profile)
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        await parallel([lambda s=s: say_up(peer, s, name, "back") for s in servers], 8)
        for s in servers:
            await peer.wait_for_pdus(s, sent, timeout=3600)
        elapsed = time.perf_counter() - t0
        await settle(pid, quiet=0.02, step=1.0)  # the last positions written
        cpu = cpu_seconds(pid) - cpu0
        stop_py_spy(spy, profile)
        txns = [t for s in servers for t in peer.transactions(s)[first[s]:] if not t.repeat and t.pdus]
        deliveries = sum(len(t.pdus) for t in txns)

        cpu0 = cpu_seconds(pid)
        await parallel([lambda s=s: say_up(peer, s, name, "again") for s in servers], 8)
        await settle(pid, quiet=0.02, step=1.0)
        inbound = cpu_seconds(pid) - cpu0
        print(f"  {n} destinations: {deliveries:,} PDUs delivered ({events} messages each, and the joins after "
              f"its own) in {elapsed:.1f}s, {len(txns):,} transactions ({deliveries / max(len(txns), 1):.1f} PDUs "
              f"each); sender CPU {cpu:.2f}s less {inbound:.2f}s for the {n} inbound wake-up transactions: "
              f"{1e6 * (cpu - inbound) / max(deliveries, 1):.1f} µs per PDU per destination")
    finally:
        proc.stop()
        await peer.stop()


def gap_rooms(pdus: list[dict[str, Any]], ids: list[str], known: set[str]) -> int:
    """Rooms in which some PDU arrived whose prev_events the receiver never got (a fetch)."""
    have = set(known)
    gaps: set[str] = set()
    for event_id, pdu in zip(ids, pdus):
        if any(prev not in have for prev in pdu.get("prev_events", ())):
            gaps.add(pdu["room_id"])
        have.add(event_id)
    return len(gaps)


async def catch_up(tmp: Path, dsn: str, rooms_n: int, per_room: int) -> None:
    sender = {"backoff": {"initial": "200ms", "max": "2s"}, "catch_up": {"threshold": "500ms"}}
    peer = FederationPeer(reactor, request_timeout_seconds=60)
    [server] = await peer.start(1)
    proc, name = start_tributary(tmp / "catchup", dsn, sender)
    try:
        client = Client(proc.base_url)
        alice = await User.register(client, "alice")
        t0 = time.perf_counter()
        rooms = await parallel([alice.room for _ in range(rooms_n)], 8)
        await parallel([lambda r=r: peer.join(server, f"@u:{server}", r, via=name) for r in rooms], 8)
        print(f"  set-up: {rooms_n} rooms created and joined in {time.perf_counter() - t0:.0f}s")
        hello = await parallel([lambda r=r: alice.send(r, "hello") for r in rooms], 8)
        await peer.wait_for_pdus(server, hello, timeout=120)
        await sleep(1.0)
        known = set(peer.received_pdu_ids(server))
        position = position_of(dsn, server)
        await peer.set_behaviour(server, Behaviour.DOWN)
        t0 = time.perf_counter()
        sent = await parallel([lambda i=i: alice.send(rooms[i % rooms_n], f"missed {i}")
                               for i in range(rooms_n * per_room)], 8)
        print(f"  outage: {len(sent)} messages sent in {time.perf_counter() - t0:.0f}s")
        while metric(proc, "tributary_federation_sender_destinations_catching_up") < 1:
            await sleep(0.2)
    finally:
        proc.stop()

    for bound in (50, 0):
        query(dsn, "UPDATE destinations SET last_successful_stream_ordering = %s, retry_interval = 0, catch_up_from = NULL, "
              "retry_last_ts = 0 WHERE destination = %s", position, server)
        config = yaml.safe_load(proc.config_path.read_text())
        config["federation_sender"]["catch_up"]["missed_events_per_room"] = bound
        proc.config_path.write_text(yaml.safe_dump(config))
        await peer.set_behaviour(server, Behaviour.OK)
        first = len(peer.transactions(server))
        t0 = time.perf_counter()
        proc.start(timeout=60)
        try:
            while position_of(dsn, server) < max_position(dsn):
                await sleep(0.05)
            elapsed = time.perf_counter() - t0
            txns = [t for t in peer.transactions(server)[first:] if not t.repeat]
            pdus = [p for t in txns for p in t.pdus]
            ids = [e for t in txns for e in t.pdu_ids]
            print(f"  catch-up of {rooms_n} rooms x {per_room} missed, missed_events_per_room={bound}: "
                  f"{elapsed:.2f}s (process start included), {len(txns)} transactions, {len(pdus)} PDUs, "
                  f"rooms the receiver must fetch a gap in (get_missing_events): {gap_rooms(pdus, ids, known)}")
        finally:
            proc.stop()
    await peer.stop()


def query(dsn: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def position_of(dsn: str, destination: str) -> int:
    rows = query(dsn, "SELECT last_successful_stream_ordering FROM destinations WHERE destination = %s", destination)
    return int(rows[0][0] or 0) if rows else 0


def max_position(dsn: str) -> int:
    return int(query(dsn, "SELECT max(stream_ordering) FROM destination_rooms")[0][0])


async def real_receiver(tmp: Path, dsn_a: str, dsn_b: str, messages: int, rooms_n: int) -> None:
    sender = {"backoff": {"initial": "200ms", "max": "1s"}, "catch_up": {"threshold": "500ms"}}
    a, name_a = start_tributary(tmp / "a", dsn_a, sender)
    b, name_b = start_tributary(tmp / "b", dsn_b, sender)
    try:
        alice = await User.register(Client(a.base_url), "alice")
        bob = await User.register(Client(b.base_url), "bob")
        rooms = [await alice.room() for _ in range(rooms_n)]
        for room in rooms:
            await bob.call("POST", f"join/{quote(room, safe='')}?server_name={quote(name_a)}", {})
        b.stop()
        sent = await parallel([lambda i=i: alice.send(rooms[i % rooms_n], f"m{i}") for i in range(messages)], 4)
        while metric(a, "tributary_federation_sender_destinations_catching_up") < 1:
            await sleep(0.1)
        fetches = metric(a, "tributary_http_requests_total", servlet="federation_get_missing_events")
        b.start(timeout=60)
        t0 = time.perf_counter()
        wanted = set(sent)
        flt = quote('{"room":{"timeline":{"limit":%d}}}' % (messages // rooms_n + 10))
        while True:
            sync = await bob.call("GET", f"sync?filter={flt}")
            seen = {e["event_id"] for r in sync["rooms"]["join"].values() for e in r["timeline"]["events"]}
            if wanted <= seen:
                break
            await sleep(0.05)
        elapsed = time.perf_counter() - t0
        fetched = metric(a, "tributary_http_requests_total", servlet="federation_get_missing_events") - fetches
        print(f"  receiver down while {messages} messages went to {rooms_n} rooms: all {messages} in its user's "
              f"/sync {elapsed:.2f}s after it answered /health again; get_missing_events requests: {fetched:.0f}")
    finally:
        b.stop()
        a.stop()


async def main(args: argparse.Namespace) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        if args.only_cost:
            print("fan-out cost:")
            await fanout_cost(tmp, stack.enter_context(scratch_database(None)), args.cost_destinations,
                              args.cost_events, args.py_spy)
            return
        dsn = stack.enter_context(scratch_database(None))
        peer = FederationPeer(reactor, request_timeout_seconds=60)
        await peer.start(100)
        proc, name = start_tributary(tmp / "main", dsn, {})
        try:
            pid = proc.process.pid  # type: ignore[union-attr]
            alice = await User.register(Client(proc.base_url), "alice")
            print("delivery:")
            if args.latency_events:
                await latency(peer, name, alice, args.latency_events)
            for n in (int(x) for x in args.fanout.split(",") if x):
                await throughput(peer, proc, name, alice, n, args.events)
            await sleep(2.0)
            cpu0 = cpu_seconds(pid)
            await sleep(10.0)
            print(f"  sender idle with 100 destinations known: CPU {100 * (cpu_seconds(pid) - cpu0) / 10:.2f}% "
                  f"of a core, RSS {rss_mib(pid):.1f} MiB")
        finally:
            proc.stop()
            await peer.stop()
        if args.cost_destinations:
            print("fan-out cost:")
            await fanout_cost(tmp, stack.enter_context(scratch_database(None)), args.cost_destinations,
                              args.cost_events, args.py_spy)
        if not args.skip_catch_up:
            print("catch-up:")
            await catch_up(tmp, stack.enter_context(scratch_database(None)), args.rooms, args.per_room)
        if not args.skip_receiver:
            print("real receiver:")
            await real_receiver(tmp, stack.enter_context(scratch_database(None)),
                                stack.enter_context(scratch_database(None)), 500, 20)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=500, help="events per throughput run")
    parser.add_argument("--latency-events", type=int, default=100, help="0 skips the latency run")
    parser.add_argument("--fanout", default="1,10,100", help="destination counts of the throughput runs")
    parser.add_argument("--rooms", type=int, default=1000, help="rooms the catch-up destination missed")
    parser.add_argument("--per-room", type=int, default=10, help="messages it missed in each")
    parser.add_argument("--cost-destinations", type=int, default=1000,
                        help="destinations of the fan-out cost run (CPU per PDU per destination); 0 skips it")
    parser.add_argument("--cost-events", type=int, default=200, help="PDUs each destination gets in that run")
    parser.add_argument("--only-cost", action="store_true", help="run the fan-out cost run alone")
    parser.add_argument("--py-spy", metavar="FILE", help="profile the sender during the fan-out cost run into FILE")
    parser.add_argument("--skip-catch-up", action="store_true")
    parser.add_argument("--skip-receiver", action="store_true")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    try:
        run_sync(main(parser.parse_args()), timeout=7200)
    finally:
        # Stops the reactor's thread pool, whose threads would keep the interpreter alive.
        reactor.fireSystemEvent("shutdown")
