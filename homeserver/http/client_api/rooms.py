"""Room servlets: create, aliases, membership, send, state, events, history, redaction, typing, receipts.

Each servlet authenticates, parses path, query and body into typed values
(``MatrixError`` for anything malformed) and calls ``RoomHandler``,
``MessagesHandler``, ``TypingHandler`` or ``ReceiptsHandler``.
"""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_fuzz.py, tests/integration/test_client_legacy.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from twisted.web.server import Request

from homeserver.events import constants as C
from homeserver.events.identifiers import is_valid_event_id, is_valid_server_name
from homeserver.handlers.accounts.auth import Auth, Requester
from homeserver.handlers.rooms.messages import MessagesHandler, parse_event_filter
from homeserver.handlers.rooms.rooms import MEMBERSHIP_ACTIONS, RoomHandler
from homeserver.handlers.writers import Writers
from homeserver.events.validation import (
    MAX_AVATAR_URL_LENGTH,
    MAX_DISPLAYNAME_LENGTH,
    check_room_id,
    check_text,
    check_user_id,
)
from homeserver.http.server import parse_optional_json_object
from homeserver.http.client_api._base import (
    client_path,
    empty,
    optional_bool,
    optional_string,
    query_int,
    query_string,
    required_string,
)
from homeserver.handlers.ephemeral.receipts import check_receipt_thread
from storage.kernel.errors import bad_json, invalid_param
from homeserver.http.server import CLIENT_JSON, Routes, parse_json_object
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


