"""Push servlets: the push rules API, pushers and ``GET /notifications``.

GET /pushrules/ and /pushrules/global/ (the whole ruleset), GET/PUT/DELETE
/pushrules/global/{kind}/{ruleId} (``before``/``after`` query parameters on PUT),
GET/PUT .../enabled and .../actions; GET /pushers, POST /pushers/set; GET
/notifications. Rule changes are account data (``m.push_rules``), written by the
account_data stream's writer (``Writers.account_data.edit_push_rules``); pushers and
notifications are plain tables any process reads and writes.
"""

# tests: tests/integration/test_push.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from homeserver.handlers.accounts.account_data import AccountDataHandler
from homeserver.handlers.accounts.auth import Auth
from homeserver.handlers.rooms.client_events import ClientEvents
from homeserver.handlers.push.push import PushersHandler
from homeserver.events.push_rules import find_rule, parse_rule_path
from homeserver.http.client_api._base import client_path, empty, query_string
from homeserver.http.server import Routes, parse_json_body
from homeserver.handlers.writers import Writers
from storage.kernel.errors import invalid_param


def register_push_servlets(router: Routes, *, auth: Auth, account_data: AccountDataHandler,
                           pushers: PushersHandler, client_events: ClientEvents, writers: Writers) -> None:
    async def get_rules(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        path = parse_rule_path(params.get("rest", ""), write=False)
        ruleset = await account_data.get_push_rules(requester.user_id)
        if path.scope is None:
            return 200, {"global": ruleset, "device": {}}
        if path.kind is None:
            return 200, ruleset
        if path.rule_id is None:
            return 200, ruleset[path.kind]
        rule = find_rule(ruleset, path.kind, path.rule_id)
        if path.attribute is not None:
            return 200, {path.attribute: rule.get(path.attribute, True if path.attribute == "enabled" else [])}
        return 200, rule

    async def change_rule(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        path = parse_rule_path(params.get("rest", ""), write=True)
        edit: dict[str, Any] = {"kind": path.kind, "rule_id": path.rule_id}
        if request.method == b"DELETE":
            if path.attribute is not None:
                raise invalid_param("an attribute of a rule cannot be deleted; delete the rule")
            edit["op"] = "delete"
        else:
            edit["op"] = path.attribute or "put"
            edit["body"] = parse_json_body(request)
            if path.attribute is None:
                edit["before"] = query_string(request, "before")
                edit["after"] = query_string(request, "after")
        await writers.account_data.edit_push_rules(requester, edit)
        return empty()

    async def get_pushers(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        return 200, {"pushers": await pushers.get_pushers(requester)}

    async def set_pusher(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        await pushers.set_pusher(requester, parse_json_body(request))
        return empty()

    async def get_notifications(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
        requester = await auth.get_user_by_req(request)
        query = {name: value for name in ("from", "limit", "only")
                 if (value := query_string(request, name)) is not None}

        async def load(event_ids: list[str]) -> dict[str, Any]:
            events = await client_events.load(event_ids)
            serialized = await client_events.serialize(events, access_token_id=requester.access_token_id)
            return {event.event_id: body for event, body in zip(events, serialized, strict=True)}

        return 200, await pushers.notifications(requester, query, load)

    # One route for every /pushrules path: parse_rule_path answers 400 for the malformed ones.
    rules = client_path(r"/pushrules(?P<rest>/.*)?")
    router.register(["GET"], rules, get_rules, "client_push_rules")
    router.register(["PUT", "DELETE"], rules, change_rule, "client_push_rules_update")
    router.register(["GET"], client_path(r"/pushers"), get_pushers, "client_pushers")
    router.register(["POST"], client_path(r"/pushers/set"), set_pusher, "client_pushers_set")
    router.register(["GET"], client_path(r"/notifications"), get_notifications, "client_notifications")
