"""The federation sender in a real ``tributary`` process, against the test federation peer.

The peer (tests/federation_peer.py) stands in for many remote homeservers: each
virtual server checks the X-Matrix signature of every transaction, records what
it received, and can be made to fail in each way a real server does. Backoffs
are shortened in the process's config so the scenarios take seconds.
"""

# tests: federation_sender/sender.py, federation_sender/queue.py, federation_sender/catch_up.py

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs
import psycopg2
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import task
from twisted.internet.defer import Deferred, gatherResults

from tests.conftest import scratch_database
from tests.federation_peer import Behaviour, FederationPeer
from tests.harness import TributaryProcess, free_port
from tests.integration.test_client_e2e import signed_keys
from tests.integration.test_client_support import Client
from tests.twisted_plugin import eventually, reactor, run_sync

FED = {"verify_certificates": False, "ip_range_whitelist": ["127.0.0.0/8"]}
# Short enough that a scenario takes seconds: three failures in a row (0.3 s, then about
# 0.6 s and 1.2 s) cross the catch-up threshold.
SENDER = {
    "transaction_timeout": "1s",
    "backoff": {"initial": "300ms", "max": "5s"},
    "catch_up": {"threshold": "1500ms", "scan_interval": "1s", "wakes_per_second": 100},
    "receipt_delay": "50ms",
}


@attrs.frozen
class Tributary:
    process: TributaryProcess
    server_name: str
    client: Client
    dsn: str

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(sql, args)
            rows = cur.fetchall()
        conn.close()
        return rows

    def metric(self, name: str, **labels: str) -> float:
        status, body = self.process.get("/metrics", port=self.process.metrics_port)
        assert status == 200
        total = 0.0
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total


def configure(tmp_path: Path, dsn: str, **sender: Any) -> tuple[TributaryProcess, str]:
    fed_port = free_port()
    server_name = f"127.0.0.1:{fed_port}"
    proc = TributaryProcess.configure(
        tmp_path, database_url=dsn, server_name=server_name,
        extra={"federation": FED, "log_level": "INFO", "federation_sender": {**SENDER, **sender}},
    )
    config = yaml.safe_load(proc.config_path.read_text())
    config["listeners"].append({"type": "http", "port": fed_port, "tls": True, "resources": ["federation", "keys"]})
    proc.config_path.write_text(yaml.safe_dump(config))
    return proc, server_name


@pytest.fixture(scope="module")
def tributary(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tributary]:
    with scratch_database(postgres_template) as dsn:
        proc, server_name = configure(tmp_path_factory.mktemp("sender"), dsn)
        proc.start()
        try:
            yield Tributary(proc, server_name, Client(proc.base_url), dsn)
        finally:
            assert proc.stop() == 0, proc.output[-5000:]
            assert "Traceback" not in proc.output, proc.output[-20000:]


@pytest.fixture
def peer() -> Iterator[FederationPeer]:
    p = FederationPeer(reactor, request_timeout_seconds=10)
    yield p
    run_sync(p.stop())


class Alice:
    """A local user of the Tributary under test, driving it through the client API."""

    def __init__(self, client: Client, token: str) -> None:
        self.client = client
        self.token = token
        self._txn = itertools.count()

    @classmethod
    async def register(cls, t: Tributary, name: str) -> Alice:
        return cls(t.client, (await t.client.register_ok(name))["access_token"])

    async def create_room(self) -> str:
        created = await self.client.request("POST", "createRoom", {"preset": "public_chat"}, token=self.token)
        assert created.status == 200, created
        return str(created.body["room_id"])

    async def send(self, room_id: str, body: str) -> str:
        response = await self.client.request(
            "PUT", f"rooms/{quote(room_id, safe='')}/send/m.room.message/t{next(self._txn)}",
            {"msgtype": "m.text", "body": body}, token=self.token)
        assert response.status == 200, response
        return str(response.body["event_id"])

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        response = await self.client.request(method, path, body, token=self.token)
        assert response.status == 200, response
        return response.body


