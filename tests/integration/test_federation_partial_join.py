"""Partial-state joins as the joining server (send_join's ``omit_members``), against a real
Tributary resident: the join answers at once with the state minus its members, the state is
fetched afterwards (the resync), and what clients and servers see meanwhile.

The in-process tests run both servers in this process (``two_servers``): B's resyncer can
then be held back (``pause``) to look at the room while it is partial, and A can be made
hostile (its answers altered on their way out, over real HTTPS). The restart test runs B
as a real process, killed and started again.
"""

# tests of: homeserver/federation/partial_state.py, homeserver/handlers/rooms/partial_state.py,
#           storage/stores/partial_state.py

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg2
import pytest

from homeserver.app import HomeServer
from homeserver.events import EventTemplate, get_room_version, parse_create_room_request, sign_pdu
from homeserver.remote.client import HttpResponseError
from homeserver.events.canonical import EncodedJson
from tests.big_room import add_members
from tests.conftest import scratch_database
from tests.harness import TributaryProcess
from tests.integration.test_client_support import Client
from tests.integration.test_federation import eventually, name, stored, two_servers
from tests.integration.test_federation_big_join import _client_call, resident_big_room

MEMBERS = 400
LAZY = json.dumps({"room": {"state": {"lazy_load_members": True}}})


def q(value: str) -> str:
    return quote(value, safe="")


def client(hs: HomeServer) -> Client:
    return Client(f"http://127.0.0.1:{hs.config.listeners[0].port}")


async def _partial(hs: HomeServer, room_id: str) -> bool:
    assert hs.process.federation is not None
    return await hs.process.federation.partial_resync.is_partial(room_id)


async def _big_room(a: HomeServer, *, members: int = MEMBERS) -> tuple[str, str, Any]:
    """Alice's public room on A with ``members`` more members (and a forbidden ban and a join
    with a broken signature among A's state); (room ID, Alice's ID, what was added)."""
    assert a.process.room_events is not None and a.process.signing_key is not None
    alice = f"@alice:{name(a)}"
    room_id = await a.process.room_events.create_room(alice, parse_create_room_request({"preset": "public_chat"}))
    added = add_members(a.config.database.url or "", room_id, name(a), a.process.signing_key, members,
                        origin_server_ts=int(time.time() * 1000), odd_ones_out=True)
    return room_id, alice, added


async def _joined_members(cb: Client, room_id: str, token: str) -> dict[str, Any]:
    answer = await cb.request("GET", f"rooms/{q(room_id)}/joined_members", token=token)
    assert answer.status == 200, answer
    joined: dict[str, Any] = answer.body["joined"]
    return joined


