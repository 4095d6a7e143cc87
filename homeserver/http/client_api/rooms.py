"""Room servlets: create, aliases, membership, send, state, events, history, redaction, typing, receipts.

Each servlet class declares its routes (``homeserver/http/routes.py``: the gate authenticates
and, where declared, parses the body); its handlers parse path, query and body into typed
values (``MatrixError`` for anything malformed) and call ``RoomHandler``, ``MessagesHandler``
or the typing, receipts and fully-read writers. ``sync.py`` registers them in this order.
"""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_fuzz.py, tests/integration/test_client_legacy.py,
#        tests/unit/http/test_client_room_routes.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from twisted.web.server import Request

from homeserver.events import constants as C
from homeserver.events.identifiers import is_valid_event_id, is_valid_server_name
from homeserver.events.validation import (
    MAX_AVATAR_URL_LENGTH,
    MAX_DISPLAYNAME_LENGTH,
    check_room_id,
    check_text,
    check_user_id,
)
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.ephemeral.receipts import check_receipt_thread
from homeserver.handlers.rooms.messages import MessagesHandler, parse_event_filter
from homeserver.handlers.rooms.rooms import MEMBERSHIP_ACTIONS, RoomHandler
from homeserver.handlers.writers import FullyReadWriter, ReceiptsWriter, TypingWriter
from homeserver.http.client_api._base import (
    client_path,
    empty,
    optional_bool,
    optional_string,
    query_int,
    query_string,
    required_string,
)
from homeserver.http.routes import Body, Call, Caller, Response, route
from homeserver.http.server import CLIENT_JSON, parse_json_object, parse_optional_json_object
from storage.kernel.errors import bad_json, invalid_param
from storage.kernel.json_input import JsonInputError, decode_json

MAX_ID_LENGTH: Final = 255
MAX_REASON_LENGTH: Final = 2048
ROOM: Final = r"/rooms/(?P<room_id>[^/]+)"


# The largest ``ts`` a service may give: canonical JSON's integer range.
MAX_TS = 2**53 - 1


def _massaged_ts(request: Request, requester: Requester) -> int | None:
    """``?ts=`` on a send or state PUT: an application service's timestamp for the event (the
    spec's timestamp massaging); ignored for anyone else, as Synapse does."""
    if requester.app_service is None:
        return None
    text = query_string(request, "ts")
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 16 or int(text) > MAX_TS:
        raise invalid_param(f"ts must be a timestamp in milliseconds, got {text[:50]!r}")
    return int(text)


def _room_id(params: Mapping[str, str]) -> str:
    return check_room_id(params["room_id"])


def _event_id(value: str) -> str:
    if not is_valid_event_id(value):
        raise invalid_param(f"Invalid event ID {value[:100]!r}")
    return value


# Body keys of POST /join that are not the member event's content: the server sets the
# membership, a restricted join's authoriser is chosen by the resident server, not the
# client, and third_party_signed is an invite's proof.
NOT_JOIN_CONTENT: Final = frozenset({"membership", C.AUTHORISING_USER, "third_party_signed"})
NULL_MEANS_UNSET: Final = frozenset({"displayname", "avatar_url", "reason"})


def _join_content(body: Mapping[str, Any]) -> dict[str, Any]:
    """``POST /join``'s body as the join's content, as Synapse: other keys are kept,
    and ``displayname`` / ``avatar_url`` given there are a per-room profile."""
    content = {key: value for key, value in body.items() if key not in NOT_JOIN_CONTENT}
    if "reason" in content:
        optional_string(content, "reason", max_length=MAX_REASON_LENGTH)
    if "displayname" in content:
        optional_string(content, "displayname", max_length=MAX_DISPLAYNAME_LENGTH)
    if "avatar_url" in content:
        optional_string(content, "avatar_url", max_length=MAX_AVATAR_URL_LENGTH)
    # null for these means "not given" (the profile's, no reason).
    return {key: value for key, value in content.items() if value is not None or key not in NULL_MEANS_UNSET}


def _short(value: str, name: str) -> str:
    return check_text(value, name, max_length=MAX_ID_LENGTH, allow_empty=False)


MAX_VIA_SERVERS: Final = 20


