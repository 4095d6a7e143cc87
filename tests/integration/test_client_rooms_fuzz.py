"""Malformed input to every room and sync endpoint: never a 5xx, never an error in the server log.

The pattern of test_client_fuzz.py applied to the routes of
``homeserver.http.client_api.rooms`` and ``.sync``: each endpoint runs as a
fresh user who owns a real room with a real message, so valid-looking paths
reach the handlers; then odd path segments, broken bodies, random bodies from
the field names these endpoints read, odd query parameters and odd tokens.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import pytest

from tests.integration.test_client_fuzz import (
    BROKEN_BODIES,
    ODD_SEGMENTS,
    ErrorLogCounter,
    _url,
    odd_value,
    servlet_module,
)
from tests.integration.test_client_support import GENEROUS, SERVER_NAME, running_server

ROOM_LIMITS: Final = {
    "rc_message": GENEROUS,
    "rc_joins": {"local": GENEROUS, "remote": GENEROUS},
    "rc_invites": {"per_room": GENEROUS, "per_user": GENEROUS, "per_issuer": GENEROUS},
}

ROOM_MODULES: Final = (
    "homeserver.http.client_api.rooms",
    "homeserver.http.client_api.sync",
    "homeserver.http.client_api.e2e",
    "homeserver.http.client_api.relations",
    "homeserver.http.client_api.directory",
    "homeserver.http.client_api.search",
    "homeserver.http.client_api.room_upgrade",
)

ENDPOINTS: Final = [
    ("POST", "createRoom"),
    ("GET", "directory/room/{alias}"),
    ("PUT", "directory/room/{alias}"),
    ("DELETE", "directory/room/{alias}"),
    ("POST", "join/{room}"),
    ("POST", "knock/{room}"),
    ("POST", "rooms/{room}/join"),
    ("POST", "rooms/{room}/invite"),
    ("POST", "rooms/{room}/kick"),
    ("POST", "rooms/{room}/ban"),
    ("POST", "rooms/{room}/unban"),
    ("POST", "rooms/{room}/leave"),
    ("POST", "rooms/{room}/forget"),
    ("GET", "joined_rooms"),
    ("GET", "rooms/{room}/members"),
    ("GET", "rooms/{room}/joined_members"),
    ("PUT", "rooms/{room}/send/{type}/{txn}"),
    ("POST", "rooms/{room}/send/{type}"),
    ("GET", "rooms/{room}/initialSync"),
    ("GET", "initialSync"),
    ("GET", "events"),
    ("GET", "events?room_id={room}"),
    ("PUT", "rooms/{room}/state/{type}/{state_key}"),
    ("GET", "rooms/{room}/state/{type}/{state_key}"),
    ("GET", "rooms/{room}/state"),
    ("GET", "rooms/{room}/event/{event}"),
    ("GET", "rooms/{room}/messages"),
    ("GET", "rooms/{room}/context/{event}"),
    ("PUT", "rooms/{room}/redact/{event}/{txn}"),
    ("PUT", "rooms/{room}/typing/{user}"),
    ("POST", "rooms/{room}/receipt/{receipt_type}/{event}"),
    ("POST", "rooms/{room}/read_markers"),
    ("POST", "rooms/{room}/upgrade"),
    ("GET", "sync"),
    ("PUT", "sendToDevice/{type}/{txn}"),
    ("POST", "keys/upload"),
    ("POST", "keys/query"),
    ("POST", "keys/claim"),
    ("GET", "keys/changes"),
    ("POST", "keys/device_signing/upload"),
    ("POST", "keys/signatures/upload"),
    ("GET", "presence/{user}/status"),
    ("PUT", "presence/{user}/status"),
    ("GET", "/_matrix/client/v1/rooms/{room}/relations/{event}"),
    ("GET", "/_matrix/client/v1/rooms/{room}/relations/{event}/m.thread/m.room.message"),
    ("GET", "/_matrix/client/v1/rooms/{room}/threads"),
    ("GET", "/_matrix/client/v1/rooms/{room}/hierarchy"),
    ("GET", "directory/list/room/{room}"),
    ("PUT", "directory/list/room/{room}"),
    ("GET", "publicRooms"),
    ("POST", "publicRooms"),
    ("POST", "user_directory/search"),
    ("POST", "search"),
]

FIELDS: Final = [
    "name", "topic", "invite", "initial_state", "room_alias_name", "preset", "visibility", "is_direct",
    "room_version", "power_level_content_override", "creation_content", "user_id", "reason", "room_id",
    "typing", "timeout", "m.fully_read", "m.read", "m.read.private", "thread_id", "msgtype", "body",
    "membership", "join_rule", "history_visibility", "users", "events", "redacts", "state_key", "type", "content",
    "messages", "device_keys", "one_time_keys", "presence", "status_msg", "user_id", "device_id",
    "search_categories", "room_events", "search_term", "keys", "order_by", "event_context", "groupings",
    "filter", "limit", "since", "generic_search_term", "room_types",
    "new_version", "additional_creators",
]  # fmt: skip

ODD_STRINGS: Final = ["", " ", "x" * 70_000, "\x00", "\ud800", "é✓😀", "@:", "!", "#", "$", "@a:b",
                      "!r:test.local", "#a:test.local", "public_chat", "trusted_private_chat", "10", "11", "12",
                      "zzz", "join", "leave", "ban", "invite", "m.room.message", "{}", "-1",
                      "99999999999999999999999"]  # fmt: skip

QUERIES: Final = ["dir=x", "dir=f", "from=garbage", "from=s99999999999999999999", "from=s1_0_0_0_0_0_0",
                  "to=%FF", "limit=-5", "limit=abc", "limit=99999999999999", "filter=%7B", "filter=[]",
                  'filter={"limit":"x"}', 'filter={"types":[1]}', 'filter={"lazy_load_members":true}',
                  "since=%00", "since=s0_0_0_0_0_0_0", "since=" + "1" * 3000, "timeout=-1", "timeout=abc",
                  "full_state=maybe", "full_state=true", 'filter={"room":{"timeline":{"limit":-1}}}',
                  'filter={"room":[]}', "filter=99", "membership=join", "not_membership=%FF", "from=0",
                  "archived=maybe", "archived=true", "from=s1_0_0_0_0_0_0_9", "from=m1~99.5_0_0_0_0_0_0",
                  "since=m1~99.5_0_0_0_0_0_0", "recurse=maybe", "include=x", "server=%FF", "since=o-1",
                  "suggested_only=2", "max_depth=-1", "next_batch=r99999999999999999999", "from=t1",
                  "from=h99"]  # fmt: skip


def _odd_value(rng: random.Random) -> Any:
    return odd_value(rng, FIELDS, ODD_STRINGS)


@pytest.mark.timeout(120)
async def test_malformed_room_input_never_causes_a_server_error(database_dsn: str, tmp_path: Path) -> None:
    rng = random.Random(20261122)
    errors = ErrorLogCounter()
    logging.getLogger().addHandler(errors)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    try:
        async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (hs, client):
            ours = [r for r in hs.router._routes if servlet_module(r) in ROOM_MODULES]
            fill = {"alias": "%23a%3Ab", "room": "!r:b", "type": "t", "txn": "1", "state_key": "k", "event": "$e",
                    "user": "@a:b", "receipt_type": "m.read"}  # fmt: skip
            samples = [(m, _url(t.format(**fill)).split("?")[0]) for m, t in ENDPOINTS]
            for route in ours:
                assert any(m == route.method and route.pattern.fullmatch(p) for m, p in samples), route
            for method, path in samples:
                assert any(r.method == method and r.pattern.fullmatch(path) for r in ours), (method, path)

            for index, (method, template) in enumerate(ENDPOINTS):
                localpart = f"rfuzz{index}"
                token = (await client.register_ok(localpart))["access_token"]
                user_id = f"@{localpart}:{SERVER_NAME}"
                created = await client.request("POST", "createRoom", {"room_alias_name": f"a{index}"}, token=token)
                assert created.status == 200, created
                room_id = created.body["room_id"]
                sent_event = await client.request(
                    "PUT", f"rooms/{quote(room_id)}/send/m.room.message/x", {"body": "b"}, token=token
                )
                assert sent_event.status == 200, sent_event
                values = {
                    "alias": quote(f"#a{index}:{SERVER_NAME}"),
                    "room": quote(room_id),
                    "type": "m.room.topic",
                    "txn": "fuzztxn",
                    "state_key": "",
                    "event": quote(sent_event.body["event_id"]),
                    "user": quote(user_id),
                    "receipt_type": "m.read",
                }
                sent = 0

                async def send(path: str, raw: bytes | None, who: str | None) -> None:
                    nonlocal sent
                    sent += 1
                    if template.startswith("events"):  # the long-poll would wait its default 30 s each time
                        path += ("&" if "?" in path else "?") + "timeout=0"
                    response = await client.request(method, _url(path), raw=raw, token=who)
                    body = response.body
                    statuses[response.status] = statuses.get(response.status, 0) + 1
                    well_formed = isinstance(body, (dict, list)) and (response.status < 400 or "errcode" in body)
                    if response.status >= 500 or not well_formed:
                        failures.append(
                            f"{method} {path[:120]} body={(raw or b'')[:80]!r} -> {response.status} {str(body)[:200]}"
                        )

                base = template.format(**values)
                await send(base, b"{}", token)
                for name in values:
                    if "{" + name + "}" in template:
                        for segment in ODD_SEGMENTS + ["%21x%00", "%24x", "%23a%3A" + "b" * 300]:
                            await send(template.format(**{**values, name: segment}), b"{}", token)
                for query in QUERIES:
                    await send(f"{base}?{query}", b"{}", token)
                for raw in BROKEN_BODIES:
                    if len(raw) > 100_000 and method == "GET":
                        continue
                    await send(base, raw, token)
                for _ in range(8):
                    body = {field: _odd_value(rng) for field in rng.sample(FIELDS, rng.randint(1, 6))}
                    await send(base, json.dumps(body).encode(), token)
                for who in [None, "", "x" * 5000, "trb_unknown"]:
                    await send(base, b"{}", who)
                assert sent > 40
    finally:
        logging.getLogger().removeHandler(errors)
    assert failures == [], "\n".join(failures[:30])
    assert {200, 400, 401, 403, 404} <= set(statuses), statuses
    assert [r.getMessage() for r in errors.records] == []