@pytest.mark.timeout(180)
async def test_partial_join_answers_at_once_then_resyncs(database_dsn: str, second_database_dsn: str,
                                                         tmp_path: Path) -> None:
    """Bob on B joins Alice's room of 400 members on A. B's resync is held back, so the room
    stays partial: the join answered with the state minus the members; a lazy-loading /sync
    shows the room, a non-lazy one does not; messages go both ways (one from a member B has
    no member event of is accepted, checked against its own auth events; Bob's reaches A).
    @m8 leaves meanwhile. A /joined_members asked then waits; once the resync runs it answers
    with the 400 joined members (@m1's state is only the forbidden ban, rejected; @m8's
    leave, newer than the state at the join, wins over its join), the room is no longer
    partial, the non-lazy /sync (from its earlier token) wakes up with the room as newly
    joined, the forbidden ban of A's state is stored rejected and the join with a broken
    signature not stored at all."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        assert b.process.federation is not None and a.process.room_events is not None
        room_id, alice, added = await _big_room(a)
        resync = b.process.federation.partial_resync
        resync.pause()
        cb = client(b)
        bob = await cb.register_ok("bob")
        token = bob["access_token"]
        before = await cb.request("GET", "sync?timeout=0", token=token)
        assert before.status == 200

        joined = await cb.request("POST", f"join/{q(room_id)}?server_name={q(name(a))}", {}, token=token)
        assert joined.status == 200, joined
        assert await _partial(b, room_id)
        assert b.process.events_store is not None
        state = await b.process.events_store.get_current_state_ids(room_id)
        members = [k for k in state if k[0] == "m.room.member"]
        assert len(members) < 10, members  # the heroes and Bob, not 400 members

        lazy = await cb.request("GET", f"sync?timeout=0&filter={q(LAZY)}", token=token)
        assert room_id in lazy.body["rooms"]["join"]
        full = await cb.request("GET", f"sync?timeout=0&since={before.body['next_batch']}", token=token)
        assert room_id not in full.body["rooms"]["join"]
        # Sliding sync, the same rule: a list asking for every member leaves the room out until
        # its state is whole; one lazy-loading members has it at once.
        ss = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync"
        lists = {"all": {"ranges": [[0, 9]], "timeline_limit": 1, "required_state": [["m.room.member", "*"]]},
                 "lazy": {"ranges": [[0, 9]], "timeline_limit": 1,
                          "required_state": [["m.room.member", "$LAZY"], ["m.room.member", "$ME"]]}}
        sliding = await cb.request("POST", ss, {"lists": lists}, token=token)
        assert sliding.status == 200, sliding
        assert sliding.body["lists"]["all"]["count"] == 0
        assert sliding.body["lists"]["lazy"]["ops"][0]["room_ids"] == [room_id]
        assert sliding.body["rooms"][room_id]["lists"] == ["lazy"]

        # Messages both ways while partial. @m7 has no member event on B yet: its message is
        # checked against its own auth events, not rejected for want of a membership.
        m7 = await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": "from m7"}),
                                              f"@m7:{name(a)}")
        row = await eventually(lambda: stored(b, m7.event_id), timeout=30)
        assert not row.outlier and row.rejection_reason is None
        # Not soft-failed either: a lazy-loading client sees it, with its sender's member event.
        seen = await cb.request("GET", f"sync?timeout=0&filter={q(LAZY)}&since={lazy.body['next_batch']}",
                                token=token)
        section = seen.body["rooms"]["join"][room_id]
        assert m7.event_id in [e["event_id"] for e in section["timeline"]["events"]]
        sent = await cb.request("PUT", f"rooms/{q(room_id)}/send/m.room.message/t1", {"msgtype": "m.text",
                                                                                      "body": "from bob"},
                                token=token)
        assert sent.status == 200, sent
        on_a = await eventually(lambda: stored(a, sent.body["event_id"]), timeout=30)
        assert on_a.rejection_reason is None
        # B serves no state of the room while partial: not /state_ids, not a make_join template.
        assert a.process.federation is not None
        for path, query in ((f"/_matrix/federation/v1/state_ids/{q(room_id)}", {"event_id": m7.event_id}),
                            (f"/_matrix/federation/v1/make_join/{q(room_id)}/{q('@zoe:' + name(a))}",
                             {"ver": ["12"]})):
            with pytest.raises(HttpResponseError) as refused:
                await a.process.federation.client.get_json(name(b), path, query=query)
            assert refused.value.code == 404, path

        # @m8 leaves while B is partial: B has no member event of @m8 in its state; after the
        # resync, the leave (newer than the state at the join) must stay, not the join.
        m8_leave = await a.process.room_events.send(
            room_id, EventTemplate("m.room.member", {"membership": "leave"}, f"@m8:{name(a)}"), f"@m8:{name(a)}")
        row = await eventually(lambda: stored(b, m8_leave.event_id), timeout=30)
        assert not row.outlier and row.rejection_reason is None
        assert await _partial(b, room_id)

        # A members read waits for the resync, which starts now.
        waiting = cb.request("GET", f"rooms/{q(room_id)}/joined_members", token=token)
        woken = cb.request("GET", f"sync?timeout=30000&since={full.body['next_batch']}", token=token)
        resync.unpause()
        answer = await waiting
        assert answer.status == 200, answer
        assert len(answer.body["joined"]) == MEMBERS and alice in answer.body["joined"]
        assert f"@m8:{name(a)}" not in answer.body["joined"] and f"@m9:{name(a)}" in answer.body["joined"]
        assert not await _partial(b, room_id)
        assert b.registry.get_sample_value("tributary_federation_partial_state_resyncs_total",
                                           {"outcome": "completed"}) == 1.0
        members_list = await cb.request("GET", f"rooms/{q(room_id)}/members", token=token)
        assert members_list.status == 200
        assert len([e for e in members_list.body["chunk"] if e["content"]["membership"] == "join"]) == MEMBERS

        synced = await woken
        assert synced.status == 200 and room_id in synced.body["rooms"]["join"], synced.body["rooms"]
        whole = await cb.request("POST", ss + f"?pos={q(sliding.body['pos'])}&timeout=0", {"lists": lists},
                                 token=token)
        assert whole.body["lists"]["all"]["ops"][0]["room_ids"] == [room_id]
        members_sent = [e for e in whole.body["rooms"][room_id]["required_state"] if e["type"] == "m.room.member"]
        assert len(members_sent) >= MEMBERS, len(members_sent)
        room = synced.body["rooms"]["join"][room_id]
        state_members = [e for e in room["state"]["events"] if e["type"] == "m.room.member"]
        timeline_members = [e for e in room["timeline"]["events"] if e["type"] == "m.room.member"]
        assert len(state_members) + len(timeline_members) >= MEMBERS, len(state_members)

        forbidden = await stored(b, added.forbidden)
        assert forbidden is not None and forbidden.rejection_reason
        assert await stored(b, added.bad_signature) is None
        assert f"@m1:{name(a)}" not in answer.body["joined"]

        # After the resync, a message of A reaches B as usual, checked against full state.
        late = await a.process.room_events.send(room_id, EventTemplate("m.room.message", {"body": "after"}),
                                                f"@m9:{name(a)}")
        row = await eventually(lambda: stored(b, late.event_id), timeout=30)
        assert row.rejection_reason is None


@pytest.mark.timeout(180)
async def test_hostile_partial_answers(database_dsn: str, second_database_dsn: str, tmp_path: Path) -> None:
    """A answers badly. A send_join answer whose ``servers_in_room`` is not a list of server
    names: B asks A again for the full state, and the join is complete at once (no partial
    row). Then, on a partial join of another room, A's /state answer holds forgeries: a join
    of one of B's users signed by A alone, and a copy of a member's join given another
    state key after signing. Neither is stored; the room is made whole with the genuine members.
    Then a /state answer that is garbage: the resync tries again after its backoff."""
    async with two_servers(database_dsn, second_database_dsn, tmp_path) as (a, b):
        assert a.process.federation is not None and b.process.federation is not None
        assert a.process.signing_key is not None
        room_id, _, _ = await _big_room(a, members=50)
        membership = a.process.federation.membership
        honest_send_join = membership.send_join
        asked: list[bool] = []

        async def bad_servers(origin: str, room: str, event_id: str, body: object, *,
                              omit_members: bool = False) -> EncodedJson:
            asked.append(omit_members)
            answer = json.loads(bytes(await honest_send_join(origin, room, event_id, body,
                                                             omit_members=omit_members)))
            if omit_members:
                answer["servers_in_room"] = ["ok.example", {"not": "a server"}, "bad server name"]
            return EncodedJson(json.dumps(answer).encode())

        membership.send_join = bad_servers  # type: ignore[method-assign,assignment]
        cb = client(b)
        bob = await cb.register_ok("bob")
        joined = await cb.request("POST", f"join/{q(room_id)}?server_name={q(name(a))}", {}, token=bob["access_token"])
        assert joined.status == 200, joined
        assert asked == [True, False]
        assert not await _partial(b, room_id)
        assert len(await _joined_members(cb, room_id, bob["access_token"])) == 50 + 1
        membership.send_join = honest_send_join  # type: ignore[method-assign]

        # A second room, a partial join, and a /state answer with forgeries in it.
        other, _, _ = await _big_room(a, members=30)
        history = a.process.federation.history
        honest_state = history.state
        version = get_room_version("12")
        mallory = f"@mallory:{name(b)}"

        forged: list[str] = []

        async def forged_state(origin: str, room: str, event_id: str) -> dict[str, Any]:
            forged.append(room)
            answer = await honest_state(origin, room, event_id)
            template = next(e for e in answer["pdus"] if e["type"] == "m.room.member")
            claimed = {k: v for k, v in template.items() if k not in ("hashes", "signatures", "unsigned")}
            claimed.update(sender=mallory, state_key=mallory)
            assert a.process.signing_key is not None
            answer["pdus"].append(dict(sign_pdu(version, claimed, name(a), a.process.signing_key).get_pdu_json()))
            genuine = next(e for e in answer["pdus"] if e["type"] == "m.room.member"
                           and e["state_key"] == f"@m20:{name(a)}")
            answer["pdus"].append({**genuine, "state_key": f"@m20-evil:{name(a)}"})  # signed as @m20's
            return answer

        history.state = forged_state  # type: ignore[method-assign,assignment]
        carol = await cb.register_ok("carol")
        joined = await cb.request("POST", f"join/{q(other)}?server_name={q(name(a))}", {}, token=carol["access_token"])
        assert joined.status == 200, joined
        members = await _joined_members(cb, other, carol["access_token"])
        assert forged == [other]
        assert len(members) == 30 + 1 and mallory not in members and f"@m20-evil:{name(a)}" not in members
        assert not await _partial(b, other)

        # A third room, whose first /state answer is not a /state answer at all: that attempt
        # fails (counted), and the resync asks again after its backoff and succeeds.
        third, _, _ = await _big_room(a, members=20)
        answers: list[str] = []

        async def garbage_then_honest(origin: str, room: str, event_id: str) -> dict[str, Any]:
            answers.append(room)
            if len(answers) == 1:
                return {"pdus": "not a list", "auth_chain": [{"type": 5}]}
            return await honest_state(origin, room, event_id)

        history.state = garbage_then_honest  # type: ignore[method-assign]
        dave = await cb.register_ok("dave")
        joined = await cb.request("POST", f"join/{q(third)}?server_name={q(name(a))}", {}, token=dave["access_token"])
        assert joined.status == 200, joined
        members = await _joined_members(cb, third, dave["access_token"])
        assert len(members) == 20 + 1 and answers == [third, third]
        assert b.registry.get_sample_value("tributary_federation_partial_state_resyncs_total",
                                           {"outcome": "failed"}) == 1.0


@pytest.mark.timeout(240)
def test_a_restart_during_partial_state_resumes_the_resync(postgres_template: str, tmp_path: Path) -> None:
    """A (one process) holds a room of 300 members; B (a real process) joins it with partial
    state. B is killed with its room still marked partial (the mark is put back, as a crash
    before the resync finished leaves it: the row, and current state without the members),
    then started again: it resumes the resync by itself, and /joined_members lists everyone."""
    with scratch_database(postgres_template) as dsn_a, scratch_database(postgres_template) as dsn_b:
        resident = TributaryProcess.configure_federating(tmp_path / "a", database_url=dsn_a)
        joiner = TributaryProcess.configure_federating(tmp_path / "b", database_url=dsn_b)
        try:
            room_id = resident_big_room(resident, dsn_a, 300)
            resident.start()
            joiner.start()
            bob = _client_call(joiner.client_port, "POST", "register",
                               {"username": "bob", "password": "pw", "auth": {"type": "m.login.dummy"}})
            token = bob["access_token"]
            _client_call(joiner.client_port, "POST", f"join/{q(room_id)}?server_name={q(resident.server_name)}", {},
                         token)
            joiner.kill()
            with psycopg2.connect(dsn_b) as conn, conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM partial_state_rooms WHERE room_id = %s", (room_id,))
                assert cur.fetchone() == (1,)
                cur.execute("UPDATE partial_state_rooms SET completed_instance = NULL, completed_stream = NULL "
                            "WHERE room_id = %s", (room_id,))
                cur.execute("DELETE FROM current_state_events WHERE room_id = %s AND type = 'm.room.member' "
                            "AND state_key LIKE '@m%%'", (room_id,))
            joiner.start()
            members = _client_call(joiner.client_port, "GET", f"rooms/{q(room_id)}/joined_members", None, token)
            assert len(members["joined"]) == 302
            log = joiner.log_path.read_text(encoding="utf-8")
            assert "resuming the state resync of 1 partial-state rooms" in log
            with psycopg2.connect(dsn_b) as conn, conn.cursor() as cur:
                cur.execute("SELECT completed_stream FROM partial_state_rooms WHERE room_id = %s", (room_id,))
                row = cur.fetchone()
                assert row is not None and row[0] is not None
        finally:
            joiner.kill()
            resident.kill()


async def test_partial_state_joins_switch_is_checked_and_can_turn_them_off(
    database_dsn: str, second_database_dsn: str, tmp_path: Path
) -> None:
    """``federation.partial_state_joins: false``: B asks for the whole state (no omit_members)
    and the room is never partial; a value that is not a bool names the key."""
    from homeserver.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config({"server_name": "x.example", "data_dir": str(tmp_path),
                      "federation": {"partial_state_joins": "yes"}}, config_path=tmp_path / "h.yaml")
    assert "federation.partial_state_joins" in str(info.value)
    extra = {"federation": {"verify_certificates": False, "ip_range_whitelist": ["127.0.0.0/8"],
                            "partial_state_joins": False}}
    async with two_servers(database_dsn, second_database_dsn, tmp_path, extra=extra) as (a, b):
        assert b.process.federation is not None
        room_id, _, _ = await _big_room(a, members=40)
        join = await b.process.federation.membership.join_remote(room_id, f"@bob:{name(b)}", [name(a)])
        assert join is not None
        assert not await _partial(b, room_id)
        assert b.process.events_store is not None
        state = await b.process.events_store.get_current_state_ids(room_id)
        assert len([k for k in state if k[0] == "m.room.member"]) == 40 + 1
