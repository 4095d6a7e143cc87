"""The admin API: the reference server's ``/_synapse/admin/...`` paths and JSON shapes, so
that its tools (synapse-admin, scripts) work against Tributary.

Every endpoint but shared-secret registration is declared ``Caller.ADMIN`` (homeserver/http/
routes.py), so the router's gate lets only the access token of a server admin (``users.admin``)
through: anyone else gets 403 ``M_FORBIDDEN``. Each admin is rate-limited (``rc_admin``), and
every admin request is logged on ``homeserver.admin.audit`` with who did what to which path
and the status (``AdminGuard``, the gate's admin check). The servlets are registered only on
the main process, on its own router, which listeners serve with the ``client`` or ``admin``
resource and never with ``federation`` alone (docs/admin.md).

Media endpoints (``/_synapse/admin/v1/media/...``) are not here: the media area owns them,
and declares them through a gate with the same ``AdminGuard`` (homeserver/admin/guard.py).
"""

# tests: tests/integration/test_admin_api.py, tests/unit/test_admin_shared_secret.py

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import attrs
from twisted.web.server import Request

from homeserver import __version__
from homeserver.admin.accounts import AccountExists, create_account, password_hasher
from homeserver.admin.guard import AdminGuard, audit_logger
from homeserver.admin.tasks import RESUMED, Task, TaskTracker
from homeserver.config import HomeserverConfig
from homeserver.events import get_room_version
from homeserver.events.identifiers import is_valid_server_name, is_valid_user_id, server_name_of
from homeserver.events.validation import MAX_PASSWORD_LENGTH, check_localpart
from homeserver.handlers.accounts.auth import Requester, client_ip
from homeserver.handlers.accounts.deactivate import DeactivationHandler
from homeserver.handlers.accounts.login import LoginHandler
from homeserver.handlers.accounts.devices import DeviceHandler
from homeserver.handlers.accounts.profile import ProfileHandler
from homeserver.handlers.rooms.rooms import RoomHandler
from homeserver.http.client_api._base import optional_bool, query_bool, query_int, query_string
from homeserver.http.routes import Body, Call, Caller, Gate, Rate, Response, declare, route
from homeserver.http.server import Routes, parse_json_object, parse_optional_json_object
from storage.database import Database
from storage.kernel.errors import MatrixError, bad_json, invalid_param, missing_param, not_found
from storage.kernel.ratelimit import Ratelimiter
from storage.stores.accounts import AccountStore
from storage.stores.timeline import TimelineStore
from storage.stores.admin import (
    DESTINATION_ORDERS,
    ROOM_ORDERS,
    USER_ORDERS,
    AdminStore,
    AdminTaskStore,
    AdminUserRow,
)

logger = logging.getLogger(__name__)

ADMIN_PREFIX: Final = "/_synapse/admin"
USER: Final = r"(?P<user_id>[^/]+)"
ROOM: Final = r"(?P<room_id>[^/]+)"
DEVICE: Final = r"/devices/(?P<device_id>[^/]+)"
DESTINATION: Final = r"/(?P<server>[^/]+)"
TOKEN: Final = r"/(?P<token>[^/]+)"
TOKEN_ALPHABET: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~-"
MAX_PAGE: Final = 1000
# Shared-secret registration: how long a nonce stays usable, and how many may wait at once.
NONCE_LIFETIME_S: Final = 60.0
MAX_NONCES: Final = 10_000


def shared_secret_mac(secret: str, nonce: str, username: str, password: str, admin: bool,
                      user_type: str | None = None) -> str:
    """The HMAC-SHA1 (hex) the reference server's shared-secret registration expects:
    over ``nonce NUL username NUL password NUL admin|notadmin [NUL user_type]``."""
    mac = hmac.new(secret.encode("utf-8"), digestmod=hashlib.sha1)
    parts = [nonce, username, password, "admin" if admin else "notadmin"]
    if user_type is not None:
        parts.append(user_type)
    mac.update(b"\x00".join(part.encode("utf-8") for part in parts))
    return mac.hexdigest()


class Nonces:
    """Single-use nonces for shared-secret registration, each valid ``NONCE_LIFETIME_S``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._issued: dict[str, float] = {}

    def issue(self) -> str:
        now = self._clock()
        if len(self._issued) >= MAX_NONCES:
            self._issued = {n: t for n, t in self._issued.items() if now - t < NONCE_LIFETIME_S}
            if len(self._issued) >= MAX_NONCES:
                raise MatrixError(429, "M_LIMIT_EXCEEDED", "Too many registration nonces outstanding")
        nonce = secrets.token_hex(32)
        self._issued[nonce] = now
        return nonce

    def take(self, nonce: str) -> bool:
        """True (once) for a nonce issued less than ``NONCE_LIFETIME_S`` ago."""
        issued = self._issued.pop(nonce, None)
        return issued is not None and self._clock() - issued < NONCE_LIFETIME_S


def _page(request: Request) -> tuple[int, int]:
    return query_int(request, "from", 0, maximum=10**9), query_int(request, "limit", 100, minimum=0, maximum=MAX_PAGE)


def _direction(request: Request) -> bool:
    """True for ``dir=b`` (descending)."""
    value = query_string(request, "dir") or "f"
    if value not in ("f", "b"):
        raise invalid_param("Unknown direction: dir must be 'f' or 'b'")
    return value == "b"


def _order(request: Request, allowed: Mapping[str, str], default: str) -> str:
    value = query_string(request, "order_by") or default
    if value not in allowed:
        raise invalid_param(f"Unknown value for order_by: {value[:50]!r} (one of {', '.join(sorted(allowed))})")
    return value


def _next_token(offset: int, count: int, total: int) -> dict[str, Any]:
    return {"next_token": str(offset + count)} if offset + count < total else {}


def user_json(row: AdminUserRow) -> dict[str, Any]:
    """A user as the reference server's admin API shows one."""
    return {
        "name": row.user_id,
        "user_type": None,
        "is_guest": row.is_guest,
        "admin": row.admin,
        "deactivated": row.deactivated,
        "erased": row.erased,
        "shadow_banned": False,
        "locked": False,
        "displayname": row.displayname,
        "avatar_url": row.avatar_url,
        "creation_ts": row.created_ts,
        "appservice_id": None,
        "approved": True,
    }


