"""Worker processes end to end: main + 2 event persisters + a generic worker + a federation
sender, all real processes on real PostgreSQL and Redis, and a second real homeserver.

Two local users send 1,000 messages in 10 rooms through the generic worker while both
follow /sync there; one event persister is SIGKILLed in the middle and restarted. Every
send that returned 200 is stored once, each user's /sync showed every message exactly once
and in send order, and the second homeserver (whose user joined every room) got them all.
Then the generic worker and the federation sender restart and catch up from where they were.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs
import nio
import psycopg2
import pytest
import yaml

from tests.conftest import scratch_database
from tests.harness import Nginx, TributaryProcess, configure_workers, run_cli
from tests.observability import sample, samples, scrape
from tests.integration.test_client_e2e import signed_keys
from homeserver.routing.layout import stable_shard

class Http:
    def __init__(self, port: int, token: str | None = None) -> None:
        self.port = port
        self.token = token

    def call(self, method: str, path: str, body: Any = None, *, timeout: float = 60) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/_matrix/client/v3/{path}", method=method,
            data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw or b"{}")
            except ValueError:  # nginx's own error pages (502 while a worker is down) are HTML
                return e.code, {"raw": raw.decode("utf-8", "replace")}
        except (ConnectionError, urllib.error.URLError, TimeoutError) as e:
            return 599, {"error": str(e)}

    def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, answer = self.call(method, path, body)
        assert status == 200, (method, path, status, answer)
        return answer


def register(port: int, name: str) -> tuple[str, str]:
    answer = Http(port).ok("POST", "register", {"username": name, "password": "correct horse",
                                                "auth": {"type": "m.login.dummy"}})
    return answer["user_id"], answer["access_token"]


class SyncFollower(threading.Thread):
    """Follows one user's /sync on the generic worker; records every timeline event once seen."""

    def __init__(self, http: Http) -> None:
        super().__init__(daemon=True)
        self.http = http
        self.seen: list[tuple[str, str, str]] = []  # (room, event_id, body)
        self.tokens: list[str] = []
        self.limited = 0
        self.stop_flag = threading.Event()
        self.errors: list[Any] = []

    def run(self) -> None:
        flt = quote(json.dumps({"room": {"timeline": {"limit": 1000}}}))
        since = None
        while not self.stop_flag.is_set():
            query = f"sync?timeout=1000&filter={flt}" + (f"&since={since}" if since else "")
            status, answer = self.http.call("GET", query)
            if status != 200:
                self.errors.append((status, answer))
                time.sleep(0.2)
                continue
            for room_id, room in answer.get("rooms", {}).get("join", {}).items():
                timeline = room.get("timeline", {})
                if timeline.get("limited") and since is not None:
                    self.limited += 1
                for event in timeline.get("events", []):
                    if event.get("type") == "m.room.message":
                        self.seen.append((room_id, event["event_id"], event["content"]["body"]))
            since = answer["next_batch"]
            self.tokens.append(since)


async def nio_round_trip(base_url: str, room_id: str) -> None:
    alice, carol = nio.AsyncClient(base_url, "alice"), nio.AsyncClient(base_url, "carol")
    try:
        for client in (alice, carol):
            logged_in = await client.login("correct horse", device_name="nio through nginx")
            assert isinstance(logged_in, nio.LoginResponse), logged_in
            synced = await client.sync(timeout=0, full_state=True)
            assert isinstance(synced, nio.SyncResponse), synced
            assert room_id in synced.rooms.join
        sent = await alice.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": "from nio"})
        assert isinstance(sent, nio.RoomSendResponse), sent
        deadline = time.monotonic() + 20
        seen: list[str] = []
        while sent.event_id not in seen:
            assert time.monotonic() < deadline, "carol's nio client never saw the message"
            synced = await carol.sync(timeout=3000)
            assert isinstance(synced, nio.SyncResponse), synced
            room = synced.rooms.join.get(room_id)
            seen.extend(event.event_id for event in (room.timeline.events if room else []))
    finally:
        await alice.close()
        await carol.close()