def messages(peer: FederationPeer, server: str, room_id: str | None = None) -> list[str]:
    return [event_id for event_id, pdu in zip(peer.received_pdu_ids(server, room_id), peer.received_pdus(server, room_id))
            if pdu["type"] == "m.room.message"]


def destination_row(t: Tributary, server: str) -> tuple[Any, ...] | None:
    rows = t.query("SELECT retry_interval, failure_ts, last_successful_stream_ordering FROM destinations "
                   "WHERE destination = %s", server)
    return rows[0] if rows else None


def backing_off(t: Tributary, server: str) -> bool:
    row = destination_row(t, server)
    return row is not None and (row[0] or 0) > 0


@pytest.fixture
def unhurried(postgres_template: str, tmp_path: Path) -> Iterator[Tributary]:
    """A Tributary of its own whose transactions may take as long as in production
    (``transaction_timeout`` 60 s, the default), for scenarios where every destination is healthy.

    The shared ``tributary`` answers a hung destination within 1 s, which the failure scenarios
    need; but the peer answering twenty servers runs in the test process, verifying a signature
    and hashing every PDU of every transaction, and on a loaded machine it can take longer than
    that to answer a healthy transaction: those failed (and were retried) though nothing was wrong."""
    with scratch_database(postgres_template) as dsn:
        proc, server_name = configure(tmp_path, dsn, transaction_timeout="60s")
        proc.start()
        try:
            yield Tributary(proc, server_name, Client(proc.base_url), dsn)
        finally:
            assert proc.stop() == 0, proc.output[-5000:]
            assert "Traceback" not in proc.output, proc.output[-20000:]


@pytest.mark.timeout(300)
async def test_twenty_destinations_fifty_rooms_every_event_once_in_order(
    unhurried: Tributary, peer: FederationPeer
) -> None:
    """Twenty remote servers share fifty rooms with a local user, each room with about five of
    them. A thousand messages later, every server has received exactly the messages of its
    rooms — each once, in the order they were sent in each room — and nothing of rooms it is
    not in; the transactions carried more than one PDU each on average, and none failed: every
    destination is healthy and may take a minute to answer, so a failure is a real error."""
    tributary = unhurried
    names = await peer.start(20)
    alice = await Alice.register(tributary, "alice20")
    rooms = [await alice.create_room() for _ in range(50)]
    members: dict[str, list[str]] = {room: [n for d, n in enumerate(names) if (r + d) % 4 == 0]
                                     for r, room in enumerate(rooms)}
    for room, servers in members.items():
        for name in servers:
            await peer.join(name, f"@u:{name}", room, via=tributary.server_name)

    sent: dict[str, list[str]] = {room: [] for room in rooms}

    async def send_rooms(chunk: list[str]) -> None:
        for i in range(20):
            for room in chunk:
                sent[room].append(await alice.send(room, f"message {i}"))

    await gatherResults([Deferred.fromCoroutine(send_rooms(rooms[k::8])) for k in range(8)], consumeErrors=True)
    assert sum(len(v) for v in sent.values()) == 1000

    for name in names:
        expected = [e for room in rooms if name in members[room] for e in sent[room]]
        await peer.wait_for_pdus(name, expected, timeout=60)
    total_pdus = total_txns = 0
    for name in names:
        mine = [room for room in rooms if name in members[room]]
        for room in mine:
            assert messages(peer, name, room) == sent[room], f"{name} got {room} out of order or incompletely"
        assert set(messages(peer, name)) == {e for room in mine for e in sent[room]}, "messages of other rooms"
        assert {pdu["room_id"] for pdu in peer.received_pdus(name)} <= set(mine)
        assert not peer.duplicate_pdu_ids(name), name
        txns = peer.transactions(name)
        assert all(not t.pdu_errors for t in txns)
        total_pdus += sum(len(t.pdus) for t in txns)
        total_txns += len(txns)
    assert total_txns < total_pdus, f"{total_txns} transactions for {total_pdus} PDUs: nothing batched"
    failed = tributary.metric("tributary_federation_sender_transactions_total", outcome="failed")
    if failed:
        log = tributary.process.log_path.read_text(encoding="utf-8", errors="replace")
        raise AssertionError(f"{failed:.0f} transactions to healthy destinations failed:\n"
                             + "\n".join(line for line in log.splitlines() if " failed (" in line)[-5000:])