def _query_servers(request: Request) -> list[str]:
    """The ``via`` and (deprecated) ``server_name`` query parameters: servers to join through."""
    args: dict[bytes, list[bytes]] = request.args or {}
    servers: list[str] = []
    for raw in [*args.get(b"via", []), *args.get(b"server_name", [])][:MAX_VIA_SERVERS]:
        try:
            server = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid_param("Query parameters 'via'/'server_name' must be valid UTF-8") from None
        if not is_valid_server_name(server):
            raise invalid_param(f"Invalid server name {server[:100]!r} in 'via'/'server_name'")
        servers.append(server)
    return servers


def _query_json(request: Request, name: str) -> Any:
    text = query_string(request, name)
    if text is None:
        return None
    if len(text) > 8192:
        raise invalid_param(f"Query parameter '{name}' is too long")
    try:
        return decode_json(text, CLIENT_JSON)
    except JsonInputError as e:
        raise invalid_param(f"Query parameter '{name}' must be JSON: {e.error}") from None


ALIAS: Final = client_path(r"/directory/room/(?P<alias>[^/]+)")
STATE: Final = client_path(ROOM + r"/state/(?P<event_type>[^/]+)(?:/(?P<state_key>[^/]*))?")


class RoomServlets:
    """Create, aliases, membership, members, send, state and single events: ``RoomHandler``."""

    def __init__(self, rooms: RoomHandler) -> None:
        self._rooms = rooms

    @route("POST", client_path(r"/createRoom"), "client_create_room", caller=Caller.USER,
           body=Body.OPTIONAL_OBJECT)
    async def create_room(self, call: Call) -> Response:
        room_id, alias = await self._rooms.create_room(call.user, call.content)
        out: dict[str, Any] = {"room_id": room_id}
        if alias is not None:
            out["room_alias"] = alias
        return 200, out

    @route("GET", ALIAS, "client_room_alias", caller=Caller.NONE)
    async def get_alias(self, call: Call) -> Response:
        return 200, await self._rooms.get_alias(call.params["alias"])

    @route("PUT", ALIAS, "client_room_alias_put", caller=Caller.USER, body=Body.OBJECT)
    async def put_alias(self, call: Call) -> Response:
        room_id = required_string(call.content, "room_id", max_length=MAX_ID_LENGTH)
        await self._rooms.put_alias(call.user, call.params["alias"], await self._rooms.resolve_room(room_id))
        return empty()

    @route("DELETE", ALIAS, "client_room_alias_delete", caller=Caller.USER)
    async def delete_alias(self, call: Call) -> Response:
        await self._rooms.delete_alias(call.user, call.params["alias"])
        return empty()

    @route("POST", client_path(r"/join/(?P<room>[^/]+)"), "client_join", caller=Caller.GUEST,
           body=Body.OPTIONAL_OBJECT)
    async def join_by_id_or_alias(self, call: Call) -> Response:
        servers = _query_servers(call.request)
        room_id = await self._rooms.join(call.user, call.params["room"], servers=servers,
                                         content=_join_content(call.content))
        return 200, {"room_id": room_id}

    @route("POST", client_path(r"/knock/(?P<room>[^/]+)"), "client_knock", caller=Caller.USER,
           body=Body.OPTIONAL_OBJECT)
    async def knock(self, call: Call) -> Response:
        reason = optional_string(call.content, "reason", max_length=MAX_REASON_LENGTH)
        room_id = await self._rooms.knock(call.user, call.params["room"], servers=_query_servers(call.request),
                                          reason=reason)
        return 200, {"room_id": room_id}

    # The room ID is checked before the body is read (Body.NONE), as it always was.
    @route("POST", client_path(ROOM + r"/(?P<action>join|leave|invite|kick|ban|unban|forget)"),
           "client_room_membership", caller=Caller.GUEST, guests=("action", ("join", "leave")))
    async def membership(self, call: Call) -> Response:
        requester, rooms = call.user, self._rooms
        room_id = _room_id(call.params)
        action = call.params["action"]
        body = parse_optional_json_object(call.request)
        if action == "join":
            await rooms.join(requester, room_id, content=_join_content(body))
            return 200, {"room_id": room_id}
        reason = optional_string(body, "reason", max_length=MAX_REASON_LENGTH)
        if action == "leave":
            await rooms.update_membership(requester, room_id, requester.user_id, C.LEAVE, reason=reason)
            return empty()
        if action == "forget":
            await rooms.forget(requester, room_id)
            return empty()
        target = check_user_id(required_string(body, "user_id", max_length=MAX_ID_LENGTH))
        extra: dict[str, Any] = {}
        if action == "invite" and optional_bool(body, "is_direct", False):
            extra["is_direct"] = True
        await rooms.update_membership(
            requester, room_id, target, MEMBERSHIP_ACTIONS[action], reason=reason, extra=extra, action=action
        )
        return empty()

    @route("GET", client_path(r"/joined_rooms"), "client_joined_rooms", caller=Caller.GUEST)
    async def joined_rooms(self, call: Call) -> Response:
        return 200, {"joined_rooms": await self._rooms.joined_rooms(call.user.user_id)}

    @route("GET", client_path(ROOM + r"/members"), "client_room_members", caller=Caller.GUEST)
    async def members(self, call: Call) -> Response:
        chunk = await self._rooms.get_members(
            call.user,
            _room_id(call.params),
            membership=query_string(call.request, "membership"),
            not_membership=query_string(call.request, "not_membership"),
        )
        return 200, {"chunk": chunk}

    @route("GET", client_path(ROOM + r"/joined_members"), "client_room_joined_members", caller=Caller.USER)
    async def joined_members(self, call: Call) -> Response:
        return 200, await self._rooms.get_joined_members(call.user, _room_id(call.params))

    # The path is checked before the body is read (Body.NONE), as it always was. The older POST
    # form (r0's v1-style send) has no transaction ID: every call is a new event.
    @route("PUT", client_path(ROOM + r"/send/(?P<event_type>[^/]+)/(?P<txn_id>[^/]+)"), "client_room_send",
           caller=Caller.GUEST, guests=("event_type", ("m.room.message",)))
    @route("POST", client_path(ROOM + r"/send/(?P<event_type>[^/]+)"), "client_room_send_no_txn",
           caller=Caller.USER)
    async def send(self, call: Call) -> Response:
        requester, params = call.user, call.params
        room_id = _room_id(params)
        event_type = _short(params["event_type"], "eventType")
        txn_id = _short(params["txn_id"], "txnId") if params.get("txn_id") is not None else None
        body = parse_json_object(call.request)
        event_id = await self._rooms.send_event(requester, room_id, event_type, body, txn_id,
                                                ts=_massaged_ts(call.request, requester))
        return 200, {"event_id": event_id}

    # The path is checked before the body is read (Body.NONE), as it always was.
    @route("PUT", STATE, "client_room_state_put", caller=Caller.USER)
    async def put_state(self, call: Call) -> Response:
        requester, params = call.user, call.params
        room_id = _room_id(params)
        event_type = _short(params["event_type"], "eventType")
        state_key = check_text(params.get("state_key", ""), "stateKey", max_length=MAX_ID_LENGTH)
        body = parse_json_object(call.request)
        return 200, {"event_id": await self._rooms.send_state(requester, room_id, event_type, state_key, body,
                                                              ts=_massaged_ts(call.request, requester))}

    @route("GET", STATE, "client_room_state_event", caller=Caller.GUEST)
    async def get_state_event(self, call: Call) -> Response:
        params = call.params
        event_type = _short(params["event_type"], "eventType")
        state_key = check_text(params.get("state_key", ""), "stateKey", max_length=MAX_ID_LENGTH)
        # The spec's `format`: "content" (the default) or "event" for the whole client-format event.
        answer_format = query_string(call.request, "format") or "content"
        if answer_format not in ("content", "event"):
            raise invalid_param("'format' must be 'content' or 'event'")
        event = await self._rooms.get_state_event(call.user, _room_id(params), event_type, state_key)
        return 200, event if answer_format == "event" else event["content"]

    @route("GET", client_path(ROOM + r"/state"), "client_room_state", caller=Caller.GUEST)
    async def get_state(self, call: Call) -> Response:
        return 200, await self._rooms.get_state(call.user, _room_id(call.params))

    @route("GET", client_path(ROOM + r"/event/(?P<event_id>[^/]+)"), "client_room_event", caller=Caller.GUEST)
    async def get_event(self, call: Call) -> Response:
        return 200, await self._rooms.get_event(call.user, _room_id(call.params), _event_id(call.params["event_id"]))


