"""A minimal Matrix client-server API client over urllib, for the interop check.

It speaks only the spec's client API (v3), so the same calls drive Tributary and
Synapse. It owns one user's access token and ``/sync`` position and remembers the
timeline events each sync returned; it knows nothing about federation.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any

import attrs

# Big enough that a test room's whole timeline fits in one sync.
SYNC_FILTER = json.dumps({"room": {"timeline": {"limit": 100}}, "presence": {"not_types": ["*"]}})


class MatrixApiError(Exception):
    """A client API call answered with a non-2xx status."""

    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{method} {path} -> {status}: {body[:500].decode('utf-8', 'replace')}")


@attrs.define
class MatrixUser:
    base_url: str
    user_id: str = ""
    access_token: str = ""
    since: str | None = None
    # room ID -> every timeline event /sync has shown this user, in order.
    timelines: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict)
    joined: set[str] = attrs.field(factory=set)
    invited: set[str] = attrs.field(factory=set)
    knocked: set[str] = attrs.field(factory=set)

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = 60.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.access_token:
            req.add_header("Authorization", f"Bearer {self.access_token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise MatrixApiError(method, path, e.code, e.read()) from None

    # Accounts --------------------------------------------------------------------------------

    def register(self, username: str, password: str) -> None:
        """Register through user-interactive auth: ask for a session, complete ``m.login.dummy``."""
        body: dict[str, Any] = {"username": username, "password": password}
        try:
            result = self.request("POST", "/_matrix/client/v3/register", body)
        except MatrixApiError as e:
            if e.status != 401:
                raise
            session = json.loads(e.body).get("session")
            body["auth"] = {"type": "m.login.dummy", **({"session": session} if session else {})}
            result = self.request("POST", "/_matrix/client/v3/register", body)
        self.user_id = result["user_id"]
        self.access_token = result["access_token"]

    # Rooms -----------------------------------------------------------------------------------

    def create_room(self, **content: Any) -> str:
        return str(self.request("POST", "/_matrix/client/v3/createRoom", content)["room_id"])

    def join(self, room_id_or_alias: str, *, via: list[str] | None = None) -> str:
        query = ("?" + urllib.parse.urlencode([("via", s) for s in via])) if via else ""
        path = f"/_matrix/client/v3/join/{urllib.parse.quote(room_id_or_alias, safe='')}{query}"
        return str(self.request("POST", path, {}, timeout=120.0)["room_id"])

    def knock(self, room_id_or_alias: str, *, via: list[str] | None = None, reason: str = "let me in") -> str:
        query = ("?" + urllib.parse.urlencode([("via", s) for s in via])) if via else ""
        path = f"/_matrix/client/v3/knock/{urllib.parse.quote(room_id_or_alias, safe='')}{query}"
        return str(self.request("POST", path, {"reason": reason}, timeout=120.0)["room_id"])

    def membership_of(self, room_id: str, user_id: str) -> str | None:
        """``user_id``'s membership in the room's current state, as this user's server sees it."""
        path = (f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id)}/state/m.room.member/"
                f"{urllib.parse.quote(user_id)}")
        try:
            membership = self.request("GET", path).get("membership")
        except MatrixApiError as e:
            if e.status == 404:
                return None
            raise
        return membership if isinstance(membership, str) else None

    def wait_for_membership(self, room_id: str, user_id: str, wanted: str, *, deadline_s: float = 30.0) -> None:
        deadline = time.monotonic() + deadline_s
        while (seen := self.membership_of(room_id, user_id)) != wanted:
            if time.monotonic() > deadline:
                raise AssertionError(f"{user_id} is {seen!r} in {room_id} on {self.base_url}, not {wanted!r}")
            time.sleep(0.2)

    def invite(self, room_id: str, user_id: str) -> None:
        self.request("POST", f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id)}/invite",
                     {"user_id": user_id}, timeout=120.0)

    def send_text(self, room_id: str, body: str) -> str:
        path = (f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id)}/send/m.room.message/"
                f"{uuid.uuid4().hex}")
        return str(self.request("PUT", path, {"msgtype": "m.text", "body": body})["event_id"])

    def room_version(self, room_id: str) -> str:
        create = self.request("GET", f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id)}/state/m.room.create/")
        return str(create.get("room_version", "1"))

    def messages(self, room_id: str, *, start: str | None, limit: int = 100) -> dict[str, Any]:
        query: dict[str, str] = {"dir": "b", "limit": str(limit)}
        if start is not None:
            query["from"] = start
        path = f"/_matrix/client/v3/rooms/{urllib.parse.quote(room_id)}/messages?{urllib.parse.urlencode(query)}"
        result: dict[str, Any] = self.request("GET", path, timeout=120.0)
        return result

    # Media -----------------------------------------------------------------------------------

    def raw(self, method: str, path: str, data: bytes | None = None, *, content_type: str | None = None,
            timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
        """A request whose body and answer are bytes (media): status, headers (lower-case), body."""
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if content_type is not None:
            req.add_header("Content-Type", content_type)
        if self.access_token:
            req.add_header("Authorization", f"Bearer {self.access_token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as e:
            raise MatrixApiError(method, path, e.code, e.read()) from None

    def upload(self, data: bytes, content_type: str, filename: str) -> str:
        """``POST /_matrix/media/v3/upload``; the ``mxc://`` URI."""
        path = "/_matrix/media/v3/upload?" + urllib.parse.urlencode({"filename": filename})
        _, _, body = self.raw("POST", path, data, content_type=content_type)
        return str(json.loads(body)["content_uri"])

    def download(self, mxc: str) -> tuple[dict[str, str], bytes]:
        """The authenticated download of ``mxc://server/id`` through this user's server."""
        server, media_id = mxc.removeprefix("mxc://").split("/", 1)
        _, headers, body = self.raw("GET", f"/_matrix/client/v1/media/download/{urllib.parse.quote(server)}/"
                                           f"{urllib.parse.quote(media_id)}", timeout=120.0)
        return headers, body

    def thumbnail(self, mxc: str, width: int, height: int, method: str) -> tuple[dict[str, str], bytes]:
        server, media_id = mxc.removeprefix("mxc://").split("/", 1)
        query = urllib.parse.urlencode({"width": width, "height": height, "method": method})
        _, headers, body = self.raw("GET", f"/_matrix/client/v1/media/thumbnail/{urllib.parse.quote(server)}/"
                                           f"{urllib.parse.quote(media_id)}?{query}", timeout=120.0)
        return headers, body

    # Sync ------------------------------------------------------------------------------------

    def sync_once(self, *, timeout_ms: int) -> dict[str, Any]:
        """One ``/sync`` from the last position; records timelines, joins and invites."""
        query = {"timeout": str(timeout_ms), "filter": SYNC_FILTER}
        if self.since is not None:
            query["since"] = self.since
        result: dict[str, Any] = self.request(
            "GET", "/_matrix/client/v3/sync?" + urllib.parse.urlencode(query), timeout=timeout_ms / 1000 + 30
        )
        self.since = result["next_batch"]
        rooms = result.get("rooms", {})
        for room_id, room in rooms.get("join", {}).items():
            self.joined.add(room_id)
            self.invited.discard(room_id)
            self.timelines.setdefault(room_id, []).extend(room.get("timeline", {}).get("events", []))
        for room_id in rooms.get("invite", {}):
            self.invited.add(room_id)
            self.knocked.discard(room_id)
        for room_id in rooms.get("knock", {}):
            self.knocked.add(room_id)
        return result

    def bodies(self, room_id: str) -> list[str]:
        return [e["content"]["body"] for e in self.timelines.get(room_id, [])
                if e.get("type") == "m.room.message" and isinstance(e.get("content", {}).get("body"), str)]

    def sync_until_bodies(self, room_id: str, wanted: list[str], *, deadline_s: float = 30.0) -> None:
        """Long-poll ``/sync`` until every body of ``wanted`` has appeared in ``room_id``'s timeline."""
        deadline = time.monotonic() + deadline_s
        while not set(wanted) <= set(self.bodies(room_id)):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.user_id}'s /sync never showed {sorted(set(wanted) - set(self.bodies(room_id)))} "
                    f"in {room_id} within {deadline_s:.0f}s (saw {self.bodies(room_id)})"
                )
            self.sync_once(timeout_ms=1000)

    def sync_until_knocked(self, room_id: str, *, deadline_s: float = 30.0) -> None:
        deadline = time.monotonic() + deadline_s
        while room_id not in self.knocked:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.user_id}'s /sync never showed the knock on {room_id} "
                                     f"within {deadline_s:.0f}s")
            self.sync_once(timeout_ms=1000)

    def sync_until_invited(self, room_id: str, *, deadline_s: float = 30.0) -> None:
        deadline = time.monotonic() + deadline_s
        while room_id not in self.invited and room_id not in self.joined:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.user_id}'s /sync never showed the invite to {room_id} "
                                     f"within {deadline_s:.0f}s")
            self.sync_once(timeout_ms=1000)