@pytest.mark.timeout(120)
async def test_down_then_up_within_the_threshold(tributary: Tributary, peer: FederationPeer) -> None:
    """One destination answers 500 while two messages are sent: it backs off (recorded in
    `destinations`), the other destination is not held up. Once it answers again it gets both
    (the retried transaction) and a new one, in order, each once. An inbound request from a
    destination clears its backoff at once."""
    down, healthy = await peer.start(2)
    alice = await Alice.register(tributary, "alice_updown")
    room = await alice.create_room()
    for name in (down, healthy):
        await peer.join(name, f"@u:{name}", room, via=tributary.server_name)
    await peer.set_behaviour(down, Behaviour.ERROR_500)
    missed = [await alice.send(room, f"while down {i}") for i in range(2)]
    await peer.wait_for_pdus(healthy, missed, timeout=10)
    await eventually(lambda: backing_off(tributary, down), what="backoff recorded")
    row = destination_row(tributary, down)
    assert row is not None and row[1] is not None, "failure_ts records when it went down"

    await peer.set_behaviour(down, Behaviour.OK)
    later = await alice.send(room, "after")
    await peer.wait_for_pdus(down, [*missed, later], timeout=15)
    assert messages(peer, down, room) == [*missed, later]
    assert not peer.duplicate_pdu_ids(down)
    await eventually(lambda: not backing_off(tributary, down), what="backoff cleared")

    # Down again; this time the destination itself says it is back with a request of its own.
    await peer.set_behaviour(down, Behaviour.ERROR_500)
    third = await alice.send(room, "down again")
    await eventually(lambda: backing_off(tributary, down), what="backoff recorded again")
    await peer.set_behaviour(down, Behaviour.OK)
    await peer.send_transaction(down, tributary.server_name, "hello", edus=[])
    await eventually(lambda: not backing_off(tributary, down), timeout=5, what="inbound request clears backoff")
    await peer.wait_for_pdus(down, [third], timeout=10)


@pytest.mark.timeout(120)
async def test_down_past_the_threshold_catches_up_with_missed_events_and_to_device_first(
    tributary: Tributary, peer: FederationPeer
) -> None:
    """A destination is unreachable (port closed) long enough to back off past the catch-up
    threshold: its queue is dropped and it enters catch-up. Meanwhile 60 rooms get 3 messages
    each. When it comes back, catch-up sends every missed message — oldest first in each room,
    so the receiver would need no get_missing_events — and a to-device message sent during the
    outage arrives in the first transaction, not after catch-up's many."""
    name, = await peer.start(1)
    alice = await Alice.register(tributary, "alice_catchup")
    rooms = [await alice.create_room() for _ in range(60)]
    for room in rooms:
        await peer.join(name, f"@u:{name}", room, via=tributary.server_name)
    entered = tributary.metric("tributary_federation_sender_catch_up_entered_total", reason="backoff")
    await peer.set_behaviour(name, Behaviour.DOWN)
    sent = {room: [await alice.send(room, f"m{i}") for i in range(3)] for room in rooms}
    await eventually(
        lambda: tributary.metric("tributary_federation_sender_catch_up_entered_total", reason="backoff") > entered,
        timeout=30, what="catch-up entered")
    await alice.call("PUT", "sendToDevice/m.test.ping/td1", {"messages": {f"@u:{name}": {"DEV": {"ping": 1}}}})
    before = len(peer.transactions(name))

    await peer.set_behaviour(name, Behaviour.OK)
    await peer.wait_for_pdus(name, [e for events in sent.values() for e in events], timeout=30)
    for room in rooms:
        assert messages(peer, name, room)[-3:] == sent[room]
    txns = peer.transactions(name)[before:]
    carrying = [i for i, t in enumerate(txns) if any(e.get("edu_type") == "m.direct_to_device" for e in t.edus)]
    assert carrying == [0], f"to-device message in transactions {carrying} of {len(txns)}"
    edu = peer.received_edus(name, "m.direct_to_device")[0]["content"]
    assert edu["messages"] == {f"@u:{name}": {"DEV": {"ping": 1}}} and edu["sender"].startswith("@alice_catchup:")
    assert len(txns) > 1, "catch-up took one transaction: the to-device check proves nothing"
    assert tributary.query("SELECT count(*) FROM device_federation_outbox WHERE destination = %s", name) == [(0,)]
    # The last answer may still be on its way back to the sender when the peer has the PDUs.
    await eventually(lambda: tributary.metric("tributary_federation_sender_catch_up_pdus_sent_total") >= 180,
                     what="catch-up PDUs counted")


