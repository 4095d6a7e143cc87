"""``POST /rooms/{roomId}/upgrade``: parse, then ``RoomUpgradeHandler.upgrade``.

The body (``new_version``, ``additional_creators``) is checked by the events core; this
module only authenticates and answers ``{"replacement_room": ...}``.
"""

# tests: tests/integration/test_room_upgrade.py, tests/integration/test_client_rooms_fuzz.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.rooms.room_upgrade import RoomUpgradeHandler
from homeserver.events.validation import check_room_id
from homeserver.http.client_api._base import client_path
from homeserver.http.server import Routes, parse_json_object

ROOM_UPGRADE = r"/rooms/(?P<room_id>[^/]+)/upgrade"


def register_room_upgrade_servlet(router: Routes, *, auth: Auth, upgrades: RoomUpgradeHandler) -> None:
    async def upgrade(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        room_id = check_room_id(params["room_id"])
        body = parse_json_object(request)
        return 200, {"replacement_room": await upgrades.upgrade(requester, room_id, body)}

    router.register(["POST"], client_path(ROOM_UPGRADE), upgrade, "client_room_upgrade")