@attrs.define
class AdminApi:
    """The admin API's collaborators and what its servlets do beyond translating a request;
    ``register`` declares the servlets on a router."""

    config: HomeserverConfig
    db: Database
    reactor: Any
    login: LoginHandler
    devices: DeviceHandler
    profiles: ProfileHandler
    rooms: RoomHandler
    timeline: TimelineStore
    deactivation: DeactivationHandler
    # Forget a destination's backoff in the process that sends to it, and send now.
    remote_up: Callable[[str], None]
    tasks: TaskTracker
    clock: Callable[[], float] = time.time
    store: AdminStore = attrs.field(init=False)
    # The admin check of the gate every admin servlet is declared through: rate-limited, admins only, audited.
    guard: AdminGuard = attrs.field(init=False)
    # Shared-secret registration's own rc_registration budget (Rate.SHARED_SECRET_REGISTRATION).
    register_limiter: Ratelimiter = attrs.field(init=False)
    nonces: Nonces = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.store = AdminStore(self.db)
        self.tasks.attach(AdminTaskStore(self.db))
        self.guard = AdminGuard(self.store, Ratelimiter.from_config(self.config.rc_admin), self.clock)
        self.register_limiter = Ratelimiter.from_config(self.config.rc_registration)
        self.nonces = Nonces(self.clock)

    @property
    def server_name(self) -> str:
        return self.config.server_name

    def register(self, router: Routes, gate: Gate) -> None:
        """Every admin servlet on ``router``, through ``gate`` (whose admin check is ``guard``
        and whose limiters include ``register_limiter``), and the tasks they start."""
        self.tasks.register("shutdown_and_purge_room", self._delete_room_task)
        self.tasks.register("purge_history", self._purge_task)
        declare(router, gate,
                SharedSecretServlets(self.config, self.db, self.reactor, self.nonces, self.login),
                UserServlets(self), RoomServlets(self),
                DestinationServlets(self.store, self.server_name, self.remote_up),
                TokenServlets(self.store, self.clock), ServerServlets(self.tasks, self.send_notice))

    # --- plumbing ---------------------------------------------------------------------------

    def local_user(self, user_id: str) -> str:
        if server_name_of(user_id) != self.server_name:
            raise MatrixError(400, "M_UNKNOWN", "This endpoint can only be used with local users")
        return user_id

    async def existing_user(self, user_id: str) -> AdminUserRow:
        row = await self.store.get_user(self.local_user(user_id))
        if row is None:
            raise not_found("User not found")
        return row

    # --- server notices ---------------------------------------------------------------------

    async def send_notice(self, user_id: str, event_type: str, content: Mapping[str, Any]) -> str:
        """Send ``content`` to ``user_id`` in their server notices room, made (and the user invited)
        on first use, or invited again when they left it."""
        notices = self.config.server_notices
        if notices is None:
            raise MatrixError(400, "M_UNKNOWN", "Server notices are not enabled on this server")
        if server_name_of(user_id) != self.server_name:
            raise MatrixError(400, "M_UNKNOWN", "Server notices can only be sent to local users")
        target = await self.store.get_user(user_id)
        if target is None or target.deactivated:
            raise not_found("User not found")
        system_id = f"@{notices.system_mxid_localpart}:{self.server_name}"
        if await self.store.get_user(system_id) is None:
            try:
                await create_account(self.db, self.reactor, self.config, notices.system_mxid_localpart, None,
                                     admin=False, displayname=notices.system_mxid_display_name)
            except AccountExists:
                pass  # made meanwhile by another request
        system = Requester(system_id, "", 0)
        room_id = await self.store.get_notice_room(user_id)
        membership = None
        if room_id is not None:
            rooms = await self.timeline.get_rooms_for_user(user_id)
            membership = rooms.get(room_id, (None, ""))[0]
            if (await self.timeline.get_rooms_for_user(system_id)).get(room_id, (None, ""))[0] != "join":
                room_id = None  # the room is gone (deleted): make a new one
        if room_id is None:
            room_id, _ = await self.rooms.create_room(system, {
                "preset": "private_chat", "name": notices.room_name, "invite": [user_id],
                "creation_content": {"m.federate": False},
                # Only the server speaks in a notices room.
                "power_level_content_override": {"events_default": 50},
            })
            await self.store.set_notice_room(user_id, room_id)
        elif membership not in ("join", "invite"):
            await self.rooms.update_membership(system, room_id, user_id, "invite", ratelimited=False)
        return await self.rooms.send_event(system, room_id, event_type, content, None, ratelimited=False)

    # --- users and rooms ---------------------------------------------------------------------

    async def set_password(self, user_id: str, password: str, *, logout: bool) -> None:
        password_hash = await password_hasher(self.config, self.reactor).hash(password)
        deleted = await AccountStore(self.db).set_password_hash(user_id, password_hash, keep_device_id=None,
                                                               logout_devices=logout)
        await self.devices.devices_deleted(user_id, deleted)

    async def shut_down_room(self, by: str, room_id: str, options: Mapping[str, Any],
                              task_id: str | None) -> dict[str, Any]:
        """Make every local member leave, optionally block the room and purge its rows."""
        store = self.store
        if not await store.room_exists(room_id):
            if options["block"]:
                await store.block_room(room_id, by, True, int(self.clock() * 1000))
                return {"kicked_users": [], "failed_to_kick_users": [], "local_aliases": [], "new_room_id": None}
            raise not_found("Unknown room")
        if options["block"]:
            await store.block_room(room_id, by, True, int(self.clock() * 1000))
        kicked: list[str] = []
        failed: list[str] = []
        for user_id, _membership in await store.get_local_members(room_id, self.server_name):
            try:
                # As the member itself: a leave needs no power, so this works in any room.
                await self.rooms.update_membership(Requester(user_id, "", 0), room_id, user_id, "leave",
                                                         ratelimited=False)
                kicked.append(user_id)
            except MatrixError as e:
                logger.warning("[%s] could not remove %s from the room: %s", room_id, user_id, e)
                failed.append(user_id)
        aliases = await store.get_local_aliases(room_id)
        if options["purge"] and (not failed or options["force_purge"]):
            await store.purge_room(room_id)
            logger.info("[%s] purged by %s", room_id, by)
        return {"kicked_users": kicked, "failed_to_kick_users": failed, "local_aliases": aliases, "new_room_id": None}

    async def make_room_admin(self, room_id: str, target: str) -> None:
        """Raise ``target`` to the highest power level a local member holds, as that member (a
        room creator, in rooms where creators rank above every level, gives 100); invite the
        target too when the room is not public and they are not in it."""
        state = [json.loads(text) for text in await self.store.get_room_state(room_id)]
        by_key = {(e.get("type"), e.get("state_key")): e for e in state}
        create = by_key.get(("m.room.create", ""))
        if create is None:
            raise not_found("Room not found")
        levels = dict((by_key.get(("m.room.power_levels", "")) or {}).get("content") or {})
        users = dict(levels.get("users") or {})
        joined_local = [e["state_key"] for e in state if e.get("type") == "m.room.member"
                        and (e.get("content") or {}).get("membership") == "join"
                        and server_name_of(e["state_key"]) == self.server_name]
        rooms, _ = await self.store.list_rooms(server_name=self.server_name, offset=0, limit=1, order_by="name",
                                               descending=False, search_term=None, room_id=room_id)
        creators = {create.get("sender")} | set((create.get("content") or {}).get("additional_creators") or [])
        creators_rank_highest = bool(rooms) and get_room_version(str(rooms[0]["version"])).privileged_creators
        default = int(levels.get("users_default", 0) or 0)

        def level(user_id: str) -> float:
            if creators_rank_highest and user_id in creators:
                return float("inf")
            value = users.get(user_id, default)
            return float(value) if isinstance(value, int) else float(default)

        if not joined_local:
            raise MatrixError(400, "M_UNKNOWN", "No local user is joined to the room: nobody here can give power")
        actor = max(joined_local, key=level)
        actor_level = level(actor)
        new_level = 100 if actor_level == float("inf") else int(actor_level)
        if creators_rank_highest and target in creators:
            return  # already ranks above every power level
        if level(target) < new_level:
            users[target] = new_level
            levels["users"] = users
            await self.rooms.send_state(Requester(actor, "", 0), room_id, "m.room.power_levels", "", levels)
        membership = (by_key.get(("m.room.member", target)) or {}).get("content", {}).get("membership")
        join_rule = (by_key.get(("m.room.join_rules", "")) or {}).get("content", {}).get("join_rule")
        if membership not in ("join", "invite") and join_rule != "public":
            await self.rooms.update_membership(Requester(actor, "", 0), room_id, target, "invite",
                                                     ratelimited=False)
        logger.info("[%s] %s made room admin (power %d, given by %s)", room_id, target, new_level, actor)

    async def _delete_room_task(self, task_id: str, task_params: Mapping[str, Any]) -> dict[str, Any]:
        room_id, options = str(task_params["room_id"]), task_params["options"]
        if task_params.get(RESUMED) and not options["block"] and not await self.store.room_exists(room_id):
            # Run again after a restart, and the purge had finished: done.
            return {"kicked_users": [], "failed_to_kick_users": [], "local_aliases": [], "new_room_id": None}
        return await self.shut_down_room(str(task_params["by"]), room_id, options, task_id=task_id)

    async def _purge_task(self, task_id: str, task_params: Mapping[str, Any]) -> dict[str, Any]:
        room_id = str(task_params["room_id"])
        count = await self.store.purge_history(room_id, before_stream=task_params["before_stream"],
                                               before_ts=task_params["before_ts"],
                                               delete_local_events=bool(task_params["delete_local_events"]))
        logger.info("[%s] %d events purged by %s", room_id, count, task_params["by"])
        return {"purged_events": count}