class HistoryServlets:
    """A room's history: ``/messages`` and ``/context``, from ``MessagesHandler``."""

    def __init__(self, messages: MessagesHandler) -> None:
        self._messages = messages

    @route("GET", client_path(ROOM + r"/messages"), "client_room_messages", caller=Caller.GUEST)
    async def get_messages(self, call: Call) -> Response:
        request = call.request
        direction = query_string(request, "dir") or "b"
        if direction not in ("b", "f"):
            raise invalid_param("'dir' must be 'b' or 'f'")
        event_filter = parse_event_filter(_query_json(request, "filter"))
        limit = query_int(request, "limit", event_filter.limit if event_filter.limit is not None else 10)
        return 200, await self._messages.get_messages(
            call.user,
            _room_id(call.params),
            from_token=query_string(request, "from"),
            to_token=query_string(request, "to"),
            direction=direction,
            limit=limit,
            event_filter=event_filter,
        )

    @route("GET", client_path(ROOM + r"/context/(?P<event_id>[^/]+)"), "client_room_context", caller=Caller.GUEST)
    async def get_context(self, call: Call) -> Response:
        event_filter = parse_event_filter(_query_json(call.request, "filter"))
        return 200, await self._messages.get_context(
            call.user,
            _room_id(call.params),
            _event_id(call.params["event_id"]),
            limit=query_int(call.request, "limit", 10),
            event_filter=event_filter,
        )