@pytest.mark.timeout(400)
def test_workers_deliver_every_message_once_through_a_persister_crash_and_restarts(
    postgres_template: str, redis_url: str, tmp_path: Path
) -> None:
    with scratch_database(postgres_template) as dsn, scratch_database(postgres_template) as dsn_b:
        # The generic worker writes typing: its EDUs reach other servers through the main process.
        main, workers, generic_port = configure_workers(tmp_path / "a", dsn, redis_url,
                                                        stream_writers={"typing": ["g1"]}, background=True)
        remote = TributaryProcess.configure_federating(tmp_path / "b", database_url=dsn_b)
        nginx = Nginx.for_workers(tmp_path / "nginx", main_port=main.client_port, generic_port=generic_port)
        processes = [main, *workers.values(), remote]
        try:
            for process in processes:
                process.start()
            nginx.start()
            # Clients talk to nginx, which routes each endpoint to its kind of process.
            front = nginx.port
            name_a = main.server_name
            # The internal API refuses requests without the shared secret, and runs nothing.
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                url = f"http://127.0.0.1:{workers['p1'].client_port}/_tributary/replication/send_event"
                request = urllib.request.Request(url, method="POST", data=b'{"room_id": "!x:y"}', headers=headers)
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(request, timeout=10)
                assert refused.value.code == 403
                assert json.loads(refused.value.read())["errcode"] == "M_FORBIDDEN"
            # With the secret, a malformed body is a 400, never a 500.
            url = f"http://127.0.0.1:{workers['p1'].client_port}/_tributary/replication/send_event"
            request = urllib.request.Request(url, method="POST", data=b'{"sender": 5}',
                                             headers={"Authorization": "Bearer a shared secret"})
            with pytest.raises(urllib.error.HTTPError) as malformed:
                urllib.request.urlopen(request, timeout=10)
            assert malformed.value.code == 400
            assert json.loads(malformed.value.read())["errcode"] == "M_BAD_JSON"
            # Writes that only the main process makes are not served by the generic worker.
            status, answer = Http(generic_port).call("POST", "register", {})
            assert (status, answer["errcode"]) == (404, "M_UNRECOGNIZED")
            alice_id, alice_token = register(front, "alice")
            carol_id, carol_token = register(front, "carol")
            bob_id, bob_token = register(remote.client_port, "bob")
            alice, carol = Http(front, alice_token), Http(front, carol_token)
            status, _ = alice.call("POST", "../../../_tributary/replication/send_event", {})
            assert status == 404  # nginx never lets the internal API out
            bob = Http(remote.client_port, bob_token)

            # Rooms are created through the generic worker; each belongs to p1 or p2 by hash.
            rooms = [alice.ok("POST", "createRoom", {"preset": "public_chat"})["room_id"] for _ in range(10)]
            for room in rooms:
                carol.ok("POST", f"join/{quote(room, safe='')}", {})
                bob.ok("POST", f"join/{quote(room, safe='')}?server_name={quote(name_a)}", {})

            # The user directory is kept by the background worker from the events stream (written
            # by the persisters, read over replication); the generic worker's search reads it.
            deadline = time.monotonic() + 20
            while True:
                found = alice.ok("POST", "user_directory/search", {"search_term": "bob"})["results"]
                if [r["user_id"] for r in found] == [bob_id]:
                    break
                assert time.monotonic() < deadline, f"Bob never reached the user directory: {found}"
                time.sleep(0.2)

            # Carol's long-poll on the generic worker sleeps through messages, typing and receipts
            # in a room she is not in and through Alice's account data and to-device messages (the
            # rows of other writers are noted there), and wakes for a message in her room: each
            # computation counts in tributary_sync_duration_seconds.
            lonely = alice.ok("POST", "createRoom", {"preset": "public_chat"})["room_id"]
            mark = carol.ok("GET", "sync?timeout=0")["next_batch"]
            deadline = time.monotonic() + 10
            while True:  # her own presence (online: she syncs) comes first
                quiet = carol.ok("GET", f"sync?since={mark}&timeout=500")
                mark = quiet["next_batch"]
                if not quiet["presence"]["events"] and not quiet["rooms"]["join"]:
                    break
                assert time.monotonic() < deadline, f"Carol's /sync never went quiet: {quiet}"

            g1_listeners = yaml.safe_load(main.config_path.read_text(encoding="utf-8"))["workers"]["g1"]["listeners"]
            g1_metrics = attrs.evolve(workers["g1"], metrics_port=next(
                listener["port"] for listener in g1_listeners if listener["type"] == "metrics"))

            def incremental_syncs() -> float:
                return sample(samples(scrape(g1_metrics)), "tributary_sync_duration_seconds_count", kind="incremental")

            answers: list[Any] = []
            poll = threading.Thread(target=lambda: answers.append(carol.ok("GET", f"sync?since={mark}&timeout=20000")))
            poll.start()
            deadline = time.monotonic() + 10
            while sample(samples(scrape(g1_metrics)), "tributary_sync_long_polls_active") < 1:
                assert time.monotonic() < deadline and poll.is_alive(), f"Carol's /sync never waited on g1: {answers}"
                time.sleep(0.05)
            computed = incremental_syncs()
            for i in range(5):
                last = alice.ok("PUT", f"rooms/{quote(lonely, safe='')}/send/m.room.message/lonely-{i}",
                                {"body": str(i)})["event_id"]
            # Typing (written by the generic worker itself) and a receipt (the main process's,
            # over replication) in that room: no wake either.
            alice.ok("PUT", f"rooms/{quote(lonely, safe='')}/typing/{quote(alice_id)}", {"typing": True, "timeout": 30000})
            alice.ok("POST", f"rooms/{quote(lonely, safe='')}/receipt/m.read/{quote(last)}", {})
            # Alice's account data and a to-device message to her (the main process's): no wake.
            alice.ok("PUT", f"user/{quote(alice_id)}/account_data/org.example.a", {"a": 1})
            alice.ok("PUT", "sendToDevice/org.example.d/w1", {"messages": {alice_id: {"*": {"d": 1}}}})
            time.sleep(0.5)  # the rows reach the generic worker
            assert incremental_syncs() == computed and poll.is_alive()
            wake = alice.ok("PUT", f"rooms/{quote(rooms[2], safe='')}/send/m.room.message/wake", {"body": "w"})
            poll.join(timeout=20)
            timeline = answers[0]["rooms"]["join"][rooms[2]]["timeline"]["events"]
            assert [e["event_id"] for e in timeline] == [wake["event_id"]] and lonely not in answers[0]["rooms"]["join"]

            # Typing written by the generic worker reaches Bob on the other server.
            alice.ok("PUT", f"rooms/{quote(rooms[0], safe='')}/typing/{quote(alice_id)}",
                     {"typing": True, "timeout": 30000})
            deadline = time.monotonic() + 20
            since = None
            while True:
                status, synced = bob.call("GET", "sync?timeout=1000" + (f"&since={since}" if since else ""))
                assert status == 200, synced
                since = synced["next_batch"]
                ephemeral = synced.get("rooms", {}).get("join", {}).get(rooms[0], {}).get("ephemeral", {})
                if any(alice_id in e["content"].get("user_ids", []) for e in ephemeral.get("events", [])):
                    break
                assert time.monotonic() < deadline, "Alice's typing never reached the other server"

            # Device lists in the worker layout: keys/upload goes to the main process, which writes
            # the device_lists stream; Carol's /sync and key query on the generic worker see it, and
            # so does Bob on the other server (an m.device_list_update, then a key query over
            # federation). Key backup is served by the generic worker.
            carol_mark = carol.ok("GET", "sync?timeout=0")["next_batch"]
            bob_mark = bob.ok("GET", "sync?timeout=0")["next_batch"]
            alice_device = alice.ok("GET", "account/whoami")["device_id"]
            alice.ok("POST", "keys/upload", {"device_keys": signed_keys(alice_id, alice_device)})
            for who, mark in ((carol, carol_mark), (bob, bob_mark)):
                deadline = time.monotonic() + 20
                while alice_id not in who.ok("GET", f"sync?timeout=1000&since={mark}")["device_lists"]["changed"]:
                    assert time.monotonic() < deadline, "Alice's new keys never reached /sync"
                queried = who.ok("POST", "keys/query", {"device_keys": {alice_id: []}})
                assert alice_device in queried["device_keys"][alice_id], queried
            version = carol.ok("POST", "room_keys/version", {"algorithm": "m.megolm_backup.v1", "auth_data": {}})
            assert carol.ok("GET", "room_keys/version")["version"] == version["version"]

            # The older endpoints, through nginx to the generic worker (and on it directly): a
            # POST send without a txnId reaches carol's /events from her /sync token, and both
            # initialSyncs show it.
            mark = carol.ok("GET", "sync?timeout=0")["next_batch"]
            room0 = quote(rooms[0], safe="")
            legacy = alice.ok("POST", f"rooms/{room0}/send/m.room.message", {"msgtype": "m.text", "body": "old"})
            streamed_ids: list[str] = []
            deadline = time.monotonic() + 20
            while legacy["event_id"] not in streamed_ids:  # a client follows the stream the same way
                assert time.monotonic() < deadline, "the POSTed message never reached /events"
                streamed = carol.ok("GET", f"events?from={mark}&timeout=10000")
                streamed_ids.extend(e.get("event_id") for e in streamed["chunk"] if "event_id" in e)
                mark = streamed["end"]
            direct = Http(generic_port, carol_token)
            snapshot = direct.ok("GET", f"rooms/{room0}/initialSync?limit=1")
            assert [e["event_id"] for e in snapshot["messages"]["chunk"]] == [legacy["event_id"]]
            everything = carol.ok("GET", "initialSync?limit=1")
            assert {r["room_id"] for r in everything["rooms"]} == set(rooms)

            followers = {"alice": SyncFollower(alice), "carol": SyncFollower(carol)}
            for follower in followers.values():
                follower.start()

            sent: dict[str, list[tuple[str, str, str]]] = {"alice": [], "carol": []}

            def send_all(who: str, http: Http) -> None:
                for i in range(500):
                    room = rooms[i % len(rooms)]
                    body, txn = f"{who} {i}", f"{who}-{i}"
                    deadline = time.monotonic() + 60
                    while True:  # a client retries with the same transaction ID until it gets an answer
                        status, answer = http.call(
                            "PUT", f"rooms/{quote(room, safe='')}/send/m.room.message/{txn}",
                            {"msgtype": "m.text", "body": body})
                        if status == 200:
                            sent[who].append((room, answer["event_id"], body))
                            break
                        assert time.monotonic() < deadline, (status, answer)
                        time.sleep(0.1)

            senders = [threading.Thread(target=send_all, args=(who, http)) for who, http in
                       (("alice", alice), ("carol", carol))]
            for thread in senders:
                thread.start()
            while len(sent["alice"]) + len(sent["carol"]) < 300:
                time.sleep(0.05)
            workers["p1"].stop(signal.SIGKILL)
            # While p1 is down, the rooms of p2 carry on: /sync tokens are vector clocks, so the
            # generic worker does not wait for p1's position to serve p2's events.
            p2_room = next(room for room in rooms if stable_shard(room, ["p1", "p2"]) == "p2")
            outage_id = alice.ok("PUT", f"rooms/{quote(p2_room, safe='')}/send/m.room.message/outage",
                                 {"msgtype": "m.text", "body": "outage"})["event_id"]
            deadline = time.monotonic() + 15
            while not all(outage_id in {e for _, e, _ in f.seen} for f in followers.values()):
                assert time.monotonic() < deadline, "p2's room stalled while p1 was down"
                time.sleep(0.05)
            workers["p1"].start()
            for thread in senders:
                thread.join(timeout=300)
            assert len(sent["alice"]) == len(sent["carol"]) == 500

            all_sent = {event_id for messages in sent.values() for _, event_id, _ in messages}
            assert len(all_sent) == 1000  # no two sends share an event

            def follower_done() -> bool:
                return all(len({e for _, e, _ in f.seen} & all_sent) == 1000 for f in followers.values())

            deadline = time.monotonic() + 60
            while not follower_done():
                assert time.monotonic() < deadline, {k: len(f.seen) for k, f in followers.items()}
                time.sleep(0.2)
            for follower in followers.values():
                follower.stop_flag.set()
                follower.join(timeout=10)
                ids = [event_id for _, event_id, _ in follower.seen]
                assert len(ids) == len(set(ids)), "an event reached /sync twice"
                assert follower.limited == 0
                assert any(token.startswith("m") for token in follower.tokens), "no vector-clock token was issued"
                # In each room, each sender's messages arrive in the order they were sent.
                for who, messages in sent.items():
                    for room in rooms:
                        expected = [body for r, _, body in messages if r == room]
                        seen = [body for r, _, body in follower.seen if r == room and body.startswith(who + " ")]
                        assert seen == expected

            # Every message is stored exactly once, by the persister that owns its room.
            with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
                cur.execute("SELECT event_id, instance_name FROM events WHERE event_id = ANY(%s)", (list(all_sent),))
                stored = cur.fetchall()
            assert len(stored) == 1000
            assert {instance for _, instance in stored} == {"p1", "p2"}

            # The second homeserver, through the federation sender worker, has every message.
            def remote_count() -> int:
                with psycopg2.connect(dsn_b) as conn, conn.cursor() as cur:
                    cur.execute("SELECT count(*) FROM events WHERE event_id = ANY(%s)", (list(all_sent),))
                    return int(cur.fetchone()[0])

            deadline = time.monotonic() + 120
            while remote_count() < 1000:
                assert time.monotonic() < deadline, f"the second homeserver has {remote_count()} of 1000"
                time.sleep(0.5)

            # An invite from the other server to a room this server is not in: the main process
            # takes PUT /invite, an event persister records it, Alice's /sync (generic worker) shows it.
            since_invite = alice.ok("GET", "sync?timeout=0")["next_batch"]
            remote_room = bob.ok("POST", "createRoom", {"preset": "private_chat"})["room_id"]
            bob.ok("POST", f"rooms/{quote(remote_room, safe='')}/invite", {"user_id": alice_id})
            deadline = time.monotonic() + 20
            while True:  # other changes (presence, typing expiry) may wake a long-poll first
                synced = alice.ok("GET", f"sync?timeout=5000&since={since_invite}")
                since_invite = synced["next_batch"]
                if remote_room in synced["rooms"]["invite"]:
                    break
                assert time.monotonic() < deadline, "the remote invite never reached Alice's /sync"

            # A sync token issued before the restarts stays valid; the generic worker and the
            # federation sender restart and catch up from their last positions.
            token = followers["alice"].tokens[-1]
            # Syncing through the generic worker made Alice online (USER_SYNC to the presence
            # writer); the worker shutting down clears its users (CLEAR_USER_SYNC): offline.
            main_alice = Http(main.client_port, alice_token)
            assert main_alice.ok("GET", f"presence/{quote(alice_id)}/status")["presence"] == "online"
            workers["g1"].stop()
            deadline = time.monotonic() + 10
            while main_alice.ok("GET", f"presence/{quote(alice_id)}/status")["presence"] != "offline":
                assert time.monotonic() < deadline, "CLEAR_USER_SYNC did not take Alice offline"
                time.sleep(0.1)
            workers["fs1"].stop()
            after = [alice.call("PUT", f"rooms/{quote(rooms[0], safe='')}/send/m.room.message/late-{i}",
                                {"msgtype": "m.text", "body": f"late {i}"}) for i in range(5)]
            assert all(status == 502 for status, _ in after)  # the generic worker is down
            late = [main_alice.ok("PUT", f"rooms/{quote(rooms[0], safe='')}/send/m.room.message/late-{i}",
                                  {"msgtype": "m.text", "body": f"late {i}"})["event_id"] for i in range(5)]
            workers["g1"].start()
            workers["fs1"].start()
            flt = quote(json.dumps({"room": {"timeline": {"limit": 100}}}))
            answer = alice.ok("GET", f"sync?since={token}&timeout=10000&filter={flt}")
            timeline = answer["rooms"]["join"][rooms[0]]["timeline"]["events"]
            assert [e["event_id"] for e in timeline if e["type"] == "m.room.message"] == late
            deadline = time.monotonic() + 60
            while True:
                with psycopg2.connect(dsn_b) as conn, conn.cursor() as cur:
                    cur.execute("SELECT count(*) FROM events WHERE event_id = ANY(%s)", (late,))
                    if cur.fetchone()[0] == 5:
                        break
                assert time.monotonic() < deadline, "the restarted federation sender did not send what it missed"
                time.sleep(0.5)
            # A real client library, unmodified, through nginx: matrix-nio logs in (main process),
            # syncs and sends (generic worker, event persister), and another nio client sees it.
            asyncio.run(nio_round_trip(f"http://127.0.0.1:{front}", rooms[0]))

            # A redaction from the other server: the room's event persister stores it, the generic
            # worker (which has read and cached the target) serves the target pruned as soon as the
            # redaction is in the database: recorded by the same transaction, nothing to wait for.
            quoted_room = quote(rooms[1], safe="")
            target = bob.ok("PUT", f"rooms/{quoted_room}/send/m.room.message/to-redact",
                            {"msgtype": "m.text", "body": "regrettable"})["event_id"]
            deadline = time.monotonic() + 30
            while True:
                status, served = alice.call("GET", f"rooms/{quoted_room}/event/{quote(target)}")
                if status == 200:
                    break
                assert time.monotonic() < deadline, (status, served)
                time.sleep(0.2)
            assert served["content"]["body"] == "regrettable"
            redaction = bob.ok("PUT", f"rooms/{quoted_room}/redact/{quote(target)}/r1", {})["event_id"]
            deadline = time.monotonic() + 30
            while True:
                with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
                    cur.execute("SELECT count(*) FROM events WHERE event_id = %s", (redaction,))
                    if cur.fetchone()[0] == 1:
                        break
                assert time.monotonic() < deadline, "the redaction never reached this server"
                time.sleep(0.1)
            served = alice.ok("GET", f"rooms/{quoted_room}/event/{quote(target)}")
            assert served["content"] == {} and served["unsigned"]["redacted_because"]["event_id"] == redaction

            # A room upgrade goes where createRoom goes (the generic worker); the tombstone and the
            # new room's events are each stored by their room's event persister, and the other
            # server's user follows the tombstone into the new room.
            upgraded = alice.ok("POST", f"rooms/{quote(rooms[2], safe='')}/upgrade", {"new_version": "12"})
            new_room = upgraded["replacement_room"]
            tombstone = alice.ok("GET", f"rooms/{quote(rooms[2], safe='')}/state/m.room.tombstone/")
            assert tombstone["replacement_room"] == new_room
            bob.ok("POST", f"join/{quote(new_room, safe='')}?server_name={quote(name_a)}", {})
            with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
                cur.execute("SELECT room_id, array_agg(DISTINCT instance_name) FROM events "
                            "WHERE room_id = ANY(%s) AND type IN ('m.room.tombstone', 'm.room.create') "
                            "GROUP BY room_id", ([rooms[2], new_room],))
                writers_by_room = {room: set(instances) for room, instances in cur.fetchall()}
            assert len(writers_by_room) == 2 and all(len(w) == 1 for w in writers_by_room.values())
            assert all(w <= {"p1", "p2"} for w in writers_by_room.values()), writers_by_room
            assert f"POST /_matrix/client/v3/rooms/{quote(rooms[2], safe='')}/upgrade" in \
                workers["g1"].log_path.read_text(encoding="utf-8")

            # Every process serves its own metrics: the generic worker's show its syncs and what
            # replication brought it from both persisters.
            config = yaml.safe_load(main.config_path.read_text(encoding="utf-8"))
            metrics_port = next(listener["port"] for listener in config["workers"]["g1"]["listeners"]
                                if listener["type"] == "metrics")
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
                metrics = response.read().decode()
            assert 'tributary_http_requests_total{method="GET",servlet="client_sync",status_class="2xx"}' in metrics
            assert 'tributary_stream_position{stream="events",writer="p1"}' in metrics
            assert 'tributary_stream_position{stream="events",writer="p2"}' in metrics

            # The background worker, not the main process, prunes the stream tables.
            assert "as background" in workers["bg1"].log_path.read_text(encoding="utf-8")
            assert "pruning stream tables failed" not in workers["bg1"].log_path.read_text(encoding="utf-8")

            # nginx sent registration to the main process and /sync and sends to the generic worker.
            generic_log = workers["g1"].log_path.read_text(encoding="utf-8")
            main_log = main.log_path.read_text(encoding="utf-8")
            assert "POST /_matrix/client/v3/register 200" in main_log
            assert "POST /_matrix/client/v3/register 200" not in generic_log
            assert "GET /_matrix/client/v3/sync" in generic_log and "GET /_matrix/client/v3/sync" not in main_log
            assert f"PUT /_matrix/client/v3/rooms/{quote(rooms[1], safe='')}/send" in generic_log
        finally:
            nginx.stop()
            for process in reversed(processes):
                if process.process is not None:
                    process.stop()