# --- servlets: each translates a request into a call of the admin API's collaborators ----------
# They are declared in this order, and each class's routes in the order written (the router
# matches in registration order).

USERS: Final = ADMIN_PREFIX + r"/v2/users/" + USER
ROOMS: Final = ADMIN_PREFIX + r"/v1/rooms/" + ROOM
DESTINATIONS: Final = ADMIN_PREFIX + r"/v1/federation/destinations"
TOKENS: Final = ADMIN_PREFIX + r"/v1/registration_tokens"
NOT_ENABLED: Final = "Shared secret registration is not enabled"


class SharedSecretServlets:
    """Shared-secret registration: no access token, knowing the secret is the authorisation."""

    def __init__(self, config: HomeserverConfig, db: Database, reactor: Any, nonces: Nonces,
                 login: LoginHandler) -> None:
        self._config = config
        self._db = db
        self._reactor = reactor
        self._nonces = nonces
        self._login = login

    @route("GET", ADMIN_PREFIX + r"/v1/register", "admin_register_nonce", caller=Caller.NONE,
           rate=Rate.SHARED_SECRET_REGISTRATION)
    async def get_nonce(self, call: Call) -> Response:
        if self._config.registration_shared_secret is None:
            raise MatrixError(400, "M_UNKNOWN", NOT_ENABLED)
        return 200, {"nonce": self._nonces.issue()}

    @route("POST", ADMIN_PREFIX + r"/v1/register", "admin_register", caller=Caller.NONE,
           rate=Rate.SHARED_SECRET_REGISTRATION)
    async def post_register(self, call: Call) -> Response:
        secret = self._config.registration_shared_secret
        if secret is None:
            raise MatrixError(400, "M_UNKNOWN", NOT_ENABLED)
        body = parse_json_object(call.request)
        fields: dict[str, str] = {}
        for key in ("nonce", "username", "password", "mac"):
            value = body.get(key)
            if not isinstance(value, str) or not value:
                raise bad_json(f"'{key}' must be a non-empty string")
            if len(value) > MAX_PASSWORD_LENGTH or "\x00" in value:
                raise bad_json(f"'{key}' is too long or contains NUL")
            fields[key] = value
        admin = optional_bool(body, "admin", False)
        user_type = body.get("user_type")
        if user_type is not None and not isinstance(user_type, str):
            raise bad_json("'user_type' must be a string")
        displayname = body.get("displayname")
        if displayname is not None and (not isinstance(displayname, str) or len(displayname) > 256):
            raise bad_json("'displayname' must be a string of at most 256 characters")
        if not self._nonces.take(fields["nonce"]):
            raise MatrixError(400, "M_UNKNOWN", "unrecognised nonce")
        want = shared_secret_mac(secret, fields["nonce"], fields["username"], fields["password"], admin, user_type)
        if not hmac.compare_digest(want, fields["mac"].lower()):
            raise MatrixError(403, "M_FORBIDDEN", "HMAC incorrect")
        server_name = self._config.server_name
        localpart = check_localpart(fields["username"].lower(), server_name)
        try:
            user_id = await create_account(self._db, self._reactor, self._config, localpart, fields["password"],
                                           admin=admin, displayname=displayname)
        except AccountExists:
            raise MatrixError(400, "M_USER_IN_USE", "User ID already taken.") from None
        audit_logger.info("[shared secret] registered %s%s", user_id, " as admin" if admin else "")
        login = await self._login.login_with_password(
            user=user_id, password=fields["password"], device_id=None, initial_device_display_name=None,
            ip=client_ip(call.request))
        return 200, {"user_id": user_id, "home_server": server_name, "access_token": login.access_token,
                     "device_id": login.device_id}


