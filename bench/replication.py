# tests: tests/integration/test_replication_tcp.py tests/integration/test_replication_redis.py (what this measures)
"""Benchmark: replication end to end, writer process to reader process, over TCP and Redis.

The writer (this process) appends rows to an in-memory ``events`` stream and
tells its ``ReplicationHandler`` after each fact, as the stream layer does; a
reader, started as a separate process, connects over loopback TCP (or the
Redis channel) and counts rows in its row handler. Each row carries the time
its fact completed (``time.time_ns()``, one clock for both processes) and is
about 200 bytes of JSON, like an events-stream row.

    .venv/bin/python bench/replication.py [--rows 100000] [--transports tcp,redis]
        [--redis-url redis://127.0.0.1:6379/9] [--steady-seconds 10] [--facts-per-turn 25]

Prints, per transport:

- burst:   rows/s from the writer's first fact to the reader's handler seeing
           the last one, writing as fast as the writer can (one row per fact,
           ``--facts-per-turn`` facts completing per reactor turn: the writer
           sends each turn's rows together, so this sets the batch size; with
           very small turns the per-turn overhead dominates, with very large
           ones the writer stops feeding the socket while it builds a batch);
- latency: p50/p99 from a fact completing to the reader's handler running,
           at a steady 2,000 rows/s (not saturated, so it is the pipeline's
           latency rather than a queue's);
- idle CPU: the reader's CPU time while it keeps up with a steady 40 rows/s,
           as a percentage of one core.

Aims in issue 8: >= 50,000 rows/s over TCP, >= 20,000 rows/s over Redis,
reader CPU at 40 events/s under 3% of a core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from homeserver.reactor import install_reactor  # noqa: E402

reactor: Any = install_reactor()

from prometheus_client import CollectorRegistry  # noqa: E402
from twisted.internet.defer import Deferred, ensureDeferred  # noqa: E402
from twisted.internet.task import deferLater  # noqa: E402
from twisted.internet.threads import deferToThread  # noqa: E402
from twisted.python.failure import Failure  # noqa: E402

from replication.commands import Row  # noqa: E402
from replication.connection import ConnectionConfig  # noqa: E402
from replication.handler import MemoryStream, ReplicationHandler  # noqa: E402
from replication.metrics import ReplicationMetrics  # noqa: E402
from replication.transport import (  # noqa: E402
    ReplicationClientFactory,
    ReplicationServerFactory,
    TwistedScheduler,
)

SERVER = "bench.example"
PHASES = ("burst", "latency", "steady")
LATENCY_RATE = 2_000
STEADY_RATE = 40
PAYLOAD = "$" + "e" * 43  # an event ID's size


def make_row(phase: int, seq: int) -> tuple[object, ...]:
    """About 200 bytes of JSON: the shape of an events-stream row, plus the
    phase, a sequence number and the fact's completion time."""
    return (phase, seq, time.time_ns(), PAYLOAD, "!" + "r" * 43 + ":bench.example", "m.room.message", None,
            "@user:bench.example")


# --------------------------------------------------------------------------
# The reader process.