@pytest.mark.timeout(120)
async def test_failing_destinations_back_off_without_holding_up_others(
    tributary: Tributary, peer: FederationPeer
) -> None:
    """Five destinations in one room answer 500, time out, close the connection, refuse the
    request (400) and report per-PDU errors; a sixth is healthy. The healthy one gets every
    message at once. The first three back off (recorded in `destinations`); a 400 is dropped
    without backoff; per-PDU errors are stored and never retried."""
    err500, hang, close, bad, pdu_errors, healthy = await peer.start(6)
    alice = await Alice.register(tributary, "alice_failures")
    room = await alice.create_room()
    for name in (err500, hang, close, bad, pdu_errors, healthy):
        await peer.join(name, f"@u:{name}", room, via=tributary.server_name)
    behaviours = {err500: Behaviour.ERROR_500, hang: Behaviour.HANG, close: Behaviour.CLOSE,
                  bad: Behaviour.BAD_REQUEST_400, pdu_errors: Behaviour.PDU_ERRORS}
    for name, behaviour in behaviours.items():
        await peer.set_behaviour(name, behaviour)
    sent = [await alice.send(room, f"m{i}") for i in range(3)]
    await peer.wait_for_pdus(healthy, sent, timeout=5)

    # Membership events of the later joins may still be on their way to a destination when its
    # behaviour changes; only this test's messages are counted.
    def refused_ids() -> list[str]:  # PDUs the peer answered with an error (it records them as not received)
        return [e for t in peer.transactions(pdu_errors) if t.pdu_errors for e in t.pdu_ids if e in counted]

    counted = set(sent)

    for name in (err500, hang, close):
        await eventually(lambda: backing_off(tributary, name), timeout=15, what=f"{name} backing off")
    await eventually(lambda: tributary.query(
        "SELECT count(*) FROM destination_pdu_errors WHERE destination = %s AND event_id = ANY(%s)",
        pdu_errors, sent) == [(len(sent),)],
        what="per-PDU errors stored")
    assert not backing_off(tributary, pdu_errors)
    assert not backing_off(tributary, bad)
    assert not backing_off(tributary, healthy)
    sends_to_bad = peer.request_counts(bad)["send"]
    extra = await alice.send(room, "one more")
    counted.add(extra)
    await peer.wait_for_pdus(healthy, [extra], timeout=5)
    await eventually(lambda: extra in refused_ids(), what="the next message sent to the refusing destination")
    assert sorted(refused_ids()) == sorted([*sent, extra]), "a PDU the destination refused is not retried"
    await eventually(lambda: peer.request_counts(bad)["send"] > sends_to_bad, what="400 did not stop sending")
    for name in (err500, hang, close, bad, pdu_errors):  # leave no failing destination behind
        await peer.set_behaviour(name, Behaviour.OK)