class UserServlets:
    def __init__(self, api: AdminApi) -> None:
        self._api = api
        self._store = api.store
        self._devices = api.devices
        self._profiles = api.profiles

    @route("GET", ADMIN_PREFIX + r"/v2/users", "admin_list_users", caller=Caller.ADMIN)
    async def list_users(self, call: Call) -> Response:
        request = call.request
        offset, limit = _page(request)
        rows, total = await self._store.list_users(
            offset=offset, limit=limit, name=query_string(request, "name"),
            user_id=query_string(request, "user_id"),
            guests=query_bool(request, "guests", True),
            deactivated=query_bool(request, "deactivated", False),
            admins=query_bool(request, "admins", None),
            order_by=_order(request, USER_ORDERS, "name"), descending=_direction(request),
        )
        return 200, {"users": [user_json(row) for row in rows], "total": total,
                     **_next_token(offset, len(rows), total)}

    @route("GET", USERS, "admin_get_user", caller=Caller.ADMIN)
    async def get_user(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        return 200, {**user_json(row), "threepids": [], "external_ids": []}

    @route("PUT", USERS, "admin_put_user", caller=Caller.ADMIN)
    async def put_user(self, call: Call) -> Response:
        api, store = self._api, self._store
        user_id = api.local_user(call.params["user_id"])
        body = parse_json_object(call.request)
        password = body.get("password")
        if password is not None and (not isinstance(password, str) or not password
                                     or len(password) > MAX_PASSWORD_LENGTH):
            raise bad_json("'password' must be a non-empty string")
        for key in ("displayname", "avatar_url"):
            if body.get(key) is not None and not isinstance(body[key], str):
                raise bad_json(f"'{key}' must be a string")
        for key in ("admin", "deactivated", "logout_devices"):
            if key in body and not isinstance(body[key], bool):
                raise bad_json(f"'{key}' must be true or false")
        existing = await store.get_user(user_id)
        target = Requester(user_id, "", 0)
        if existing is None:
            localpart = check_localpart(user_id[1:].partition(":")[0], api.server_name)
            try:
                await create_account(api.db, api.reactor, api.config, localpart, password,
                                     admin=bool(body.get("admin", False)), displayname=body.get("displayname"))
            except AccountExists:
                raise MatrixError(400, "M_USER_IN_USE", "User ID already taken.") from None
            if body.get("avatar_url") is not None:
                await self._profiles.set_avatar_url(target, user_id, body["avatar_url"])
            row = await api.existing_user(user_id)
            return 201, {**user_json(row), "threepids": [], "external_ids": []}
        if body.get("deactivated") is True and not existing.deactivated:
            await api.deactivation.deactivate(target, erase=False)
        elif body.get("deactivated") is False and existing.deactivated:
            raise MatrixError(400, "M_UNKNOWN", "Reactivating an account is not supported")
        else:
            if password is not None:
                await api.set_password(user_id, password, logout=bool(body.get("logout_devices", True)))
            if "displayname" in body:
                await self._profiles.set_displayname(target, user_id, body["displayname"])
            if "avatar_url" in body:
                await self._profiles.set_avatar_url(target, user_id, body["avatar_url"])
        if "admin" in body:
            if user_id == call.user.user_id and body["admin"] is False:
                raise MatrixError(400, "M_UNKNOWN", "You may not demote yourself.")
            await store.set_admin(user_id, body["admin"])
        row = await api.existing_user(user_id)
        return 200, {**user_json(row), "threepids": [], "external_ids": []}

    @route("POST", ADMIN_PREFIX + r"/v1/deactivate/" + USER, "admin_deactivate", caller=Caller.ADMIN)
    async def deactivate(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        erase = optional_bool(parse_optional_json_object(call.request), "erase", False)
        if not row.deactivated:
            await self._api.deactivation.deactivate(Requester(row.user_id, "", 0), erase=erase)
        return 200, {"id_server_unbind_result": "success"}

    @route("POST", ADMIN_PREFIX + r"/v1/reset_password/" + USER, "admin_reset_password", caller=Caller.ADMIN)
    async def reset_password(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        body = parse_json_object(call.request)
        password = body.get("new_password")
        if not isinstance(password, str) or not password or len(password) > MAX_PASSWORD_LENGTH:
            raise missing_param("'new_password' must be a non-empty string")
        await self._api.set_password(row.user_id, password, logout=optional_bool(body, "logout_devices", True))
        return 200, {}

    @route("GET", ADMIN_PREFIX + r"/v1/users/" + USER + r"/admin", "admin_get_admin", caller=Caller.ADMIN)
    async def get_admin(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        return 200, {"admin": row.admin}

    @route("PUT", ADMIN_PREFIX + r"/v1/users/" + USER + r"/admin", "admin_put_admin", caller=Caller.ADMIN)
    async def put_admin(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        admin = parse_json_object(call.request).get("admin")
        if not isinstance(admin, bool):
            raise missing_param("Missing 'admin' (true or false)")
        if row.user_id == call.user.user_id and not admin:
            raise MatrixError(400, "M_UNKNOWN", "You may not demote yourself.")
        await self._store.set_admin(row.user_id, admin)
        return 200, {}

    @route("GET", USERS + r"/devices", "admin_devices", caller=Caller.ADMIN)
    async def list_devices(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        found = await self._devices.get_devices(row.user_id)
        return 200, {"devices": [_device_json(d) for d in found], "total": len(found)}

    @route("GET", USERS + DEVICE, "admin_device", caller=Caller.ADMIN)
    async def get_device(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        return 200, _device_json(await self._devices.get_device(row.user_id, call.params["device_id"]))

    @route("PUT", USERS + DEVICE, "admin_device", caller=Caller.ADMIN)
    async def put_device(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        device_id = call.params["device_id"]
        name = parse_json_object(call.request).get("display_name")
        if name is not None and (not isinstance(name, str) or len(name) > 1000):
            raise bad_json("'display_name' must be a string")
        await self._devices.get_device(row.user_id, device_id)
        await self._devices.set_display_name(row.user_id, device_id, name)
        return 200, {}

    @route("DELETE", USERS + DEVICE, "admin_device", caller=Caller.ADMIN)
    async def delete_device(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        await self._devices.delete_devices(row.user_id, [call.params["device_id"]])
        return 200, {}

    @route("POST", USERS + r"/delete_devices", "admin_delete_devices", caller=Caller.ADMIN)
    async def delete_devices(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        ids = parse_json_object(call.request).get("devices")
        if not isinstance(ids, list) or not all(isinstance(d, str) for d in ids) or len(ids) > 1000:
            raise bad_json("'devices' must be a list of device IDs")
        await self._devices.delete_devices(row.user_id, ids)
        return 200, {}

    @route("GET", ADMIN_PREFIX + r"/v1/users/" + USER + r"/joined_rooms", "admin_joined_rooms", caller=Caller.ADMIN)
    async def joined_rooms(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        rooms = await self._api.timeline.get_rooms_for_user(row.user_id)
        joined = sorted(room_id for room_id, (membership, _) in rooms.items() if membership == "join")
        return 200, {"joined_rooms": joined, "total": len(joined)}

    @route("GET", ADMIN_PREFIX + r"/v1/whois/" + USER, "admin_whois", caller=Caller.ADMIN_OR_SELF)
    @route("GET", r"/_matrix/client/(?:r0|v3)/admin/whois/" + USER, "admin_whois", caller=Caller.ADMIN_OR_SELF)
    async def whois(self, call: Call) -> Response:
        row = await self._api.existing_user(call.params["user_id"])
        sessions = await self._store.get_sessions(row.user_id)
        return 200, {"user_id": row.user_id, "devices": {
            device_id: {"sessions": [{"connections": [] if ts is None else [
                {"ip": ip, "last_seen": ts, "user_agent": None}]}]}
            for device_id, ip, ts in sessions}}


class RoomServlets:
    def __init__(self, api: AdminApi) -> None:
        self._api = api
        self._store = api.store
        self._tasks = api.tasks
        self._clock = api.clock

    @route("POST", ADMIN_PREFIX + r"/v1/purge_history/" + ROOM + r"(?:/(?P<event_id>[^/]+))?", "admin_purge_history",
           caller=Caller.ADMIN, body=Body.OPTIONAL_OBJECT)
    async def purge_history(self, call: Call) -> Response:
        room_id, body, store = call.params["room_id"], call.content, self._store
        if not await store.room_exists(room_id):
            raise not_found("Room not found")
        event_id = call.params.get("event_id") or body.get("purge_up_to_event_id")
        before_ts = body.get("purge_up_to_ts")
        before_stream: int | None = None
        if event_id is not None:
            if not isinstance(event_id, str) or len(event_id) > 255:
                raise bad_json("'purge_up_to_event_id' must be an event ID")
            before_stream = await store.get_event_position(room_id, event_id)
            if before_stream is None:
                raise not_found("Event not found in this room")
        elif not isinstance(before_ts, int) or isinstance(before_ts, bool) or before_ts < 0:
            raise MatrixError(400, "M_MISSING_PARAM", "must specify purge_up_to_event_id or purge_up_to_ts")
        else:
            before_stream = None
        local = optional_bool(body, "delete_local_events", False)
        if await self._tasks.active("purge_history", room_id):
            raise MatrixError(400, "M_UNKNOWN", f"History purge already in progress for {room_id}")
        task = await self._tasks.start("purge_history", room_id, {
            "by": call.user.user_id, "room_id": room_id, "before_stream": before_stream,
            "before_ts": None if event_id is not None else before_ts, "delete_local_events": local})
        return 200, {"purge_id": task.id}

    @route("GET", ADMIN_PREFIX + r"/v1/purge_history_status/(?P<purge_id>[^/]+)", "admin_purge_history_status",
           caller=Caller.ADMIN)
    async def purge_status(self, call: Call) -> Response:
        task = await self._task(call.params["purge_id"], "purge_history", "purge id not found")
        answer: dict[str, Any] = {"status": {"scheduled": "active"}.get(task.status, task.status)}
        if task.error is not None:
            answer["error"] = task.error
        return 200, answer

    @route("POST", ADMIN_PREFIX + r"/v1/rooms/(?P<room>[^/]+)/make_room_admin", "admin_make_room_admin",
           caller=Caller.ADMIN, body=Body.OPTIONAL_OBJECT)
    async def make_room_admin(self, call: Call) -> Response:
        target = call.content.get("user_id", call.user.user_id)
        if not isinstance(target, str) or not is_valid_user_id(target):
            raise invalid_param("'user_id' must be a user ID")
        await self._api.existing_user(target)
        room_id = await self._api.rooms.resolve_room(call.params["room"])
        await self._api.make_room_admin(room_id, target)
        return 200, {}

    @route("GET", ADMIN_PREFIX + r"/v1/rooms", "admin_list_rooms", caller=Caller.ADMIN)
    async def list_rooms(self, call: Call) -> Response:
        request = call.request
        offset, limit = _page(request)
        search = query_string(request, "search_term")
        if search is not None and len(search) > 255:
            raise invalid_param("search_term is too long")
        rooms, total = await self._store.list_rooms(
            server_name=self._api.server_name, offset=offset, limit=limit,
            order_by=_order(request, ROOM_ORDERS, "name"), descending=_direction(request), search_term=search)
        response: dict[str, Any] = {"rooms": [_room_json(r) for r in rooms], "offset": offset,
                                    "total_rooms": total}
        if offset + len(rooms) < total:
            response["next_batch"] = offset + len(rooms)
        if offset > 0:
            response["prev_batch"] = max(0, offset - limit)
        return 200, response

    async def _room(self, room_id: str) -> dict[str, Any]:
        rooms, _ = await self._store.list_rooms(server_name=self._api.server_name, offset=0, limit=1,
                                                order_by="name", descending=False, search_term=None, room_id=room_id)
        if not rooms:
            raise not_found("Room not found")
        return rooms[0]

    @route("GET", ROOMS, "admin_room", caller=Caller.ADMIN)
    async def room_details(self, call: Call) -> Response:
        room = await self._room(call.params["room_id"])
        return 200, {**_room_json(room), "topic": room["topic"], "avatar": room["avatar"], "forgotten": False}

    @route("DELETE", ROOMS, "admin_delete_room", caller=Caller.ADMIN, body=Body.OPTIONAL_OBJECT)
    async def delete_v1(self, call: Call) -> Response:
        options = _delete_options(call.content)
        return 200, await self._api.shut_down_room(call.user.user_id, call.params["room_id"], options, task_id=None)

    @route("GET", ROOMS + r"/members", "admin_room_members", caller=Caller.ADMIN)
    async def members(self, call: Call) -> Response:
        await self._room(call.params["room_id"])
        joined = await self._store.get_room_members(call.params["room_id"])
        return 200, {"members": joined, "total": len(joined)}

    @route("GET", ROOMS + r"/state", "admin_room_state", caller=Caller.ADMIN)
    async def state(self, call: Call) -> Response:
        await self._room(call.params["room_id"])
        return 200, {"state": [json.loads(text) for text in await self._store.get_room_state(call.params["room_id"])]}

    @route("GET", ROOMS + r"/block", "admin_room_block", caller=Caller.ADMIN)
    async def get_block(self, call: Call) -> Response:
        by = await self._store.get_block(call.params["room_id"])
        return 200, {"block": True, "user_id": by} if by is not None else {"block": False}

    @route("PUT", ROOMS + r"/block", "admin_room_block", caller=Caller.ADMIN, body=Body.OBJECT)
    async def put_block(self, call: Call) -> Response:
        value = call.content.get("block")
        if not isinstance(value, bool):
            raise bad_json("'block' must be true or false")
        await self._store.block_room(call.params["room_id"], call.user.user_id, value, int(self._clock() * 1000))
        return 200, {"block": value}

    @route("DELETE", ADMIN_PREFIX + r"/v2/rooms/" + ROOM, "admin_delete_room_v2", caller=Caller.ADMIN,
           body=Body.OPTIONAL_OBJECT)
    async def delete_v2(self, call: Call) -> Response:
        room_id = call.params["room_id"]
        options = _delete_options(call.content)
        if await self._tasks.active("shutdown_and_purge_room", room_id):
            raise MatrixError(400, "M_UNKNOWN", f"History purge already in progress for {room_id}")
        task = await self._tasks.start("shutdown_and_purge_room", room_id,
                                       {"by": call.user.user_id, "room_id": room_id, "options": options})
        return 200, {"delete_id": task.id}

    @route("GET", ADMIN_PREFIX + r"/v2/rooms/" + ROOM + r"/delete_status", "admin_delete_status", caller=Caller.ADMIN)
    async def delete_status_by_room(self, call: Call) -> Response:
        found = await self._tasks.list(action="shutdown_and_purge_room", resource_id=call.params["room_id"])
        if not found:
            raise not_found("No delete task for room")
        return 200, {"results": [t.delete_status() for t in found]}

    @route("GET", ADMIN_PREFIX + r"/v2/rooms/delete_status/(?P<delete_id>[^/]+)", "admin_delete_status",
           caller=Caller.ADMIN)
    async def delete_status(self, call: Call) -> Response:
        task = await self._task(call.params["delete_id"], "shutdown_and_purge_room", "delete id not found")
        status = task.delete_status()
        status.pop("delete_id")
        return 200, status

    async def _task(self, task_id: str, action: str, missing: str) -> Task:
        """The task ``task_id`` if it is an ``action``; 404 with ``missing`` otherwise."""
        task = await self._tasks.get(task_id)
        if task is None or task.action != action:
            raise not_found(missing)
        return task


class DestinationServlets:
    """Federation destinations. Their paths name the parameter ``server``, checked by the
    server-name grammar in the handler (so a bad one is audited like any answer)."""

    def __init__(self, store: AdminStore, server_name: str, remote_up: Callable[[str], None]) -> None:
        self._store = store
        self._server_name = server_name
        self._remote_up = remote_up

    @route("GET", DESTINATIONS, "admin_destinations", caller=Caller.ADMIN)
    async def list_destinations(self, call: Call) -> Response:
        request = call.request
        offset, limit = _page(request)
        search = query_string(request, "destination")
        rows, total = await self._store.list_destinations(
            offset=offset, limit=limit, order_by=_order(request, DESTINATION_ORDERS, "destination"),
            descending=_direction(request), search=search[:255] if search else None)
        return 200, {"destinations": [_destination_json(r) for r in rows], "total": total,
                     **_next_token(offset, len(rows), total)}

    @route("GET", DESTINATIONS + DESTINATION, "admin_destination", caller=Caller.ADMIN)
    async def destination(self, call: Call) -> Response:
        row = await self._store.get_destination(_destination(call))
        if row is None:
            raise not_found("Unknown destination")
        return 200, _destination_json(row)

    @route("GET", DESTINATIONS + DESTINATION + r"/rooms", "admin_destination_rooms", caller=Caller.ADMIN)
    async def destination_rooms(self, call: Call) -> Response:
        name = _destination(call)
        if await self._store.get_destination(name) is None:
            raise not_found("Unknown destination")
        offset, limit = _page(call.request)
        rows, total = await self._store.get_destination_rooms(name, offset=offset, limit=limit,
                                                              descending=_direction(call.request))
        return 200, {"rooms": [{"room_id": r, "stream_ordering": s} for r, s in rows], "total": total,
                     **_next_token(offset, len(rows), total)}

    @route("POST", DESTINATIONS + DESTINATION + r"/reset_connection", "admin_destination_reset", caller=Caller.ADMIN)
    async def reset_connection(self, call: Call) -> Response:
        name = _destination(call)
        if name == self._server_name:
            raise invalid_param("Cannot reset the connection to our own server")
        if not await self._store.reset_backoff(name):
            raise not_found("Unknown destination")
        self._remote_up(name)
        logger.info("[%s] backoff reset by %s", name, call.user.user_id)
        return 200, {}


class TokenServlets:
    """Registration tokens."""

    def __init__(self, store: AdminStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock

    @route("GET", TOKENS, "admin_registration_tokens", caller=Caller.ADMIN)
    async def list_tokens(self, call: Call) -> Response:
        valid = query_bool(call.request, "valid", None)
        rows = await self._store.list_registration_tokens(valid, int(self._clock() * 1000))
        return 200, {"registration_tokens": [_token_json(r) for r in rows]}

    @route("POST", TOKENS + r"/new", "admin_registration_token_new", caller=Caller.ADMIN, body=Body.OPTIONAL_OBJECT)
    async def new_token(self, call: Call) -> Response:
        body = call.content
        token = body.get("token")
        if token is None:
            length = body.get("length", 16)
            if not isinstance(length, int) or isinstance(length, bool) or not 0 < length <= 64:
                raise invalid_param("length must be an integer > 0 and <= 64")
            token = "".join(secrets.choice(TOKEN_ALPHABET) for _ in range(length))
        elif not isinstance(token, str) or not 0 < len(token) <= 64 or any(c not in TOKEN_ALPHABET for c in token):
            raise invalid_param("token must consist of characters from [A-Za-z0-9._~-] and be 1 to 64 long")
        uses, expiry = _nullable_int(body, "uses_allowed"), _nullable_int(body, "expiry_time")
        if expiry is not None and expiry < int(self._clock() * 1000):
            raise invalid_param("expiry_time must not be in the past")
        if not await self._store.create_registration_token(token, uses, expiry):
            raise invalid_param(f"Token already exists: {token}")
        row = await self._store.get_registration_token(token)
        assert row is not None
        return 200, _token_json(row)

    @route("GET", TOKENS + TOKEN, "admin_registration_token", caller=Caller.ADMIN)
    async def get_token(self, call: Call) -> Response:
        return 200, await self._answer(call.params["token"])

    @route("PUT", TOKENS + TOKEN, "admin_registration_token", caller=Caller.ADMIN, body=Body.OBJECT)
    async def put_token(self, call: Call) -> Response:
        token, body = call.params["token"], call.content
        changes: dict[str, int | None] = {key: _nullable_int(body, key) for key in ("uses_allowed", "expiry_time")
                                          if key in body}
        if not await self._store.update_registration_token(token, changes):
            raise not_found(f"No such registration token: {token}")
        return 200, await self._answer(token)

    @route("DELETE", TOKENS + TOKEN, "admin_registration_token", caller=Caller.ADMIN)
    async def delete_token(self, call: Call) -> Response:
        if not await self._store.delete_registration_token(call.params["token"]):
            raise not_found(f"No such registration token: {call.params['token']}")
        return 200, {}

    async def _answer(self, token: str) -> dict[str, Any]:
        row = await self._store.get_registration_token(token)
        if row is None:
            raise not_found(f"No such registration token: {token}")
        return _token_json(row)


class ServerServlets:
    """Server notices, the server's version, and its background work."""

    def __init__(self, tasks: TaskTracker,
                 send_notice: Callable[[str, str, Mapping[str, Any]], Awaitable[str]]) -> None:
        self._tasks = tasks
        self._send_notice = send_notice

    @route("POST", ADMIN_PREFIX + r"/v1/send_server_notice", "admin_send_server_notice", caller=Caller.ADMIN,
           body=Body.OBJECT)
    @route("PUT", ADMIN_PREFIX + r"/v1/send_server_notice/(?P<txn_id>[^/]+)", "admin_send_server_notice",
           caller=Caller.ADMIN, body=Body.OBJECT)
    async def server_notice(self, call: Call) -> Response:
        body = call.content
        user_id = body.get("user_id")
        if not isinstance(user_id, str) or not is_valid_user_id(user_id):
            raise invalid_param("'user_id' must be a user ID")
        content = body.get("content")
        if not isinstance(content, dict):
            raise bad_json("'content' must be an object")
        event_type = body.get("type", "m.room.message")
        if not isinstance(event_type, str) or not 0 < len(event_type) <= 255:
            raise bad_json("'type' must be an event type")
        if "state_key" in body:
            raise invalid_param("state events are not sent as server notices here")
        return 200, {"event_id": await self._send_notice(user_id, event_type, content)}

    @route("GET", ADMIN_PREFIX + r"/v1/server_version", "admin_server_version", caller=Caller.ADMIN)
    async def server_version(self, call: Call) -> Response:
        return 200, {"server_version": f"Tributary {__version__}"}

    @route("GET", ADMIN_PREFIX + r"/v1/background_updates/status", "admin_background_updates", caller=Caller.ADMIN)
    async def background_updates(self, call: Call) -> Response:
        # Schema changes run as migrations before start-up: no database update runs in the background.
        return 200, {"enabled": True, "current_updates": {}}

    @route("GET", ADMIN_PREFIX + r"/v1/scheduled_tasks", "admin_scheduled_tasks", caller=Caller.ADMIN)
    async def scheduled_tasks(self, call: Call) -> Response:
        action = query_string(call.request, "action_name")
        status = query_string(call.request, "status")
        return 200, {"scheduled_tasks": [task.to_json() for task in await self._tasks.list(action=action,
                                                                                           status=status)]}


def _destination(call: Call) -> str:
    """The destination a path names (its ``server`` parameter), checked by the server-name grammar."""
    if not is_valid_server_name(call.params["server"]):
        raise invalid_param("Not a valid server name")
    return call.params["server"]


def _token_json(row: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(("token", "uses_allowed", "pending", "completed", "expiry_time"), row, strict=True))


def _nullable_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0 or value > 2**53):
        raise invalid_param(f"{key} must be a non-negative integer or null")
    return value


def _delete_options(body: Mapping[str, Any]) -> dict[str, Any]:
    if body.get("new_room_user_id") is not None:
        raise invalid_param("new_room_user_id is not supported: local members are removed, not moved to a new room")
    for key in ("room_name", "message"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise bad_json(f"'{key}' must be a string")
    return {"block": optional_bool(dict(body), "block", False), "purge": optional_bool(dict(body), "purge", True),
            "force_purge": optional_bool(dict(body), "force_purge", False)}


def _device_json(device: Any) -> dict[str, Any]:
    return {"device_id": device.device_id, "display_name": device.display_name, "last_seen_ip": device.last_seen_ip,
            "last_seen_ts": device.last_seen_ts, "last_seen_user_agent": None, "user_id": device.user_id}


def _room_json(room: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("room_id", "name", "canonical_alias", "joined_members", "joined_local_members", "version", "creator",
            "encryption", "federatable", "public", "join_rules", "guest_access", "history_visibility",
            "state_events", "room_type")
    return {key: room[key] for key in keys}


def _destination_json(row: Any) -> dict[str, Any]:
    return {"destination": row.destination, "retry_last_ts": row.retry_last_ts,
            "retry_interval": row.retry_interval, "failure_ts": row.failure_ts,
            "last_successful_stream_ordering": row.last_successful_stream_ordering,
            "catch_up_from": row.catch_up_from, "rooms_behind": row.rooms_behind}