def test_worker_command_refuses_unknown_names_and_bad_layouts(tmp_path: Path) -> None:
    config = tmp_path / "homeserver.yaml"
    base = {"server_name": "example.org", "database": {"url": "postgresql://127.0.0.1/none"},
            "worker_replication_secret": "s", "redis": {"enabled": True},
            "listeners": [{"type": "http", "port": 9000, "resources": ["replication"]}],
            "instance_map": {"master": {"host": "127.0.0.1", "port": 9000}},
            "workers": {"g1": {"app": "generic"}}}
    cases = [
        (base, "nope", "config error: workers: no worker named 'nope'"),
        ({**base, "stream_writers": {"events": ["p1"]}}, "g1",
         "config error: stream_writers.events[0]: 'p1' is neither the main process nor a worker"),
        ({**base, "workers": {"g1": {"app": "sync"}}}, "g1", "config error: workers.g1.app: unknown worker app 'sync'"),
        ({**base, "redis": {"enabled": False}, "stream_writers": {"events": ["p1"]},
          "instance_map": {"master": {"host": "127.0.0.1", "port": 9000}, "p1": {"host": "127.0.0.1", "port": 9001}},
          "workers": {"p1": {"app": "event_persister",
                             "listeners": [{"type": "http", "port": 9001, "resources": ["replication"]}]}}},
         "p1", "config error: redis.enabled: streams are written by 2 processes"),
    ]
    for raw, name, expected in cases:
        config.write_text(yaml.safe_dump(raw), encoding="utf-8")
        result = run_cli("worker", "--config", str(config), "--name", name)
        assert result.returncode == 2, (expected, result.stderr)
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]
        assert expected in result.stderr, result.stderr