@pytest.mark.timeout(180)
async def test_sigkill_mid_transaction_then_restart_resumes_from_the_last_acknowledged(
    postgres_template: str, tmp_path: Path, peer: FederationPeer
) -> None:
    """The destination holds a transaction open; the sender process is killed with SIGKILL
    while it waits. Restarted, the sender finds the destination behind in `destination_rooms`,
    catches it up from `last_successful_stream_ordering`, and every message arrives; whatever
    arrives twice (the interrupted transaction) the receiver can drop by event ID. A to-device
    message accepted before the kill arrives too, with the message ID it was given when accepted."""
    name, = await peer.start(1)
    with scratch_database(postgres_template) as dsn:
        proc, server_name = configure(tmp_path, dsn, transaction_timeout="60s")
        proc.start()
        t = Tributary(proc, server_name, Client(proc.base_url), dsn)
        try:
            alice = await Alice.register(t, "alice_kill")
            rooms = [await alice.create_room() for _ in range(3)]
            for room in rooms:
                await peer.join(name, f"@u:{name}", room, via=server_name)
            first = await alice.send(rooms[0], "before")
            await peer.wait_for_pdus(name, [first], timeout=10)
            await peer.set_behaviour(name, Behaviour.HANG)
            sent = [await alice.send(room, f"m{i}") for i in range(4) for room in rooms]
            # A to-device message accepted (200) while the destination hangs: the kill must not lose it.
            await alice.call("PUT", "sendToDevice/m.test.kill/td-kill", {"messages": {f"@u:{name}": {"DEV": {"n": 1}}}})
            await eventually(lambda: peer.held_requests(name) > 0, what="a transaction held")
            proc.stop(signal.SIGKILL)
            await peer.set_behaviour(name, Behaviour.OK)
            proc.start()
            await peer.wait_for_pdus(name, sent, timeout=30)
            await eventually(lambda: any(e["content"]["type"] == "m.test.kill"
                                         for e in peer.received_edus(name, "m.direct_to_device")),
                             what="the to-device message delivered after the restart")
            to_device = [e["content"] for e in peer.received_edus(name, "m.direct_to_device")
                         if e["content"]["type"] == "m.test.kill"]
            # Delivered, possibly twice (the interrupted transaction), always with one message ID.
            assert {c["message_id"] for c in to_device} == {to_device[0]["message_id"]}
            assert to_device[0]["messages"] == {f"@u:{name}": {"DEV": {"n": 1}}}
            for room in rooms:
                room_sent = [e for e in sent if e in set(messages(peer, name, room))]
                assert room_sent and messages(peer, name, room)[-len(room_sent):] == room_sent
            row = destination_row(t, name)
            assert row is not None and row[2] is not None
            last = t.query("SELECT max(stream_ordering) FROM events WHERE event_id = ANY(%s)", sent)[0][0]
            await eventually(lambda: (destination_row(t, name) or (0, 0, 0))[2] >= last, what="position advanced")
        finally:
            proc.stop()


@pytest.mark.timeout(240)
async def test_receiving_tributary_down_past_the_threshold_ends_with_every_message_without_fetching(
    postgres_template: str, tmp_path: Path
) -> None:
    """Two real Tributary processes. Bob on B joins five of Alice's rooms on A through the client
    API. B is stopped; Alice sends ten messages in each room; A backs off past the threshold and
    drops its queue. B starts again: A's catch-up sends each room's missed messages oldest first,
    Bob's /sync on B shows all fifty, and B never had to ask A for missing events."""
    with scratch_database(postgres_template) as dsn_a, scratch_database(postgres_template) as dsn_b:
        proc_a, name_a = configure(tmp_path / "a", dsn_a)
        proc_b, name_b = configure(tmp_path / "b", dsn_b)
        a = Tributary(proc_a, name_a, Client(proc_a.base_url), dsn_a)
        b = Tributary(proc_b, name_b, Client(proc_b.base_url), dsn_b)
        proc_a.start()
        proc_b.start()
        try:
            alice = await Alice.register(a, "alice")
            bob = await Alice.register(b, "bob")
            rooms = [await alice.create_room() for _ in range(5)]
            for room in rooms:
                await bob.call("POST", f"join/{quote(room, safe='')}?server_name={quote(name_a)}", {})
            hello = [await alice.send(room, "hello") for room in rooms]
            await eventually(lambda: b.query("SELECT count(*) FROM events WHERE event_id = ANY(%s)", hello) == [(5,)],
                             what="B has the first messages")

            assert proc_b.stop() == 0, proc_b.output[-3000:]
            entered = a.metric("tributary_federation_sender_catch_up_entered_total", reason="backoff")
            sent = {room: [await alice.send(room, f"missed {i}") for i in range(10)] for room in rooms}
            await eventually(
                lambda: a.metric("tributary_federation_sender_catch_up_entered_total", reason="backoff") > entered,
                timeout=30, what="A drops its queue for B and catches up")
            fetches = a.metric("tributary_http_requests_total", servlet="federation_get_missing_events")

            proc_b.start()
            wanted = {e for events in sent.values() for e in events}

            async def bob_sees_all() -> bool:
                sync = await bob.call("GET", "sync?filter=" + quote('{"room":{"timeline":{"limit":50}}}'))
                seen = {ev["event_id"] for room in sync["rooms"]["join"].values()
                        for ev in room["timeline"]["events"]}
                return wanted <= seen

            for _ in range(400):
                if await bob_sees_all():
                    break
                await task.deferLater(reactor, 0.05, lambda: None)
            else:
                raise AssertionError("Bob's /sync on B never showed every missed message")
            assert a.metric("tributary_http_requests_total", servlet="federation_get_missing_events") == fetches
        finally:
            proc_b.stop()
            proc_a.stop()


