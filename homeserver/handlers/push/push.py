"""Push: which local users an event notifies, the pushers API and ``GET /notifications``.

``PushActionsEvaluator.actions_txn(event)`` runs once per event, in the process that
persists it (the room's events writer), inside its transaction: every local joined member
other than the sender (and a local invitee) gets one evaluation of their rules
(``push_rules.effective_rules`` over the stored ``m.push_rules``, ``push_evaluator``), and
those it notifies become ``PushAction`` rows written with the event. /sync's unread counts,
``GET /notifications`` and the pusher process (``homeserver/handlers/push/pusher.py``) read those
rows, so counts and pushes always agree.

``PushersHandler`` validates ``POST /pushers/set`` as the spec says (an ``http`` pusher's
``data.url`` ends in ``/_matrix/push/v1/notify``; ``kind: null`` removes).
"""

# tests: tests/unit/handlers/test_push.py, tests/integration/test_push.py

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import urlsplit

from homeserver.events import FrozenEvent
from homeserver.events import constants as C
from homeserver.events.identifiers import server_name_of
from homeserver.handlers.accounts.auth import Requester
from homeserver.events.push_evaluator import PushContext, compiled_rules
from homeserver.events.push_rules import effective_rules
from homeserver.events.validation import check_text, dump_json_object
from storage.kernel.errors import MatrixError, bad_json, invalid_param, missing_param
from storage.database import Transaction
from storage.stores.push import PushAction, PushContextRow, PushStore, PusherRow, get_push_context_txn

logger = logging.getLogger(__name__)

PUSH_GATEWAY_PATH: Final = "/_matrix/push/v1/notify"
MAX_PUSHERS_PER_USER: Final = 50
MAX_NOTIFICATIONS_LIMIT: Final = 1000
DEFAULT_NOTIFICATIONS_LIMIT: Final = 50


def power_level(levels: Mapping[str, Any], user_id: str) -> int:
    users = levels.get("users")
    if isinstance(users, Mapping) and isinstance(users.get(user_id), int):
        return int(users[user_id])
    default = levels.get("users_default", 0)
    return default if isinstance(default, int) else 0


def notification_levels(levels: Mapping[str, Any]) -> dict[str, int]:
    notifications = levels.get("notifications")
    room = notifications.get("room") if isinstance(notifications, Mapping) else None
    return {"room": room if isinstance(room, int) else 50}


PushContextReader = Callable[[Transaction, str, str, Collection[str]], PushContextRow]
"""``(txn, room_id, server_name, extra_users)``: the room as push rules see it (``get_push_context_txn``)."""


class PushActionsEvaluator:
    """Evaluates a new event for its local recipients (see the module docstring)."""

    def __init__(self, server_name: str) -> None:
        self._server_name = server_name

    def actions_txn(
        self, event: FrozenEvent, *, read_room: PushContextReader = get_push_context_txn
    ) -> Callable[[Transaction], tuple[PushAction, ...]]:
        """What the event's persist transaction calls: read the room (one statement, before the
        event is written) and evaluate. A failure to evaluate is logged and notifies nobody:
        it must never keep an event out of its room. ``read_room``: how the room is read (a
        batch of events shares one read while none of them changes the room's state)."""
        extra: tuple[str, ...] = ()
        if (event.type == C.MEMBER and event.membership == C.INVITE and event.state_key
                and server_name_of(event.state_key) == self._server_name):
            extra = (event.state_key,)

        def in_txn(txn: Transaction) -> tuple[PushAction, ...]:
            room = read_room(txn, event.room_id, self._server_name, extra)
            try:
                return evaluate_for_room(event, room)
            except Exception:
                logger.exception("could not evaluate push rules for %s", event.event_id)
                return ()

        return in_txn


def evaluate_for_room(event: FrozenEvent, room: PushContextRow) -> tuple[PushAction, ...]:
    """Pure: the notifications of ``event`` for the room's local recipients (not its sender).

    Each recipient's rules are compiled once per text of their ``m.push_rules`` and the power
    levels parsed once per text (both cached), and the rules read the frozen PDU as it is: an
    event costs the matchers its recipients' rules reach, not a copy or parse per recipient."""
    recipients = {u: v for u, v in room.recipients.items() if u != event.sender}
    if not recipients:
        return ()
    sender_level, notify_levels = _levels(room.power_levels_json, event.sender)
    pdu = event.pdu
    relation = event.content.get("m.relates_to")
    thread_id = None
    if isinstance(relation, Mapping) and relation.get("rel_type") == "m.thread":
        root = relation.get("event_id")
        thread_id = root if isinstance(root, str) and root else None
    actions: list[PushAction] = []
    for user_id, (display_name, rules_json) in sorted(recipients.items()):
        context = PushContext(user_id, display_name, room.member_count, sender_level, notify_levels)
        outcome = compiled_rules(user_id, rules_json, effective_rules).evaluate(pdu, context)
        if outcome.notify:
            actions.append(PushAction(user_id, outcome.highlight, outcome.actions_json, thread_id))
    return tuple(actions)


def _levels(power_levels_json: str | None, sender: str) -> tuple[int, Mapping[str, int]]:
    """The sender's power level and the room's notification levels (``m.room.power_levels``, as
    stored: the event's JSON, or None)."""
    levels = _power_levels_content(power_levels_json)
    return power_level(levels, sender), _notification_levels(power_levels_json)


@lru_cache(maxsize=1024)
def _power_levels_content(power_levels_json: str | None) -> Mapping[str, Any]:
    if power_levels_json is None:
        return MappingProxyType({})
    content = json.loads(power_levels_json).get("content")
    return MappingProxyType(content) if isinstance(content, dict) else MappingProxyType({})  # shared: read-only


