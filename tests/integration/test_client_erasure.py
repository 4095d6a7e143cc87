"""``POST /account/deactivate`` and its ``erase`` flag (issue 20, Accounts).

The spec: ``erase`` is "whether the user would like their content to be erased as much as
possible from the server. Erasure means that any users (or servers) which join the room
after the erasure request are served redacted copies of the events sent by this account
which were sent before they joined". The spec says nothing of the profile; as Synapse, the
profile (displayname, avatar_url) is erased only with ``erase: true``. The erasure scenario
is SyTest's ``30rooms/32erasure.pl``, "Only original members of the room can see messages
from erased users".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.integration.test_client_rooms import ROOM_LIMITS, _ok
from tests.integration.test_client_support import SERVER_NAME, Client, running_server


def _auth(user: str) -> dict[str, Any]:
    return {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": user}, "password": "password"}


def _content(body: dict[str, Any], room_id: str, event_id: str) -> Any:
    events = body["rooms"]["join"][room_id]["timeline"]["events"]
    return next(e for e in events if e["event_id"] == event_id)["content"]


async def _deactivate(client: Client, token: str, user: str, **fields: Any) -> None:
    done = await client.request("POST", "account/deactivate", {"auth": _auth(user), **fields}, token=token)
    assert done.status == 200, done


async def test_erase_serves_redacted_copies_to_later_joiners_and_erases_the_profile(
    database_dsn: str, tmp_path: Path
) -> None:
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        tokens = {name: (await client.register_ok(name))["access_token"] for name in ("creator", "member", "joiner",
                                                                                      "keeper", "late")}
        creator, member, joiner = tokens["creator"], tokens["member"], tokens["joiner"]
        room_id = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=creator))["room_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=member)
        message = (await _ok(client, "PUT", f"rooms/{room_id}/send/m.room.message/m1", {"body": "body1"},
                             token=creator))["event_id"]
        await _ok(client, "POST", f"rooms/{room_id}/join", {}, token=joiner)
        assert _content(await _ok(client, "GET", "sync", token=joiner), room_id, message) == {"body": "body1"}

        creator_id = f"@creator:{SERVER_NAME}"
        await _deactivate(client, creator, creator_id, erase=True)
        # The original member was joined when it was sent: the event stays whole for them.
        assert _content(await _ok(client, "GET", "sync", token=member), room_id, message) == {"body": "body1"}
        # The joiner came later: a redacted copy, in /sync, /messages and /event.
        assert _content(await _ok(client, "GET", "sync", token=joiner), room_id, message) == {}
        page = await _ok(client, "GET", f"rooms/{room_id}/messages?dir=b&limit=50", token=joiner)
        assert next(e for e in page["chunk"] if e["event_id"] == message)["content"] == {}
        assert (await _ok(client, "GET", f"rooms/{room_id}/event/{message}", token=joiner))["content"] == {}
        assert (await _ok(client, "GET", f"rooms/{room_id}/event/{message}", token=member))["content"] == {
            "body": "body1"}
        profile = await client.request("GET", f"profile/{quote(creator_id)}", token=member)
        assert profile.status == 200 and "displayname" not in profile.body

        # Without erase: the profile stays (as Synapse) and later joiners see the events whole.
        keeper_id = f"@keeper:{SERVER_NAME}"
        kept_room = (await _ok(client, "POST", "createRoom", {"preset": "public_chat"}, token=tokens["keeper"]))[
            "room_id"]
        kept = (await _ok(client, "PUT", f"rooms/{kept_room}/send/m.room.message/k1", {"body": "kept"},
                          token=tokens["keeper"]))["event_id"]
        await _deactivate(client, tokens["keeper"], keeper_id)
        assert (await _ok(client, "GET", f"profile/{quote(keeper_id)}", token=member))["displayname"] == "keeper"
        await _ok(client, "POST", f"rooms/{kept_room}/join", {}, token=tokens["late"])
        assert _content(await _ok(client, "GET", "sync", token=tokens["late"]), kept_room, kept) == {"body": "kept"}
