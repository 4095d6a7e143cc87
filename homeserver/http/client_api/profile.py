"""Profile servlets: GET /profile/{userId}, GET/PUT /profile/{userId}/displayname and /avatar_url.

Reading a profile needs no access token; changing one needs the owner's.
Fields with no value are left out of the response (an empty object for a
single unset field), as the spec's "only if set" wording has it.
"""

# tests: tests/integration/test_client_accounts.py, tests/integration/test_client_nio.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.accounts.profile import ProfileHandler
from homeserver.events.validation import check_user_id
from homeserver.http.client_api._base import client_path, empty
from storage.kernel.errors import bad_json, missing_param
from homeserver.http.server import Routes, parse_json_object
from storage.stores.profiles import ProfileRow


def _fields(profile: ProfileRow) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if profile.displayname is not None:
        out["displayname"] = profile.displayname
    if profile.avatar_url is not None:
        out["avatar_url"] = profile.avatar_url
    return out


def register_profile_servlets(router: Routes, *, auth: Auth, profiles: ProfileHandler) -> None:
    async def get_profile(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        profile = await profiles.lookup_profile(check_user_id(params["user_id"]))
        return 200, _fields(profile)

    async def get_field(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        field = params["field"]
        profile = await profiles.lookup_profile(check_user_id(params["user_id"]))
        return 200, {key: value for key, value in _fields(profile).items() if key == field}

    async def put_field(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        user_id = check_user_id(params["user_id"])
        field = params["field"]
        body = parse_json_object(request)
        if field not in body:
            raise missing_param(f"Missing '{field}'")
        value = body[field]
        if value is not None and not isinstance(value, str):
            raise bad_json(f"'{field}' must be a string")
        if field == "displayname":
            await profiles.set_displayname(requester, user_id, value)
        else:
            await profiles.set_avatar_url(requester, user_id, value)
        return empty()

    field_path = client_path(r"/profile/(?P<user_id>[^/]+)/(?P<field>displayname|avatar_url)")
    router.register(["GET"], client_path(r"/profile/(?P<user_id>[^/]+)"), get_profile, "client_profile")
    router.register(["GET"], field_path, get_field, "client_profile_field")
    router.register(["PUT"], field_path, put_field, "client_profile_field_update")
