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

from typing import Any

from homeserver.events.push_rules import find_rule, parse_rule_path
from homeserver.handlers.accounts.account_data import AccountDataHandler
from homeserver.handlers.push.push import PushersHandler
from homeserver.handlers.rooms.client_events import ClientEvents
from homeserver.handlers.writers import AccountDataWriter
from homeserver.http.client_api._base import client_path, empty, query_string
from homeserver.http.routes import Body, Call, Caller, Response, route
from homeserver.http.server import parse_json_body
from storage.kernel.errors import invalid_param

# One route for every /pushrules path: parse_rule_path answers 400 for the malformed ones.
RULES = client_path(r"/pushrules(?P<rest>/.*)?")


class PushRulesServlets:
    def __init__(self, account_data: AccountDataHandler, writer: AccountDataWriter) -> None:
        self._account_data = account_data
        self._writer = writer

    @route("GET", RULES, "client_push_rules", caller=Caller.USER)
    async def get_rules(self, call: Call) -> Response:
        path = parse_rule_path(call.params.get("rest", ""), write=False)
        ruleset = await self._account_data.get_push_rules(call.user.user_id)
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

    @route("PUT", RULES, "client_push_rules_update", caller=Caller.USER)
    async def put_rule(self, call: Call) -> Response:
        path = parse_rule_path(call.params.get("rest", ""), write=True)
        # The path is checked before the body (both 400s), so the body is read here.
        edit: dict[str, Any] = {"kind": path.kind, "rule_id": path.rule_id, "op": path.attribute or "put",
                                "body": parse_json_body(call.request)}
        if path.attribute is None:
            edit["before"] = query_string(call.request, "before")
            edit["after"] = query_string(call.request, "after")
        await self._writer.edit_push_rules(call.user, edit)
        return empty()

    @route("DELETE", RULES, "client_push_rules_update", caller=Caller.USER)
    async def delete_rule(self, call: Call) -> Response:
        path = parse_rule_path(call.params.get("rest", ""), write=True)
        if path.attribute is not None:
            raise invalid_param("an attribute of a rule cannot be deleted; delete the rule")
        await self._writer.edit_push_rules(call.user, {"kind": path.kind, "rule_id": path.rule_id, "op": "delete"})
        return empty()


class PushersServlets:
    def __init__(self, pushers: PushersHandler, client_events: ClientEvents) -> None:
        self._pushers = pushers
        self._client_events = client_events

    @route("GET", client_path(r"/pushers"), "client_pushers", caller=Caller.USER)
    async def get_pushers(self, call: Call) -> Response:
        return 200, {"pushers": await self._pushers.get_pushers(call.user)}

    @route("POST", client_path(r"/pushers/set"), "client_pushers_set", caller=Caller.USER, body=Body.JSON)
    async def set_pusher(self, call: Call) -> Response:
        await self._pushers.set_pusher(call.user, call.body)
        return empty()

    @route("GET", client_path(r"/notifications"), "client_notifications", caller=Caller.USER)
    async def get_notifications(self, call: Call) -> Response:
        requester, client_events = call.user, self._client_events
        query = {name: value for name in ("from", "limit", "only")
                 if (value := query_string(call.request, name)) is not None}

        async def load(event_ids: list[str]) -> dict[str, Any]:
            events = await client_events.load(event_ids)
            serialized = await client_events.serialize(events, access_token_id=requester.access_token_id)
            return {event.event_id: body for event, body in zip(events, serialized, strict=True)}

        return 200, await self._pushers.notifications(requester, query, load)
