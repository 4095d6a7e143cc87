"""Profile servlets: GET /profile/{userId}, GET/PUT /profile/{userId}/displayname and /avatar_url.

Reading a profile needs no access token; changing one needs the owner's (a guest's will do).
Fields with no value are left out of the response (an empty object for a
single unset field), as the spec's "only if set" wording has it.
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_nio.py

from __future__ import annotations

from typing import Any

from homeserver.events.validation import check_user_id
from homeserver.handlers.accounts.profile import ProfileHandler
from homeserver.http.client_api._base import client_path, empty
from homeserver.http.routes import Call, Caller, Response, route
from homeserver.http.server import parse_json_object
from storage.kernel.errors import bad_json, missing_param
from storage.stores.profiles import ProfileRow

FIELD = client_path(r"/profile/(?P<user_id>[^/]+)/(?P<field>displayname|avatar_url)")


def _fields(profile: ProfileRow) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if profile.displayname is not None:
        out["displayname"] = profile.displayname
    if profile.avatar_url is not None:
        out["avatar_url"] = profile.avatar_url
    return out


class ProfileServlets:
    def __init__(self, profiles: ProfileHandler) -> None:
        self._profiles = profiles

    @route("GET", client_path(r"/profile/(?P<user_id>[^/]+)"), "client_profile", caller=Caller.NONE)
    async def get_profile(self, call: Call) -> Response:
        return 200, _fields(await self._profiles.lookup_profile(check_user_id(call.params["user_id"])))

    @route("GET", FIELD, "client_profile_field", caller=Caller.NONE)
    async def get_field(self, call: Call) -> Response:
        field = call.params["field"]
        profile = await self._profiles.lookup_profile(check_user_id(call.params["user_id"]))
        return 200, {key: value for key, value in _fields(profile).items() if key == field}

    @route("PUT", FIELD, "client_profile_field_update", caller=Caller.GUEST)
    async def put_field(self, call: Call) -> Response:
        user_id = check_user_id(call.params["user_id"])
        field = call.params["field"]
        # Read after the user ID is checked (not declared as the body), so a bad ID is answered first.
        body = parse_json_object(call.request)
        if field not in body:
            raise missing_param(f"Missing '{field}'")
        value = body[field]
        if value is not None and not isinstance(value, str):
            raise bad_json(f"'{field}' must be a string")
        if field == "displayname":
            await self._profiles.set_displayname(call.user, user_id, value)
        else:
            await self._profiles.set_avatar_url(call.user, user_id, value)
        return empty()
