"""``POST /rooms/{roomId}/upgrade``: parse, then ``RoomUpgradeHandler.upgrade``.

The body (``new_version``, ``additional_creators``) is checked by the events core; this
module only declares the route (the gate authenticates) and answers ``{"replacement_room": ...}``.
"""

# tests: tests/integration/test_room_upgrade.py, tests/integration/test_client_rooms_fuzz.py

from __future__ import annotations

from homeserver.handlers.rooms.room_upgrade import RoomUpgradeHandler
from homeserver.events.validation import check_room_id
from homeserver.http.client_api._base import client_path
from homeserver.http.routes import Call, Caller, Response, route
from homeserver.http.server import parse_json_object

ROOM_UPGRADE = r"/rooms/(?P<room_id>[^/]+)/upgrade"


class RoomUpgradeServlet:
    def __init__(self, upgrades: RoomUpgradeHandler) -> None:
        self._upgrades = upgrades

    # The room ID is checked before the body is read (Body.NONE), as it always was.
    @route("POST", client_path(ROOM_UPGRADE), "client_room_upgrade", caller=Caller.USER)
    async def upgrade(self, call: Call) -> Response:
        room_id = check_room_id(call.params["room_id"])
        body = parse_json_object(call.request)
        return 200, {"replacement_room": await self._upgrades.upgrade(call.user, room_id, body)}