@pytest.mark.timeout(120)
async def test_local_users_typing_receipts_presence_and_keys_reach_the_room_s_servers(
    tributary: Tributary, peer: FederationPeer
) -> None:
    """Alice types, reads, changes presence and uploads device keys: each reaches the servers
    in her room as the matching EDU (receipts batched per room); private receipts do not."""
    name, = await peer.start(1)
    alice = await Alice.register(tributary, "alice_edus")
    room = await alice.create_room()
    await peer.join(name, f"@u:{name}", room, via=tributary.server_name)
    event_id = await alice.send(room, "read me")
    await peer.wait_for_pdus(name, [event_id], timeout=10)
    user_id = (await alice.call("GET", "account/whoami"))["user_id"]
    room_path = quote(room, safe="")
    await alice.call("PUT", f"rooms/{room_path}/typing/{quote(user_id)}", {"typing": True, "timeout": 30000})
    await alice.call("POST", f"rooms/{room_path}/receipt/m.read.private/{quote(event_id)}", {})
    await alice.call("POST", f"rooms/{room_path}/receipt/m.read/{quote(event_id)}", {})
    await alice.call("PUT", f"presence/{quote(user_id)}/status", {"presence": "online", "status_msg": "here"})
    device_id = (await alice.call("GET", "account/whoami"))["device_id"]
    keys = signed_keys(user_id, device_id)
    await alice.call("POST", "keys/upload", {"device_keys": keys})

    def edus(edu_type: str) -> list[dict[str, Any]]:
        return [e["content"] for e in peer.received_edus(name, edu_type)]

    await eventually(lambda: edus("m.typing") and edus("m.receipt") and edus("m.presence")
                     and edus("m.device_list_update"), what="all four EDU types")
    assert edus("m.typing")[-1] == {"room_id": room, "user_id": user_id, "typing": True}
    receipts = [r for content in edus("m.receipt") for r in content[room].items()]
    assert [kind for kind, _ in receipts] == ["m.read"], "private receipts stay on this server"
    assert receipts[0][1][user_id]["event_ids"] == [event_id]
    push = edus("m.presence")[-1]["push"][0]
    assert push["user_id"] == user_id and push["presence"] == "online" and push["status_msg"] == "here"
    update = edus("m.device_list_update")[-1]
    assert update["user_id"] == user_id and update["device_id"] == device_id and update["keys"] == keys
    assert update["deleted"] is False and isinstance(update["stream_id"], int)
    # A rename is the user's next change: its prev_id is the upload's stream_id.
    await alice.call("PUT", f"devices/{quote(device_id)}", {"display_name": "laptop"})
    await eventually(lambda: len(edus("m.device_list_update")) >= 2, what="the rename's update")
    renamed = edus("m.device_list_update")[-1]
    assert renamed["prev_id"] == [update["stream_id"]] and renamed["stream_id"] > update["stream_id"]
    assert renamed["device_display_name"] == "laptop" and renamed["keys"] == keys