class Counter:
    def __init__(self, expected: list[int]) -> None:
        self.expected = expected
        self.phase = 0
        self.count = 0
        self.latencies: list[int] = []
        self.first_ns = 0
        self.cpu_start = 0.0

    def on_rows(self, stream: str, instance: str, token: int, rows: Any) -> None:
        now = time.time_ns()
        for row in rows:
            phase, seq, written_ns = row[0], row[1], row[2]
            if phase != self.phase:
                continue
            if self.count == 0:
                self.first_ns = now
                self.cpu_start = time.process_time()
            self.count += 1
            self.latencies.append(now - written_ns)
            if self.count == self.expected[phase]:
                self.report(now)

    def report(self, now: int) -> None:
        cpu = time.process_time() - self.cpu_start
        self.latencies.sort()
        n = len(self.latencies)
        print(json.dumps({
            "phase": PHASES[self.phase],
            "rows": n,
            "last_ns": now,
            "first_ns": self.first_ns,
            "p50_s": self.latencies[n // 2] / 1e9,
            "p99_s": self.latencies[min(n - 1, (n * 99) // 100)] / 1e9,
            "cpu_s": cpu,
            "wall_s": (now - self.first_ns) / 1e9,
        }), flush=True)
        self.phase += 1
        self.count = 0
        self.latencies = []
        if self.phase == len(PHASES):
            reactor.callLater(0.05, lambda: reactor.running and reactor.stop())


class NoGaps:
    """The bench reader's view of the stream: it has no table to read, so a
    gap (the writer cut it off) ends the run with an error instead of a hang."""

    name = "events"

    def current_position(self, instance: str) -> int:
        return 0

    async def get_updates_between(self, instance: str, from_token: int, to_token: int, limit: int) -> Any:
        if from_token == to_token or to_token == 0:
            return [], to_token, False
        print(json.dumps({"error": f"reader missed rows {from_token}..{to_token} (cut off for congestion?)"}),
              flush=True)
        reactor.stop()
        return [], to_token, False


def run_reader(args: argparse.Namespace) -> None:
    counter = Counter([args.rows, args.latency_rows, args.steady_rows])
    metrics = ReplicationMetrics.create(CollectorRegistry())
    handler = ReplicationHandler("bench_reader", TwistedScheduler(reactor), sources={"events": NoGaps()},
                                 metrics=metrics)
    handler.add_row_handler(counter)

    async def ready() -> None:
        while handler.position("events", "master") is None:
            await deferLater(reactor, 0.01)
        print(json.dumps({"ready": True}), flush=True)

    if args.transport == "tcp":
        factory = ReplicationClientFactory("bench_reader", handler, reactor, metrics,
                                           ConnectionConfig(expected_server_name=SERVER))
        reactor.connectTCP("127.0.0.1", args.port, factory)
    else:
        from replication.redis_transport import RedisTransport

        transport = RedisTransport(url=args.redis_url, channel=args.channel, instance_name="bench_reader",
                                   handler=handler, clock=reactor, metrics=metrics)
        transport.start()
        reactor.addSystemEventTrigger("before", "shutdown", transport.stop)
    reactor.callWhenRunning(lambda: ensureDeferred(ready()))
    reactor.run()


# --------------------------------------------------------------------------
# The writer (this process).


async def write_phase(handler: ReplicationHandler, stream: MemoryStream, state: dict[str, int], phase: int,
                      rows: int, rate: float | None, per_turn: int = 25) -> None:
    """``rows`` facts of one row each; as fast as possible (``per_turn``
    facts completing in each reactor turn), or at ``rate``/s."""
    started = time.monotonic()
    for seq in range(rows):
        state["token"] += 1
        stream.write("master", state["token"], [make_row(phase, seq)])
        handler.on_stream_advanced("events")
        if rate is None:
            if seq % per_turn == per_turn - 1:
                await deferLater(reactor, 0)
        else:
            due = started + (seq + 1) / rate
            delay = due - time.monotonic()
            if delay > 0.001:
                await deferLater(reactor, delay)


async def bench_transport(args: argparse.Namespace, transport: str) -> dict[str, dict[str, float]]:
    metrics = ReplicationMetrics.create(CollectorRegistry())
    stream = MemoryStream("events")
    handler = ReplicationHandler("master", TwistedScheduler(reactor), sources={"events": stream}, writes=["events"],
                                 metrics=metrics, announce_interval=1.0 if transport == "redis" else None)
    handler.start()
    command = [sys.executable, __file__, "--role", "reader", "--transport", transport,
               "--rows", str(args.rows), "--latency-rows", str(args.latency_rows),
               "--steady-rows", str(args.steady_rows)]
    cleanup: list[Any] = []
    if transport == "tcp":
        # A burst may outrun the reader for a while: hold it all rather than
        # cut the reader off (a bench reader has no table to catch up from).
        server = ReplicationServerFactory(SERVER, handler, reactor, metrics,
                                          ConnectionConfig(max_outbound_buffer=10_000_000))
        port = reactor.listenTCP(0, server, interface="127.0.0.1")
        cleanup.append(port.stopListening)
        command += ["--port", str(port.getHost().port)]
    else:
        from replication.redis_transport import RedisTransport

        channel = f"bench-{uuid.uuid4().hex[:8]}"
        redis_transport = RedisTransport(url=args.redis_url, channel=channel, instance_name="master",
                                         handler=handler, clock=reactor, metrics=metrics)
        redis_transport.start()
        await redis_transport.wait_connected()
        cleanup.append(redis_transport.stop)
        command += ["--redis-url", args.redis_url, "--channel", channel]
    reader = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert reader.stdout is not None
    stdout = reader.stdout

    async def next_report() -> dict[str, Any]:
        line: str = await deferToThread(stdout.readline)
        if not line:
            raise RuntimeError(f"the {transport} reader exited with {reader.wait()}")
        report: dict[str, Any] = json.loads(line)
        if "error" in report:
            raise RuntimeError(f"the {transport} reader failed: {report['error']}")
        return report

    results: dict[str, dict[str, float]] = {}
    try:
        await next_report()  # ready
        state = {"token": 0}
        cpu0 = time.process_time()
        start_ns = time.time_ns()
        await write_phase(handler, stream, state, 0, args.rows, None, args.facts_per_turn)
        report = await next_report()
        results["burst"] = {
            "rows_per_s": args.rows / ((report["last_ns"] - start_ns) / 1e9),
            "reader_cpu_percent": 100 * report["cpu_s"] / report["wall_s"],
            "writer_cpu_percent": 100 * (time.process_time() - cpu0) / ((time.time_ns() - start_ns) / 1e9),
        }
        await write_phase(handler, stream, state, 1, args.latency_rows, LATENCY_RATE)
        report = await next_report()
        results["latency"] = {"p50_s": report["p50_s"], "p99_s": report["p99_s"]}
        await write_phase(handler, stream, state, 2, args.steady_rows, STEADY_RATE)
        report = await next_report()
        results["steady"] = {"cpu_percent": 100 * report["cpu_s"] / report["wall_s"]}
    finally:
        reader.terminate()
        await deferToThread(reader.wait)
        handler.stop()
        for stop in cleanup:
            result = stop()
            if isinstance(result, Deferred):
                await result
    return results


async def run_writer(args: argparse.Namespace) -> None:
    print(f"replication end to end, {args.rows:,} rows of ~200 bytes, reader in its own process, "
          f"burst with {args.facts_per_turn} facts completing per reactor turn")
    for transport in args.transports.split(","):
        results = await bench_transport(args, transport)
        aim = 50_000 if transport == "tcp" else 20_000
        burst = results["burst"]
        print(f"{transport:5}  burst:   {burst['rows_per_s']:>10,.0f} rows/s   (aim >= {aim:,}; "
              f"CPU: reader {burst['reader_cpu_percent']:.0f}%, writer {burst['writer_cpu_percent']:.0f}% of a core)")
        print(f"{transport:5}  latency: p50 {results['latency']['p50_s'] * 1000:.2f} ms, "
              f"p99 {results['latency']['p99_s'] * 1000:.2f} ms   (at {LATENCY_RATE:,} rows/s)")
        print(f"{transport:5}  reader CPU at {STEADY_RATE} rows/s: {results['steady']['cpu_percent']:.2f}% of a core"
              f"   (aim < 3%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--transports", default="tcp,redis")
    parser.add_argument("--redis-url", default=os.environ.get("TRIBUTARY_TEST_REDIS", "redis://127.0.0.1:6379/9"))
    parser.add_argument("--steady-seconds", type=float, default=10.0)
    parser.add_argument("--facts-per-turn", type=int, default=25,
                        help="burst: facts completing per reactor turn (the writer coalesces each turn's)")
    parser.add_argument("--role", default="writer", choices=("writer", "reader"))
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--channel", default="")
    parser.add_argument("--latency-rows", type=int, default=LATENCY_RATE * 3)
    parser.add_argument("--steady-rows", type=int, default=0)
    args = parser.parse_args()
    if not args.steady_rows:
        args.steady_rows = int(STEADY_RATE * args.steady_seconds)
    if args.role == "reader":
        run_reader(args)
        return

    def done(result: object) -> None:
        if isinstance(result, Failure):
            result.printTraceback()
        if reactor.running:
            reactor.stop()

    reactor.callWhenRunning(lambda: ensureDeferred(run_writer(args)).addBoth(done))
    reactor.run()


if __name__ == "__main__":
    main()
