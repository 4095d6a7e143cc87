"""Inbound federation figure: PDUs per second a fresh ``tributary`` process takes from one peer.

A virtual server of the signing test peer (tests/federation_peer.py) joins a public room that a
local user created, then sends N messages of its user, one line of history, in 50-PDU
transactions, one transaction in flight at a time (as a real sender does). The PDUs are built
and signed before the clock starts. Prints PDUs/s from the first ``PUT /send`` until the last PDU is
in ``/messages``, the server's CPU per PDU (and its PostgreSQL backends') and its database
transactions per ``/send``,
checks every PDU was accepted and is in the room's timeline (the user's ``/messages``), and, with
``--synapse``, the same figure for a Synapse (``make interop`` installs it into .venv-synapse). Synapse
answers ``/send`` before it persists and drops a room's inbound queue past 100 events, so it is sent
a transaction only once the one before is in ``/messages`` ("paced"); the clock stops, for both,
when the last PDU is in ``/messages``.

Needs PostgreSQL on 127.0.0.1:5432 (trust auth for ``postgres``), as the tests do. Run by hand:

    .venv/bin/python bench/federation_inbound.py [--pdus 5000] [--members 10000] [--py-spy FILE]
                                                 [--synapse [--synapse-pdus 500]]

``--members N`` first adds N members of the sending server to the room (in bulk, in the database),
so that the room's state is that of a big room.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.twisted_plugin import reactor, run_sync  # noqa: E402  (installs the reactor first)

from bench.profiling import start_py_spy, stop_py_spy  # noqa: E402

from twisted.internet import task  # noqa: E402

from tests.federation_peer import FederationPeer  # noqa: E402
from tests.harness import TributaryProcess  # noqa: E402
from tests.integration.test_client_support import Client  # noqa: E402
from tests.integration.test_federation_peer import running_tributary  # noqa: E402
from tests.pdu_chain import chain_builder, event_ids  # noqa: E402

TXN_SIZE = 50
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def db_transactions(proc: TributaryProcess) -> dict[str, float]:
    """Database transactions the process finished so far, by name, and (as ``/send``) the seconds
    it spent answering ``PUT /send`` (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, body = proc.get("/metrics", port=proc.metrics_port)
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == "tributary_storage_txn_total" and s.labels.get("outcome") == "ok":
                found[s.labels["txn"]] = s.value
            elif s.name == "tributary_storage_txn_duration_seconds_sum":
                found["db seconds"] = found.get("db seconds", 0.0) + s.value
                found["db seconds " + s.labels["txn"]] = s.value
            elif s.name == "tributary_http_request_duration_seconds_sum" and s.labels.get("servlet") == "federation_send":
                found["/send"] = s.value
    return found


def backend_cpu_seconds(dsn: str) -> dict[int, float]:
    """CPU seconds so far of each PostgreSQL backend connected to ``dsn``'s database but this
    one: the server's pool connections (the cluster runs on this machine)."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid()")
            pids = [int(row[0]) for row in cursor.fetchall()]
    finally:
        conn.close()
    found: dict[int, float] = {}
    for backend in pids:
        try:
            found[backend] = cpu_seconds(backend)
        except OSError:
            continue  # ended meanwhile
    return found


async def measure(peer: FederationPeer, server: str, destination: str, client: Client, pid: int | None,
                  n: int, label: str, metrics_of: TributaryProcess | None = None, timeout: float = 300, paced: bool = False,
                  profile: str | None = None, members: int = 0) -> float:
    """Join, build ``n`` PDUs, send them in 50-PDU transactions; print and return PDUs/s.

    ``paced``: send a transaction only once the one before is in /messages, for a server that
    answers before it persists and drops a room's queue past a bound (Synapse: 100 events).
    ``profile``: record the server with py-spy into this file while the PDUs are sent. ``members``:
    make the room that big first (Tributary only)."""
    token = (await client.register_ok(f"bench{int(time.time())}"))["access_token"]
    created = await client.request("POST", "createRoom", {"preset": "public_chat"}, token=token)
    assert created.status == 200, created
    room_id = created.body["room_id"]
    remote = f"@bench:{server}"
    await peer.join(server, remote, room_id, via=destination)
    if members and metrics_of is not None:
        # A big room: joins of the peer's server's users, written into the database in bulk
        # (tests/big_room.py); the local send below then notices the room changed under it.
        from signedjson.key import generate_signing_key

        from tests.big_room import add_members

        config = yaml.safe_load(metrics_of.config_path.read_text(encoding="utf-8"))
        added = time.perf_counter()
        add_members(config["database"]["url"], room_id, server, generate_signing_key("bulk"), members,
                    origin_server_ts=int(time.time() * 1000))
        print(f"  {label}: {members} members of {server} added to the room in {time.perf_counter() - added:.1f}s")
    sent = await client.request("PUT", f"rooms/{quote(room_id, safe='')}/send/m.room.message/t0",
                                {"msgtype": "m.text", "body": "before"}, token=token)
    assert sent.status == 200, sent
    builder = await chain_builder(peer, server, destination, room_id, sent.body["event_id"],
                                  int(reactor.seconds() * 1000))
    pdus = [builder.message(remote, f"bench {i}") for i in range(n)]
    ids = event_ids(peer, pdus)
    # The peer answers get_missing_events and /event from them, as a real sender would: a receiver
    # that drops a backlog (Synapse prunes a room's inbound queue past 100 events) fetches it back.
    peer.serve_history(server, pdus)
    txns0 = db_transactions(metrics_of) if metrics_of is not None else {}
    dsn = yaml.safe_load(metrics_of.config_path.read_text(encoding="utf-8"))["database"]["url"] \
        if metrics_of is not None else None
    pg0 = backend_cpu_seconds(dsn) if dsn is not None else {}
    spy = start_py_spy(pid, profile)
    cpu0 = cpu_seconds(pid) if pid is not None else 0.0
    t0 = time.perf_counter()
    errors = 0
    room = quote(room_id, safe="")

    async def visible(event_id: str) -> None:
        """Wait until ``event_id`` is the newest event the room's user sees."""
        while True:
            newest = await client.request("GET", f"rooms/{room}/messages?dir=b&limit=1", token=token)
            assert newest.status == 200, newest
            if [e["event_id"] for e in newest.body["chunk"]] == [event_id]:
                return
            assert time.perf_counter() - t0 < timeout, f"{label}: {event_id} never reached /messages"
            await task.deferLater(reactor, 0.02, lambda: None)

    for start in range(0, n, TXN_SIZE):
        answer = await peer.send_transaction(server, destination, f"bench-{label}-{start}",
                                             pdus[start:start + TXN_SIZE], timeout=120)
        errors += sum(1 for r in answer.get("pdus", {}).values() if r.get("error"))
        if paced:
            await visible(ids[min(n, start + TXN_SIZE) - 1])
    answered = time.perf_counter() - t0
    # A server may answer /send before it has persisted the PDUs (Synapse queues them): the clock
    # stops when the last PDU is the newest event the room's user sees.
    await visible(ids[-1])
    elapsed = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0 if pid is not None else None
    pg_cpu = sum(t - pg0.get(b, 0.0) for b, t in backend_cpu_seconds(dsn).items()) if dsn is not None else None
    stop_py_spy(spy, profile)
    rate = n / elapsed
    # Every PDU must be in the room's timeline, in order, for the figure to count.
    messages = await client.request("GET", f"rooms/{room}/messages?dir=b&limit={min(n, 1000)}", token=token)
    assert messages.status == 200, messages
    seen = [e["event_id"] for e in messages.body["chunk"]][::-1]
    in_order = seen == ids[-len(seen):]
    cpu_note = f", server CPU {1e6 * cpu / n:.0f} µs/PDU" if cpu is not None else ""
    if pg_cpu is not None:
        cpu_note += f" (its PostgreSQL backends {1e6 * pg_cpu / n:.0f})"
    if metrics_of is not None:
        txns = db_transactions(metrics_of)
        spent = {name: count - txns0.get(name, 0) for name, count in txns.items()}
        answering = spent.pop("/send", 0.0)
        in_db = spent.pop("db seconds", 0.0)
        db_by_txn = sorted(((spent.pop(name), name[len("db seconds "):]) for name in list(spent)
                            if name.startswith("db seconds ")), reverse=True)[:5]
        print(f"  {label}: time the server spent answering each /send: {1000 * answering / (n / TXN_SIZE):.1f} ms "
              f"(of {1000 * elapsed / (n / TXN_SIZE):.1f} ms per transaction seen by the peer; "
              f"{1000 * in_db / (n / TXN_SIZE):.1f} ms in database transactions, the longest: "
              + ", ".join(f"{name} {1000 * t / (n / TXN_SIZE):.1f}" for t, name in db_by_txn) + ")")
        busiest = sorted(((c, name) for name, c in spent.items() if c), reverse=True)[:8]
        per_send = ", ".join(f"{name} {c / (n / TXN_SIZE):.1f}" for c, name in busiest)
        print(f"  {label}: database transactions per 50-PDU /send: {per_send}")
    print(f"  {label}: {n} PDUs in {n // TXN_SIZE} transactions of {TXN_SIZE}: all answered after {answered:.2f}s, "
          f"the last in /messages after {elapsed:.2f}s: {rate:.0f} PDUs/s{cpu_note}; errors {errors}; "
          f"last {len(seen)} in /messages in order: {in_order}")
    return rate


async def main(args: argparse.Namespace) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        peer = FederationPeer(reactor, request_timeout_seconds=120)
        [server] = await peer.start(1)
        try:
            generous = {"per_second": 100000, "burst_count": 100000}
            tributary = stack.enter_context(running_tributary(
                "", tmp / "tributary", rc_message=generous, rc_joins={"local": generous, "remote": generous}))
            pid = tributary.process.process.pid  # type: ignore[union-attr]
            print(f"load average before: {os.getloadavg()[0]:.2f}")
            ours = await measure(peer, server, tributary.server_name, tributary.client, pid, args.pdus, "tributary",
                                 tributary.process, profile=args.py_spy, members=args.members)
            if args.synapse:
                theirs = await synapse_figure(stack, tmp, peer, server, args.synapse_pdus)
                print(f"  tributary / synapse: {ours / theirs:.1f}x")
            print(f"load average after: {os.getloadavg()[0]:.2f}")
        finally:
            await peer.stop()


async def synapse_figure(stack: ExitStack, tmp: Path, peer: FederationPeer, server: str, n: int) -> float:
    from tests.interop.synapse import SynapseProcess

    python = Path(__file__).resolve().parent.parent / ".venv-synapse" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: `make interop` installs Synapse there")
    synapse = SynapseProcess.configure(python, tmp / "synapse")
    stack.callback(synapse.stop)
    synapse.start()
    assert synapse.process is not None
    return await measure(peer, server, synapse.server_name, Client(synapse.base_url), synapse.process.pid, n,
                         "synapse (paced)", paced=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pdus", type=int, default=5000, help="PDUs sent to Tributary")
    parser.add_argument("--py-spy", metavar="FILE", help="profile Tributary while it takes the PDUs, into FILE")
    parser.add_argument("--members", type=int, default=0,
                        help="members (of the sending server) the room has before the PDUs are sent")
    parser.add_argument("--synapse", action="store_true", help="measure Synapse too (.venv-synapse)")
    parser.add_argument("--synapse-pdus", type=int, default=500, help="PDUs sent to Synapse")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    try:
        run_sync(main(parser.parse_args()), timeout=3600)
    finally:
        reactor.fireSystemEvent("shutdown")