def register_room_servlets(
    router: Routes,
    *,
    auth: Auth,
    rooms: RoomHandler,
    messages: MessagesHandler,
    writers: Writers,
) -> None:
    async def create_room(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_optional_json_object(request)
        room_id, alias = await rooms.create_room(requester, body)
        out: dict[str, Any] = {"room_id": room_id}
        if alias is not None:
            out["room_alias"] = alias
        return 200, out

    async def get_alias(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        return 200, await rooms.get_alias(params["alias"])

    async def put_alias(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_json_object(request)
        room_id = required_string(body, "room_id", max_length=MAX_ID_LENGTH)
        await rooms.put_alias(requester, params["alias"], await rooms.resolve_room(room_id))
        return empty()

    async def delete_alias(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        await rooms.delete_alias(requester, params["alias"])
        return empty()

    async def join_by_id_or_alias(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_optional_json_object(request)
        servers = _query_servers(request)
        room_id = await rooms.join(requester, params["room"], servers=servers, content=_join_content(body))
        return 200, {"room_id": room_id}

    async def knock(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_optional_json_object(request)
        reason = optional_string(body, "reason", max_length=MAX_REASON_LENGTH)
        room_id = await rooms.knock(requester, params["room"], servers=_query_servers(request), reason=reason)
        return 200, {"room_id": room_id}

    async def membership(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        room_id = _room_id(params)
        action = params["action"]
        body = parse_optional_json_object(request)
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

    async def joined_rooms(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, {"joined_rooms": await rooms.joined_rooms(requester.user_id)}

    async def members(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        chunk = await rooms.get_members(
            requester,
            _room_id(params),
            membership=query_string(request, "membership"),
            not_membership=query_string(request, "not_membership"),
        )
        return 200, {"chunk": chunk}

    async def joined_members(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await rooms.get_joined_members(requester, _room_id(params))

    async def send(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        room_id = _room_id(params)
        event_type = _short(params["event_type"], "eventType")
        # The older POST form (r0's v1-style send) has no transaction ID: every call is a new event.
        txn_id = _short(params["txn_id"], "txnId") if params.get("txn_id") is not None else None
        body = parse_json_object(request)
        event_id = await rooms.send_event(requester, room_id, event_type, body, txn_id, ts=_massaged_ts(request, requester))
        return 200, {"event_id": event_id}

    async def put_state(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        room_id = _room_id(params)
        event_type = _short(params["event_type"], "eventType")
        state_key = check_text(params.get("state_key", ""), "stateKey", max_length=MAX_ID_LENGTH)
        body = parse_json_object(request)
        return 200, {"event_id": await rooms.send_state(requester, room_id, event_type, state_key, body,
                                                        ts=_massaged_ts(request, requester))}

    async def get_state(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await rooms.get_state(requester, _room_id(params))

    async def get_state_event(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        event_type = _short(params["event_type"], "eventType")
        state_key = check_text(params.get("state_key", ""), "stateKey", max_length=MAX_ID_LENGTH)
        # The spec's `format`: "content" (the default) or "event" for the whole client-format event.
        answer_format = query_string(request, "format") or "content"
        if answer_format not in ("content", "event"):
            raise invalid_param("'format' must be 'content' or 'event'")
        event = await rooms.get_state_event(requester, _room_id(params), event_type, state_key)
        return 200, event if answer_format == "event" else event["content"]

    async def get_event(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, await rooms.get_event(requester, _room_id(params), _event_id(params["event_id"]))

    async def get_messages(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        direction = query_string(request, "dir") or "b"
        if direction not in ("b", "f"):
            raise invalid_param("'dir' must be 'b' or 'f'")
        event_filter = parse_event_filter(_query_json(request, "filter"))
        limit = query_int(request, "limit", event_filter.limit if event_filter.limit is not None else 10)
        return 200, await messages.get_messages(
            requester,
            _room_id(params),
            from_token=query_string(request, "from"),
            to_token=query_string(request, "to"),
            direction=direction,
            limit=limit,
            event_filter=event_filter,
        )

    async def get_context(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        event_filter = parse_event_filter(_query_json(request, "filter"))
        return 200, await messages.get_context(
            requester,
            _room_id(params),
            _event_id(params["event_id"]),
            limit=query_int(request, "limit", 10),
            event_filter=event_filter,
        )

    async def redact(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_optional_json_object(request)
        reason = optional_string(body, "reason", max_length=MAX_REASON_LENGTH)
        event_id = await rooms.redact(
            requester, _room_id(params), _event_id(params["event_id"]), _short(params["txn_id"], "txnId"), reason
        )
        return 200, {"event_id": event_id}

    async def put_typing(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_json_object(request)
        is_typing = body.get("typing")
        if not isinstance(is_typing, bool):
            raise bad_json("'typing' must be true or false")
        timeout = body.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
            raise bad_json("'timeout' must be an integer")
        user_id = check_user_id(params["user_id"])
        await writers.typing.set_typing(requester, _room_id(params), user_id, is_typing, timeout)
        return empty()

    async def post_receipt(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        body = parse_optional_json_object(request)
        thread_id = optional_string(body, "thread_id", max_length=MAX_ID_LENGTH)
        room_id = _room_id(params)
        event_id = _event_id(params["event_id"])
        receipt_type = params["receipt_type"]
        check_receipt_thread(receipt_type, thread_id)
        if receipt_type == "m.fully_read":
            await _fully_read(requester, room_id, event_id)
            return empty()
        await writers.receipts.receipt(requester, room_id, receipt_type, event_id, thread_id)
        return empty()

    async def _fully_read(requester: Any, room_id: str, event_id: str) -> None:
        await writers.fully_read.set_fully_read(requester, room_id, event_id)

    async def read_markers(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        room_id = _room_id(params)
        body = parse_json_object(request)
        fully_read = optional_string(body, "m.fully_read", max_length=MAX_ID_LENGTH)
        if fully_read is not None:
            await _fully_read(requester, room_id, _event_id(fully_read))
        for receipt_type in ("m.read", "m.read.private"):
            event_id = optional_string(body, receipt_type, max_length=MAX_ID_LENGTH)
            if event_id is not None:
                await writers.receipts.receipt(requester, room_id, receipt_type, _event_id(event_id), None)
        return empty()

    alias_path = client_path(r"/directory/room/(?P<alias>[^/]+)")
    router.register(["POST"], client_path(r"/createRoom"), create_room, "client_create_room")
    router.register(["GET"], alias_path, get_alias, "client_room_alias")
    router.register(["PUT"], alias_path, put_alias, "client_room_alias_put")
    router.register(["DELETE"], alias_path, delete_alias, "client_room_alias_delete")
    router.register(["POST"], client_path(r"/join/(?P<room>[^/]+)"), join_by_id_or_alias, "client_join")
    router.register(["POST"], client_path(r"/knock/(?P<room>[^/]+)"), knock, "client_knock")
    router.register(
        ["POST"],
        client_path(ROOM + r"/(?P<action>join|leave|invite|kick|ban|unban|forget)"),
        membership,
        "client_room_membership",
    )
    router.register(["GET"], client_path(r"/joined_rooms"), joined_rooms, "client_joined_rooms")
    router.register(["GET"], client_path(ROOM + r"/members"), members, "client_room_members")
    router.register(["GET"], client_path(ROOM + r"/joined_members"), joined_members, "client_room_joined_members")
    router.register(
        ["PUT"], client_path(ROOM + r"/send/(?P<event_type>[^/]+)/(?P<txn_id>[^/]+)"), send, "client_room_send"
    )
    router.register(["POST"], client_path(ROOM + r"/send/(?P<event_type>[^/]+)"), send, "client_room_send_no_txn")
    state_path = client_path(ROOM + r"/state/(?P<event_type>[^/]+)(?:/(?P<state_key>[^/]*))?")
    router.register(["PUT"], state_path, put_state, "client_room_state_put")
    router.register(["GET"], state_path, get_state_event, "client_room_state_event")
    router.register(["GET"], client_path(ROOM + r"/state"), get_state, "client_room_state")
    router.register(["GET"], client_path(ROOM + r"/event/(?P<event_id>[^/]+)"), get_event, "client_room_event")
    router.register(["GET"], client_path(ROOM + r"/messages"), get_messages, "client_room_messages")
    router.register(["GET"], client_path(ROOM + r"/context/(?P<event_id>[^/]+)"), get_context, "client_room_context")
    router.register(
        ["PUT"], client_path(ROOM + r"/redact/(?P<event_id>[^/]+)/(?P<txn_id>[^/]+)"), redact, "client_room_redact"
    )
    router.register(["PUT"], client_path(ROOM + r"/typing/(?P<user_id>[^/]+)"), put_typing, "client_room_typing")
    router.register(
        ["POST"],
        client_path(ROOM + r"/receipt/(?P<receipt_type>[^/]+)/(?P<event_id>[^/]+)"),
        post_receipt,
        "client_room_receipt",
    )
    router.register(["POST"], client_path(ROOM + r"/read_markers"), read_markers, "client_room_read_markers")