class RedactionServlet:
    """``PUT /rooms/{roomId}/redact/{eventId}/{txnId}``: ``RoomHandler.redact``."""

    def __init__(self, rooms: RoomHandler) -> None:
        self._rooms = rooms

    @route("PUT", client_path(ROOM + r"/redact/(?P<event_id>[^/]+)/(?P<txn_id>[^/]+)"), "client_room_redact",
           caller=Caller.USER, body=Body.OPTIONAL_OBJECT)
    async def redact(self, call: Call) -> Response:
        reason = optional_string(call.content, "reason", max_length=MAX_REASON_LENGTH)
        p = call.params
        event_id = await self._rooms.redact(call.user, _room_id(p), _event_id(p["event_id"]),
                                            _short(p["txn_id"], "txnId"), reason)
        return 200, {"event_id": event_id}


class EphemeralServlets:
    """Typing notices, receipts and read markers (ephemeral, not room events): the typing, receipts
    and fully-read writers."""

    def __init__(self, typing: TypingWriter, receipts: ReceiptsWriter, fully_read: FullyReadWriter) -> None:
        self._typing = typing
        self._receipts = receipts
        self._fully_read = fully_read

    @route("PUT", client_path(ROOM + r"/typing/(?P<user_id>[^/]+)"), "client_room_typing", caller=Caller.GUEST,
           body=Body.OBJECT)
    async def put_typing(self, call: Call) -> Response:
        body = call.content
        is_typing = body.get("typing")
        if not isinstance(is_typing, bool):
            raise bad_json("'typing' must be true or false")
        timeout = body.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
            raise bad_json("'timeout' must be an integer")
        user_id = check_user_id(call.params["user_id"])
        await self._typing.set_typing(call.user, _room_id(call.params), user_id, is_typing, timeout)
        return empty()

    @route("POST", client_path(ROOM + r"/receipt/(?P<receipt_type>[^/]+)/(?P<event_id>[^/]+)"),
           "client_room_receipt", caller=Caller.GUEST, body=Body.OPTIONAL_OBJECT)
    async def post_receipt(self, call: Call) -> Response:
        thread_id = optional_string(call.content, "thread_id", max_length=MAX_ID_LENGTH)
        room_id = _room_id(call.params)
        event_id = _event_id(call.params["event_id"])
        receipt_type = call.params["receipt_type"]
        check_receipt_thread(receipt_type, thread_id)
        if receipt_type == "m.fully_read":
            await self._fully_read.set_fully_read(call.user, room_id, event_id)
            return empty()
        await self._receipts.receipt(call.user, room_id, receipt_type, event_id, thread_id)
        return empty()

    # The room ID is checked before the body is read (Body.NONE), as it always was.
    @route("POST", client_path(ROOM + r"/read_markers"), "client_room_read_markers", caller=Caller.GUEST)
    async def read_markers(self, call: Call) -> Response:
        requester = call.user
        room_id = _room_id(call.params)
        body = parse_json_object(call.request)
        fully_read = optional_string(body, "m.fully_read", max_length=MAX_ID_LENGTH)
        if fully_read is not None:
            await self._fully_read.set_fully_read(requester, room_id, _event_id(fully_read))
        for receipt_type in ("m.read", "m.read.private"):
            event_id = optional_string(body, receipt_type, max_length=MAX_ID_LENGTH)
            if event_id is not None:
                await self._receipts.receipt(requester, room_id, receipt_type, _event_id(event_id), None)
        return empty()