@lru_cache(maxsize=1024)
def _notification_levels(power_levels_json: str | None) -> Mapping[str, int]:
    return MappingProxyType(notification_levels(_power_levels_content(power_levels_json)))


def _string(body: Mapping[str, Any], name: str, *, max_length: int, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise missing_param(f"'{name}' must be a string") if value is None else bad_json(f"'{name}' must be a string")
    return check_text(value, name, max_length=max_length, allow_empty=False)


def check_gateway_url(url: Any) -> str:
    """An ``http`` pusher's ``data.url``: an http(s) URL whose path is the push gateway API's."""
    if not isinstance(url, str):
        raise invalid_param("an http pusher needs data.url, the push gateway's URL")
    check_text(url, "data.url", max_length=2000, allow_empty=False)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise invalid_param("data.url must be an http or https URL")
    if parts.path != PUSH_GATEWAY_PATH or parts.query or parts.fragment:
        raise invalid_param(f"data.url must end in {PUSH_GATEWAY_PATH}")
    return url


class PushersHandler:
    def __init__(self, store: PushStore, *, clock_ms: Any, current_position: Any) -> None:
        self._store = store
        self._clock_ms = clock_ms
        self._current_position = current_position

    async def get_pushers(self, requester: Requester) -> list[dict[str, Any]]:
        return [pusher_json(row) for row in await self._store.get_pushers(requester.user_id)]

    async def set_pusher(self, requester: Requester, body: Any) -> None:
        if not isinstance(body, dict):
            raise bad_json("the body must be a JSON object")
        pushkey = _string(body, "pushkey", max_length=512)
        app_id = _string(body, "app_id", max_length=64)
        assert pushkey is not None and app_id is not None
        if "kind" not in body:
            raise missing_param("'kind' is required (null removes the pusher)")
        kind = body["kind"]
        if kind is None:
            await self._store.delete_pusher(requester.user_id, app_id, pushkey)
            return
        if kind not in ("http", "email"):
            raise invalid_param(f"'kind' must be 'http', 'email' or null, got {str(kind)[:50]!r}")
        data = body.get("data")
        if not isinstance(data, dict):
            raise missing_param("'data' must be an object")
        if kind == "http":
            check_gateway_url(data.get("url"))
            if "format" in data and not isinstance(data["format"], str):
                raise invalid_param("data.format must be a string ('event_id_only' is the one defined)")
        elif "@" not in pushkey:
            raise invalid_param("an email pusher's pushkey is the email address")
        append = body.get("append", False)
        if not isinstance(append, bool):
            raise bad_json("'append' must be a boolean")
        row = PusherRow(
            id=0, user_id=requester.user_id, access_token_id=requester.access_token_id, kind=kind, app_id=app_id,
            pushkey=pushkey,
            app_display_name=_string(body, "app_display_name", max_length=256) or "",
            device_display_name=_string(body, "device_display_name", max_length=256) or "",
            profile_tag=_string(body, "profile_tag", max_length=256, required=False),
            lang=_string(body, "lang", max_length=64) or "",
            data_json=dump_json_object(data), created_ts=self._clock_ms(),
            last_stream_ordering=self._current_position(), failing_since=None,
        )
        if len(row.data_json) > 4096:
            raise invalid_param("'data' is too large (at most 4096 bytes of JSON)")
        existing = await self._store.get_pushers(requester.user_id)
        if (len(existing) >= MAX_PUSHERS_PER_USER
                and not any((p.app_id, p.pushkey) == (app_id, pushkey) for p in existing)):
            raise MatrixError(400, "M_LIMIT_EXCEEDED", f"at most {MAX_PUSHERS_PER_USER} pushers per user")
        await self._store.add_pusher(row, append=append)

    async def notifications(self, requester: Requester, params: Mapping[str, str],
                            load_events: Any) -> dict[str, Any]:
        """``GET /notifications``: ``from`` (a token this returned), ``limit``, ``only=highlight``.
        Read notifications are listed only when they highlight (as Synapse, which drops the others
        once read)."""
        before: int | None = None
        if params.get("from"):
            try:
                before = int(params["from"])
            except ValueError:
                raise invalid_param("'from' must be a token from next_token") from None
            if not -(2**63) < before < 2**63:
                raise invalid_param("'from' is out of range")
        limit = DEFAULT_NOTIFICATIONS_LIMIT
        if params.get("limit"):
            try:
                limit = int(params["limit"])
            except ValueError:
                raise invalid_param("'limit' must be an integer") from None
            if limit < 0:
                raise invalid_param("'limit' must not be negative")
        limit = min(limit, MAX_NOTIFICATIONS_LIMIT)
        only = params.get("only")
        rows = await self._store.get_notifications(
            requester.user_id, before=before, limit=limit, only_highlight=only == "highlight") if limit else []
        events = await load_events([n.event_id for n, _ in rows])
        result: list[dict[str, Any]] = []
        for notification, read in rows:
            event = events.get(notification.event_id)
            if event is None:
                continue
            result.append({
                "actions": json.loads(notification.actions_json),
                "event": event,
                "profile_tag": None,
                "read": read,
                "room_id": notification.room_id,
                "ts": notification.received_ts,
            })
        response: dict[str, Any] = {"notifications": result}
        if rows and len(rows) == limit:
            response["next_token"] = str(rows[-1][0].stream_ordering)
        return response


def pusher_json(row: PusherRow) -> dict[str, Any]:
    pusher: dict[str, Any] = {
        "app_display_name": row.app_display_name,
        "app_id": row.app_id,
        "data": json.loads(row.data_json),
        "device_display_name": row.device_display_name,
        "kind": row.kind,
        "lang": row.lang,
        "pushkey": row.pushkey,
    }
    if row.profile_tag is not None:
        pusher["profile_tag"] = row.profile_tag
    return pusher
