"""Spaces: ``GET /v1/rooms/{roomId}/hierarchy`` over HTTP against an in-process server and real
PostgreSQL (a space with children on two servers: tests/integration/test_directory.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.test_client_rooms import ROOM_LIMITS, _ok
from tests.integration.test_client_support import Client, running_server

V1 = "/_matrix/client/v1/rooms"


async def _room(client: Client, token: str, **body: Any) -> str:
    room_id: str = (await _ok(client, "POST", "createRoom", body, token=token))["room_id"]
    return room_id


async def _child(client: Client, token: str, space: str, child: str, via: list[str], **extra: Any) -> None:
    await _ok(client, "PUT", f"rooms/{space}/state/m.space.child/{child}", {"via": via, **extra}, token=token)


async def test_local_space_hierarchy(database_dsn: str, tmp_path: Path) -> None:
    """Alice's space holds a public room (with a sub-space), a private room and a suggested room;
    Bob sees the rooms he may join or peek, in the spec's order, limited by depth, suggestion and
    page size; the private space itself is refused to Carol."""
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        alice = (await client.register_ok("alice"))["access_token"]
        bob = (await client.register_ok("bob"))["access_token"]
        carol = (await client.register_ok("carol"))["access_token"]
        space = await _room(client, alice, preset="public_chat", name="Space", creation_content={"type": "m.space"})
        public = await _room(client, alice, preset="public_chat", name="Public")
        private = await _room(client, alice, preset="private_chat", name="Private")
        suggested = await _room(client, alice, preset="public_chat", name="Suggested")
        inner = await _room(client, alice, preset="public_chat", name="Inner")
        await _child(client, alice, space, public, ["test.local"], order="b")
        await _child(client, alice, space, private, ["test.local"])
        await _child(client, alice, space, suggested, ["test.local"], order="a", suggested=True)
        await _child(client, alice, space, "!elsewhere:nowhere.invalid", [])  # no via: not a child
        await _child(client, alice, public, inner, ["test.local"])

        whole = await _ok(client, "GET", f"{V1}/{space}/hierarchy", token=bob)
        ids = [r["room_id"] for r in whole["rooms"]]
        assert ids == [space, suggested, public, inner] and "next_batch" not in whole
        top = whole["rooms"][0]
        assert top["room_type"] == "m.space" and top["name"] == "Space" and top["num_joined_members"] == 1
        assert [c["state_key"] for c in top["children_state"]] == [suggested, public, private]
        assert all(set(c) == {"type", "state_key", "content", "sender", "origin_server_ts"}
                   for c in top["children_state"])
        # Alice is in the private room, so she sees it.
        mine = await _ok(client, "GET", f"{V1}/{space}/hierarchy", token=alice)
        assert private in [r["room_id"] for r in mine["rooms"]]

        shallow = await _ok(client, "GET", f"{V1}/{space}/hierarchy?max_depth=1", token=bob)
        assert [r["room_id"] for r in shallow["rooms"]] == [space, suggested, public]
        picked = await _ok(client, "GET", f"{V1}/{space}/hierarchy?suggested_only=true", token=bob)
        assert [r["room_id"] for r in picked["rooms"]] == [space, suggested]

        pages: list[str] = []
        page = await _ok(client, "GET", f"{V1}/{space}/hierarchy?limit=3", token=bob)
        while True:
            pages += [r["room_id"] for r in page["rooms"]]
            if "next_batch" not in page:
                break
            page = await _ok(client, "GET", f"{V1}/{space}/hierarchy?limit=3&from={page['next_batch']}", token=bob)
        assert pages == ids

        secret = await _room(client, alice, preset="private_chat", creation_content={"type": "m.space"})
        refused = await client.request("GET", f"{V1}/{secret}/hierarchy", token=carol)
        assert (refused.status, refused.errcode) == (403, "M_FORBIDDEN"), refused
        for query in ("from=zzz", "suggested_only=maybe", "limit=x"):
            bad = await client.request("GET", f"{V1}/{space}/hierarchy?{query}", token=bob)
            assert (bad.status, bad.errcode) == (400, "M_INVALID_PARAM"), (query, bad)
        unknown = await client.request("GET", f"{V1}/!nope:test.local/hierarchy", token=bob)
        assert unknown.status == 404, unknown
