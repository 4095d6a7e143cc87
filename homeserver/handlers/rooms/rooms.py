"""Rooms for local clients: creation, aliases, membership, sending, state and single-event reads.

``RoomHandler`` turns client requests into ``EventTemplate``s for
``RoomEventCreator`` and reads room state back, deciding who may see what.
Events core errors become ``MatrixError``s here (``AuthError`` -> 403
``M_FORBIDDEN``, an unknown room -> 404 ``M_NOT_FOUND``), so servlets only
parse and serialise. It does not know the timeline (messages.py) or sync.
"""

# tests: tests/integration/test_client_rooms.py, tests/integration/test_client_membership.py, tests/integration/test_federation_outbound.py, tests/integration/test_client_guest.py

from __future__ import annotations

import contextlib

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs

from homeserver.events import (
    AuthError,
    EventsError,
    EventTemplate,
    EventTooLarge,
    FrozenEvent,
    UnsupportedRoomVersion,
    get_user_power_level,
    get_named_level,
    parse_create_room_request,
)
from homeserver.events import constants as C
from homeserver.events.canonical import thaw
from homeserver.events.identifiers import server_name_of
from homeserver.events.restricted import (
    allowed_room_ids,
    authoriser_candidates,
    choose_authoriser,
    needs_authorisation,
)
from homeserver.handlers.rooms.partial_state import PartialStateWaiter
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.rooms.client_events import ClientEvents
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.accounts.profile import ProfileHandler
from homeserver.appservice.registration import AppServiceRegistry
from homeserver.handlers.ratelimit import Ratelimiters
from storage.kernel.ratelimit import Ratelimiter, ratelimit
from homeserver.handlers.rooms.room_events import RoomEventCreator, RoomNotFound, MembershipPrecondition
from homeserver.events.validation import check_text, check_user_id
from storage.kernel.errors import MatrixError, bad_json, forbidden, invalid_param, not_found
from storage.caches import DictCache
from storage.stores.events import EventsStore, SendTxn, StateKey
from storage.stores.profiles import ProfileRow
from storage.stores.timeline import TimelineStore

logger = logging.getLogger(__name__)

MEMBERSHIP_ACTIONS = {"invite": C.INVITE, "kick": C.LEAVE, "ban": C.BAN, "unban": C.LEAVE}
# Client-API rules stricter than the auth rules, as Synapse: a kick removes a user who is in
# the room (joined, invited or knocking), and an unban applies only to a banned user. The
# auth rules alone would let a "kick" of a user who left re-send their leave, and an
# "unban" of a joined user kick them.
ACTION_TARGET_MEMBERSHIPS: Final = {
    "kick": (frozenset({C.JOIN, C.INVITE, C.KNOCK}), "The target user is not in the room"),
    "unban": (frozenset({C.BAN}), "The target user is not banned"),
}


# Memberships a client may set through PUT /state/m.room.member/{userId} (the auth rules
# then decide); knocks have their own endpoint and federation dance.
STATE_API_MEMBERSHIPS: Final = frozenset({C.JOIN, C.LEAVE, C.INVITE, C.BAN})


# New aliases one m.room.canonical_alias event may add (each is looked up, maybe remotely).
MAX_NEW_CANONICAL_ALIASES: Final = 50


class RemoteMembershipError(Exception):
    """A membership change over federation failed; ``forbidden`` when a server refused it (403)."""

    def __init__(self, message: str, *, forbidden: bool = False) -> None:
        super().__init__(message)
        self.forbidden = forbidden


class RemoteMembership(Protocol):
    """Membership changes that need another server (``homeserver.federation.membership``).

    Each raises ``RemoteMembershipError`` (or an ``EventsError``) when it cannot be done.
    """

    async def pending_invite(self, room_id: str, user_id: str) -> FrozenEvent | None: ...

    async def lookup_alias(self, alias: str) -> tuple[str, list[str]]: ...

    async def join_remote(self, room_id: str, user_id: str, servers: Iterable[str],
                          content: Mapping[str, object] | None = None) -> FrozenEvent: ...

    async def leave_remote(self, room_id: str, user_id: str, servers: Iterable[str]) -> FrozenEvent: ...

    async def invite_remote(self, room_id: str, inviter: str, invitee: str,
                            content: Mapping[str, object] | None = None) -> FrozenEvent: ...

    async def pending_knock(self, room_id: str, user_id: str) -> FrozenEvent | None: ...

    async def knock_servers(self, room_id: str, user_id: str) -> list[str]: ...

    async def knock_remote(self, room_id: str, user_id: str, servers: Iterable[str],
                           content: Mapping[str, object] | None = None) -> FrozenEvent: ...


class RemoteDirectory(Protocol):
    async def query_directory(self, alias: str) -> dict[str, Any]:
        """``{"room_id", "servers"}`` of an alias on another server; raises ``MatrixError`` (404, 502)."""
        ...


def remote_error(error: RemoteMembershipError) -> MatrixError:
    """403 when a remote server refused, else 404: no server could be reached or had the room."""
    if error.forbidden:
        return forbidden(str(error)[:1000])
    return not_found(f"Could not do this through another server: {str(error)[:1000]}")


def unknown_room(room_id: str) -> MatrixError:
    return not_found(f"Unknown room {room_id}")


def make_template(
    event_type: str, content: Mapping[str, Any], state_key: str | None = None, redacts: str | None = None,
    origin_server_ts: int | None = None,
) -> EventTemplate:
    """An ``EventTemplate``; content that is not canonical JSON (floats, ...) is 400 ``M_BAD_JSON``."""
    try:
        return EventTemplate(type=event_type, content=content, state_key=state_key, redacts=redacts,
                             origin_server_ts=origin_server_ts)
    except EventsError as e:
        raise events_error(e) from None
    except (TypeError, ValueError) as e:
        raise bad_json(f"Invalid event content: {e}") from None


def events_error(error: EventsError) -> MatrixError:
    """An events-core rejection as the client-server error the spec gives it."""
    if isinstance(error, AuthError):
        return forbidden(str(error))
    if isinstance(error, UnsupportedRoomVersion):
        return MatrixError(400, "M_UNSUPPORTED_ROOM_VERSION", str(error))
    if isinstance(error, EventTooLarge):
        return MatrixError(413, "M_TOO_LARGE", str(error))
    # InvalidCreateRoomRequest, InvalidEvent and the rest: the request was malformed.
    return bad_json(str(error))


def send_error(error: Exception, room_id: str) -> MatrixError:
    """What a client sees when creating an event failed: an unknown room, a rejected or malformed event."""
    if isinstance(error, RoomNotFound):
        return unknown_room(room_id)
    if isinstance(error, EventsError):
        return events_error(error)
    return bad_json(f"Invalid event: {error}")


class RoomHandler:
    def __init__(
        self,
        *,
        room_events: RoomEventCreator,
        loader: EventLoader,
        events_store: EventsStore,
        timeline: TimelineStore,
        client_events: ClientEvents,
        profiles: ProfileHandler,
        server_name: str,
        clock_ms: Callable[[], int],
        ratelimiters: Ratelimiters,
        remote: RemoteMembership | None,
        directory: RemoteDirectory | None = None,
        is_blocked: Callable[[str], Awaitable[bool]] | None = None,
        publish: Callable[[str], Awaitable[None]] | None = None,
        app_services: AppServiceRegistry | None = None,
        ask_services_alias: Callable[[str], Awaitable[bool]] | None = None,
        partial_state: PartialStateWaiter | None = None,
    ) -> None:
        # Reads needing the room's members wait while it is joined with partial state.
        self._partial_state = partial_state
        # Asks application services about an unknown alias of their namespaces (they may make it).
        self._ask_services_alias = ask_services_alias
        # Lists a room created with ``visibility: public`` in the room directory.
        self._publish = publish
        # Exclusive alias namespaces are kept from everyone but their service.
        self._app_services = app_services if app_services is not None else AppServiceRegistry()
        self._limits = ratelimiters
        # Rooms an admin blocked (docs/admin.md): no local user joins, is invited or knocks.
        self._is_blocked = is_blocked
        self._room_events = room_events
        self._loader = loader
        self._events_store = events_store
        self._timeline = timeline
        self._client_events = client_events
        self._profiles = profiles
        self._server_name = server_name
        self._clock_ms = clock_ms
        # Joins and invites that need another server (None: this server's rooms only).
        self._remote = remote
        self._directory = directory
        # (access token ID, txn ID) -> event ID of this process's recent sends, so that a
        # retried request is answered without the database. The database stays the truth.
        self._sent_txns = DictCache[str]("sent_txn_ids", max_entries=50_000)

    # --- sending --------------------------------------------------------------------------

    async def _send(
        self, room_id: str, template: EventTemplate, sender: str, *, precheck: MembershipPrecondition | None = None
    ) -> FrozenEvent:
        try:
            return await self._room_events.send(room_id, template, sender, precheck=precheck)
        except (RoomNotFound, EventsError, TypeError, ValueError) as e:
            raise send_error(e, room_id) from None

    async def send_as(self, room_id: str, template: EventTemplate, sender: str) -> FrozenEvent:
        """Send ``template`` as ``sender``, unthrottled, with client-API errors (room upgrades)."""
        return await self._send(room_id, template, sender)

    async def _send_idempotent(self, room_id: str, template: EventTemplate, sender: str, txn: SendTxn) -> str:
        try:
            return await self._room_events.send_idempotent(room_id, template, sender, txn)
        except (RoomNotFound, EventsError, TypeError, ValueError) as e:
            raise send_error(e, room_id) from None

    def _now(self) -> float:
        return self._clock_ms() / 1000.0

    def _ratelimit(self, requester: Requester, limiter: Ratelimiter, key: str) -> None:
        """Count an action against ``limiter`` (429 past it), unless the requester is exempt
        (an application service registered with ``rate_limited: false``)."""
        if requester.ratelimited:
            ratelimit(limiter, key, self._now())

    async def _check_room(self, room_id: str) -> None:
        if await self._events_store.get_room_version(room_id) is None:
            raise unknown_room(room_id)

    async def send_event(
        self, requester: Requester, room_id: str, event_type: str, content: Mapping[str, Any], txn_id: str | None,
        *, ratelimited: bool = True, ts: int | None = None,
    ) -> str:
        """Send a message event; ``ts`` (an application service's timestamp massaging) sets its
        ``origin_server_ts``."""
        if txn_id is None:
            if ratelimited and requester.ratelimited:  # server notices are not (the admin API limits the admin)
                self._ratelimit(requester, self._limits.message, requester.user_id)
            return (await self._send(room_id, make_template(event_type, content, origin_server_ts=ts),
                                     requester.user_id)).event_id
        key = (str(requester.access_token_id), txn_id)
        sent = self._sent_txns.get(key)
        if sent is not None:
            return sent
        # The transaction ID is recorded in the event's own transaction; one used
        # already (by another process, or before a restart) answers with its event.
        txn = SendTxn(requester.access_token_id, txn_id, requester.user_id, self._clock_ms())
        try:
            self._ratelimit(requester, self._limits.message, requester.user_id)
            # An unknown room surfaces from _send_idempotent as RoomNotFound -> 404.
            event_id = await self._send_idempotent(room_id, make_template(event_type, content, origin_server_ts=ts),
                                                   requester.user_id, txn)
        except MatrixError:
            # A retry whose first attempt this process does not remember still gets
            # that event's ID, even if the user could no longer send it now.
            existing = await self._timeline.get_txn_event(requester.access_token_id, txn_id)
            if existing is None:
                raise
            event_id = existing
        self._sent_txns.set(key, event_id)
        return event_id

    async def send_state(
        self, requester: Requester, room_id: str, event_type: str, state_key: str, content: Mapping[str, Any],
        *, ts: int | None = None,
    ) -> str:
        if event_type == C.MEMBER:
            return await self._send_member_state(requester, room_id, state_key, content)
        self._ratelimit(requester, self._limits.message, requester.user_id)
        if event_type == C.CANONICAL_ALIAS and state_key == "":
            # The auth rules refuse a non-member anyway; checked first so that no
            # stranger makes this server look aliases up.
            entry = (await self._timeline.get_rooms_for_user(requester.user_id)).get(room_id)
            if entry is None or entry[0] != C.JOIN:
                await self._check_room(room_id)
                raise forbidden("You are not in this room")
            await self._check_canonical_alias(room_id, content)
        template = make_template(event_type, content, state_key, origin_server_ts=ts)
        return (await self._send(room_id, template, requester.user_id)).event_id

    async def _send_member_state(
        self, requester: Requester, room_id: str, target: str, content: Mapping[str, Any]
    ) -> str:
        """``PUT /state/m.room.member/{userId}``: a membership change with the given content.

        The spec does not forbid it, and Synapse treats it as the membership endpoint
        named by ``content.membership``, with the rest of the content kept (a per-room
        ``displayname``, say): the same path, rate limits and auth rules as those endpoints.
        """
        check_user_id(target)
        membership = content.get("membership")
        if membership not in STATE_API_MEMBERSHIPS:
            raise bad_json(f"'membership' must be one of {', '.join(sorted(STATE_API_MEMBERSHIPS))}")
        extra = {key: value for key, value in content.items() if key != "membership"}
        for key in ("displayname", "avatar_url", "reason"):
            if key in extra and extra[key] is not None and not isinstance(extra[key], str):
                raise bad_json(f"'{key}' must be a string")
        remote_join = membership == C.JOIN and target == requester.user_id and self._remote is not None
        if remote_join and not await self._server_in_room(room_id):
            # A room this server is not in yet: make_join/send_join, as POST /join does.
            await self.join(requester, room_id, content=extra)
            event_id = (await self._events_store.get_current_state_for_keys(room_id, [(C.MEMBER, target)])).get(
                (C.MEMBER, target)
            )
            if event_id is None:
                raise not_found("The join was sent but is not in the room's state")
            return event_id
        return await self.update_membership(requester, room_id, target, str(membership), extra=extra)

    async def _check_canonical_alias(self, room_id: str, content: Mapping[str, Any]) -> None:
        """``m.room.canonical_alias``'s aliases must exist and point at the room (400 ``M_BAD_ALIAS``).

        As Synapse: ``alias`` is always checked, ``alt_aliases`` only where they are new
        against the room's current event (an alias deleted since may stay listed until the
        next change), and a malformed alias is 400 ``M_INVALID_PARAM``.
        """
        alias = content.get("alias")
        alt_aliases = content.get("alt_aliases", [])
        if alias is not None and not isinstance(alias, str):
            raise invalid_param("'alias' must be a room alias")
        if not isinstance(alt_aliases, list) or not all(isinstance(a, str) for a in alt_aliases):
            raise invalid_param("'alt_aliases' must be a list of room aliases")
        current = await self._current_state_events(room_id, [(C.CANONICAL_ALIAS, "")])
        old = current.get((C.CANONICAL_ALIAS, ""))
        old_alt = thaw(old.content.get("alt_aliases")) if old is not None else None
        known = set(old_alt) if isinstance(old_alt, list) else set()
        to_check = ([alias] if alias is not None else []) + [a for a in alt_aliases if a not in known]
        if len(set(to_check)) > MAX_NEW_CANONICAL_ALIASES:
            # Each may be a federation query: a bound on what one request makes this server ask.
            raise invalid_param(f"At most {MAX_NEW_CANONICAL_ALIASES} new aliases may be added at once")
        for name in dict.fromkeys(to_check):
            self._check_alias(name)
            try:
                target = (await self.get_alias(name))["room_id"]
            except MatrixError as e:
                if e.status != 404:
                    raise
                target = None
            if target != room_id:
                raise MatrixError(400, "M_BAD_ALIAS", f"Room alias {name} does not point to the room")

    async def redact(
        self, requester: Requester, room_id: str, event_id: str, txn_id: str, reason: str | None
    ) -> str:
        existing = await self._timeline.get_txn_event(requester.access_token_id, txn_id)
        if existing is not None:
            return existing
        self._ratelimit(requester, self._limits.message, requester.user_id)
        await self._check_room(room_id)
        target = await self._loader.get_event(event_id)
        if target is None:
            raise not_found("Event not found")
        if target.room_id != room_id:
            # Synapse's answer (400 M_UNKNOWN): the spec gives none; a redaction naming an event
            # of another room would never apply, so it is not sent.
            raise MatrixError(400, "M_UNKNOWN", "Cannot redact event from a different room")
        if target.type in (C.CREATE, C.SERVER_ACL):
            # As Synapse: the pruned forms would break the room (no ACL content denies every server).
            raise forbidden(f"Redacting {target.type} events is not permitted")
        if target.sender != requester.user_id:
            state = await self._current_state_events(room_id, [(C.POWER_LEVELS, ""), (C.CREATE, "")])
            level = get_user_power_level(target.room_version, requester.user_id, state)
            if level < get_named_level(state, "redact"):
                raise forbidden("You may not redact other users' events")
        content: dict[str, Any] = {} if reason is None else {"reason": reason}
        template = make_template(C.REDACTION, content, redacts=event_id)
        redaction = await self._send(room_id, template, requester.user_id)
        await self._timeline.store_txn_event(
            requester.access_token_id, txn_id, room_id, redaction.event_id, requester.user_id, self._clock_ms()
        )
        return redaction.event_id

    # --- creation and aliases ---------------------------------------------------------------

    async def create_room(self, requester: Requester, body: Mapping[str, object]) -> tuple[str, str | None]:
        try:
            request = parse_create_room_request(body)
        except EventsError as e:
            raise events_error(e) from None
        alias: str | None = None
        if request.room_alias_name is not None:
            alias = f"#{request.room_alias_name}:{self._server_name}"
            if len(alias) > 255:
                raise invalid_param("room_alias_name is too long")
            self._check_alias_not_exclusive(requester, alias)
            if await self._timeline.get_alias(alias) is not None:
                raise MatrixError(400, "M_ROOM_IN_USE", f"Room alias {alias} is already taken")
        join_content = await self._profile_content(requester.user_id)
        # Users of other servers are invited once the room exists: their server must co-sign.
        remote_invitees = [u for u in request.invite if server_name_of(u) != self._server_name]
        if remote_invitees and self._remote is not None:
            request = attrs.evolve(request, invite=tuple(u for u in request.invite if u not in remote_invitees))
        else:
            remote_invitees = []
        try:
            room_id = await self._room_events.create_room(
                requester.user_id, request, creator_join_content=join_content
            )
        except EventsError as e:
            raise events_error(e) from None
        for invitee in remote_invitees:
            extra = {"is_direct": True} if request.is_direct else None
            try:
                await self.update_membership(requester, room_id, invitee, C.INVITE, extra=extra, ratelimited=False)
            except MatrixError as e:
                logger.warning("[%s] inviting %s at creation failed: %s", room_id, invitee, e)
        if alias is not None and not await self._timeline.create_alias(alias, room_id, requester.user_id):
            raise MatrixError(400, "M_ROOM_IN_USE", f"Room alias {alias} is already taken")
        if request.visibility == "public" and self._publish is not None:
            await self._publish(room_id)
        return room_id, alias

    def _check_alias(self, alias: str) -> None:
        check_text(alias, "roomAlias", max_length=255)
        if not alias.startswith("#") or ":" not in alias or len(alias) > 255:
            raise invalid_param(f"Invalid room alias {alias[:100]!r}")

    async def get_alias(self, alias: str) -> dict[str, Any]:
        self._check_alias(alias)
        if self._directory is not None and alias.split(":", 1)[1] != self._server_name:
            return await self._directory.query_directory(alias)
        entry = await self._timeline.get_alias(alias)
        if entry is None and self._ask_services_alias is not None and await self._ask_services_alias(alias):
            entry = await self._timeline.get_alias(alias)
        if entry is None:
            raise not_found(f"Room alias {alias} not found")
        return {"room_id": entry[0], "servers": [self._server_name]}

    async def put_alias(self, requester: Requester, alias: str, room_id: str) -> None:
        self._check_alias(alias)
        if alias.split(":", 1)[1] != self._server_name:
            raise invalid_param("Room alias must be on this server")
        self._check_alias_not_exclusive(requester, alias)
        await self._check_room(room_id)
        if not await self._timeline.create_alias(alias, room_id, requester.user_id):
            raise MatrixError(409, "M_UNKNOWN", f"Room alias {alias} already exists")

    def _check_alias_not_exclusive(self, requester: Requester, alias: str) -> None:
        """400 ``M_EXCLUSIVE`` for an alias in a service's exclusive namespace, unless that
        service (acting as any of its users) asks."""
        owner = self._app_services.exclusive_alias_owner(alias)
        if owner is not None and (requester.app_service is None or requester.app_service.id != owner.id):
            raise MatrixError(400, "M_EXCLUSIVE", "This room alias is reserved by an application service")

    async def delete_alias(self, requester: Requester, alias: str) -> None:
        self._check_alias(alias)
        entry = await self._timeline.get_alias(alias)
        if entry is None:
            raise not_found(f"Room alias {alias} not found")
        room_id, creator = entry
        if creator != requester.user_id:
            state = await self._current_state_events(room_id, [(C.POWER_LEVELS, ""), (C.CREATE, "")])
            version = await self._room_events.room_version(room_id)
            if get_user_power_level(version, requester.user_id, state) < get_named_level(state, "state_default"):
                raise forbidden("You may not delete this alias")
        await self._timeline.delete_alias(alias)
        await self._drop_canonical_alias(requester, room_id, alias)

    async def _drop_canonical_alias(self, requester: Requester, room_id: str, alias: str) -> None:
        """As Synapse: a deleted alias leaves the room's ``m.room.canonical_alias`` (``alias`` and
        ``alt_aliases``), sent as the deleting user; if they may not send it, the event stays."""
        current = (await self._current_state_events(room_id, [(C.CANONICAL_ALIAS, "")])).get((C.CANONICAL_ALIAS, ""))
        if current is None:
            return
        content: dict[str, Any] = thaw(current.content)
        changed = False
        if content.get("alias") == alias:
            del content["alias"]
            changed = True
        alt = content.get("alt_aliases")
        if isinstance(alt, list) and alias in alt:
            content["alt_aliases"] = [a for a in alt if a != alias]
            changed = True
        if not changed:
            return
        try:
            await self._send(room_id, make_template(C.CANONICAL_ALIAS, content, ""), requester.user_id)
        except MatrixError as e:
            logger.info("[%s] could not drop %s from the canonical alias: %s", room_id, alias, e)

    async def resolve_room(self, room_id_or_alias: str) -> str:
        check_text(room_id_or_alias, "roomIdOrAlias", max_length=255)
        if room_id_or_alias.startswith("#"):
            return str((await self.get_alias(room_id_or_alias))["room_id"])
        if not room_id_or_alias.startswith("!") or len(room_id_or_alias) > 255:
            raise invalid_param(f"Invalid room ID or alias {room_id_or_alias[:100]!r}")
        return room_id_or_alias

    # --- membership -------------------------------------------------------------------------

    async def profile_content(self, user_id: str) -> dict[str, Any]:
        """``displayname`` / ``avatar_url`` for the user's join events."""
        return await self._profile_content(user_id)

    async def _profile_content(self, user_id: str) -> dict[str, Any]:
        try:
            profile = await self._profiles.get_profile(user_id)
        except MatrixError:
            return {}
        out: dict[str, Any] = {}
        if profile.displayname is not None:
            out["displayname"] = profile.displayname
        if profile.avatar_url is not None:
            out["avatar_url"] = profile.avatar_url
        return out

    async def update_membership(
        self,
        requester: Requester,
        room_id: str,
        target: str,
        membership: str,
        *,
        reason: str | None = None,
        extra: Mapping[str, Any] | None = None,
        ratelimited: bool = True,
        action: str | None = None,
    ) -> str:
        """Send ``target``'s new membership, authorised against the room's current state.

        ``action`` is the endpoint (``kick``, ``unban``, ...) when its rule is stricter
        than the auth rules (``ACTION_TARGET_MEMBERSHIPS``).
        """
        remote = self._remote
        if membership in (C.JOIN, C.INVITE, C.KNOCK):
            await self._check_not_blocked(room_id)
        if remote is not None and membership == C.INVITE and server_name_of(target) != self._server_name:
            return await self._invite_remote(remote, requester, room_id, target, reason, extra, ratelimited)
        if membership == C.INVITE and self._app_services.user_query_targets(target):
            # An invite of a user of a service's namespace: the service may want to make them
            # first (the spec's user query; the profile lookup asks when they are unknown).
            with contextlib.suppress(MatrixError):
                await self._profiles.get_profile(target)
        if remote is not None and membership == C.LEAVE and target == requester.user_id:
            invite = await remote.pending_invite(room_id, target)
            servers = [] if invite is None else [server_name_of(invite.sender)]
            if invite is None and await remote.pending_knock(room_id, target) is not None:
                servers = await remote.knock_servers(room_id, target)
            if servers and not await self._server_in_room(room_id):
                # Rejecting an invite to (or withdrawing a knock on) a room this server is not
                # in: make_leave/send_leave through the inviter's server (the room's servers).
                try:
                    return (await remote.leave_remote(room_id, target, servers)).event_id
                except RemoteMembershipError as e:
                    raise remote_error(e) from None
                except EventsError as e:
                    raise events_error(e) from None
        await self._check_room(room_id)
        now = self._now()
        if not ratelimited or not requester.ratelimited:
            pass
        elif membership in (C.JOIN, C.KNOCK) and target == requester.user_id:
            ratelimit(self._limits.joins_local, requester.user_id, now)
        elif membership == C.INVITE:
            ratelimit(self._limits.invites_per_room, room_id, now)
            ratelimit(self._limits.invites_per_user, target, now)
            ratelimit(self._limits.invites_per_issuer, requester.user_id, now)
        content: dict[str, Any] = dict(extra or {})
        content["membership"] = membership
        if membership in (C.JOIN, C.INVITE):
            # A displayname / avatar_url given in ``extra`` is a per-room profile (as Synapse).
            for key, value in (await self._profile_content(target)).items():
                content.setdefault(key, value)
        if reason is not None:
            content["reason"] = reason
        if membership == C.JOIN and target == requester.user_id:
            authoriser = await self._restricted_join_authoriser(room_id, target)
            if authoriser is not None:
                content[C.AUTHORISING_USER] = authoriser
        rule = ACTION_TARGET_MEMBERSHIPS.get(action or "")
        precheck = None if rule is None else MembershipPrecondition(target, *rule)
        event = await self._send(
            room_id, make_template(C.MEMBER, content, target), requester.user_id, precheck=precheck
        )
        if membership == C.JOIN:
            await self._timeline.unforget_room(target, room_id)
        return event.event_id

    async def _check_not_blocked(self, room_id: str) -> None:
        if self._is_blocked is not None and await self._is_blocked(room_id):
            raise forbidden("This room has been blocked on this server")

    async def _restricted_join_authoriser(self, room_id: str, user_id: str) -> str | None:
        """For a join under a restricted join rule (v8+) by a user neither invited nor joined:
        check the ``allow`` conditions (joined to one of the listed rooms, by this server's
        view) and name a local user who can invite (``join_authorised_via_users_server``).
        ``None`` when the join needs no authoriser; 403 when the user may not join this way."""
        version = await self._room_events.room_version(room_id)
        if not version.restricted_join_rule:
            return None
        state = await self._current_state_events(
            room_id, [(C.CREATE, ""), (C.JOIN_RULES, ""), (C.POWER_LEVELS, ""), (C.MEMBER, user_id)]
        )
        if not needs_authorisation(version, state, user_id):
            return None
        memberships = await self._timeline.get_rooms_for_user(user_id)
        if not any(memberships.get(r, ("", ""))[0] == C.JOIN for r in allowed_room_ids(state)):
            raise forbidden("You are not a member of any of the rooms this room's join rule allows")
        candidates = authoriser_candidates(state)
        state.update(await self._current_state_events(room_id, [(C.MEMBER, u) for u in candidates]))
        authoriser = choose_authoriser(version, state, self._server_name)
        if authoriser is None:
            raise forbidden("No user of this server can authorise a join to this room")
        return authoriser

    async def _server_in_room(self, room_id: str) -> bool:
        """Whether a user of this server is joined to the room (so that we hold its current state)."""
        return self._server_name in await self._events_store.get_joined_servers(room_id)

    async def _resolve_with_servers(self, room_id_or_alias: str, servers: Sequence[str]) -> tuple[str, list[str]]:
        """A join's or knock's room, and the servers to try if this one is not in it: ``servers``
        (``via``/``server_name``), then those an alias's directory named."""
        candidates: list[str] = list(servers)
        if not room_id_or_alias.startswith("#"):
            return await self.resolve_room(room_id_or_alias), candidates
        self._check_alias(room_id_or_alias)
        remote = self._remote
        if remote is None or server_name_of(room_id_or_alias) == self._server_name:
            return str((await self.get_alias(room_id_or_alias))["room_id"]), candidates
        try:
            room_id, alias_servers = await remote.lookup_alias(room_id_or_alias)
        except RemoteMembershipError as e:
            raise not_found(f"Room alias {room_id_or_alias} could not be resolved: {str(e)[:500]}") from None
        return room_id, candidates + list(alias_servers)

    async def join(
        self,
        requester: Requester,
        room_id_or_alias: str,
        *,
        servers: Sequence[str] = (),
        content: Mapping[str, Any] | None = None,
    ) -> str:
        """``POST /join/{roomIdOrAlias}`` and ``/rooms/{roomId}/join``: the room ID joined.

        ``content`` (the request body, checked by the servlet) goes into the join event;
        the user's profile fills ``displayname`` / ``avatar_url`` where it gives none.

        A room this server is in is joined locally. Otherwise (an alias of another
        server, a room we only know by an invite, or ``servers`` given) the join goes
        through make_join/send_join on the first candidate server that works: the
        ``servers`` (``server_name``/``via``), those the alias's directory named, the
        inviter's server and the room ID's domain.
        """
        check_text(room_id_or_alias, "roomIdOrAlias", max_length=255)
        remote = self._remote
        room_id, candidates = await self._resolve_with_servers(room_id_or_alias, servers)
        await self._check_not_blocked(room_id)
        user_id = requester.user_id
        if requester.is_guest:
            await self._check_guest_can_join(room_id)
        if remote is not None and not await self._server_in_room(room_id):
            invite = await remote.pending_invite(room_id, user_id)
            if invite is not None:
                candidates.append(server_name_of(invite.sender))
            candidates.append(server_name_of(room_id))
            candidates = [s for s in dict.fromkeys(candidates) if s and s != self._server_name]
            if candidates:
                self._ratelimit(requester, self._limits.joins_remote, user_id)
                join_content = {**await self._profile_content(user_id), **(content or {})}
                join_content.pop("membership", None)
                try:
                    await remote.join_remote(room_id, user_id, candidates, join_content)
                except RemoteMembershipError as e:
                    raise remote_error(e) from None
                except EventsError as e:
                    raise events_error(e) from None
                await self._timeline.unforget_room(user_id, room_id)
                return room_id
        await self.update_membership(requester, room_id, user_id, C.JOIN, extra=content)
        return room_id

    async def knock(
        self, requester: Requester, room_id_or_alias: str, *, servers: Sequence[str] = (), reason: str | None = None
    ) -> str:
        """``POST /knock/{roomIdOrAlias}``: ask to be let into a room (join rule ``knock``, v7+).

        Locally when this server is in the room (the auth rules decide: the join rule, the
        user's membership); otherwise make_knock/send_knock through ``servers``, the alias's
        servers and the room ID's domain. Guests may not knock.
        """
        check_text(room_id_or_alias, "roomIdOrAlias", max_length=255)
        if requester.is_guest:
            raise forbidden("Guests may not knock on rooms")
        remote = self._remote
        room_id, candidates = await self._resolve_with_servers(room_id_or_alias, servers)
        await self._check_not_blocked(room_id)  # before a remote knock too, as joins do
        user_id = requester.user_id
        content: dict[str, Any] = {} if reason is None else {"reason": reason}
        if remote is not None and not await self._server_in_room(room_id):
            candidates.append(server_name_of(room_id))
            candidates = [s for s in dict.fromkeys(candidates) if s and s != self._server_name]
            if candidates:
                self._ratelimit(requester, self._limits.joins_remote, user_id)
                try:
                    await remote.knock_remote(room_id, user_id, candidates, content)
                except RemoteMembershipError as e:
                    raise remote_error(e) from None
                except EventsError as e:
                    raise events_error(e) from None
                return room_id
        await self.update_membership(requester, room_id, user_id, C.KNOCK, reason=reason)
        return room_id

    async def _check_guest_can_join(self, room_id: str) -> None:
        """403 ``M_FORBIDDEN`` unless the room's ``m.room.guest_access`` is ``can_join``.

        As Synapse: a room this server is not in has no state to read here, so
        a guest cannot join it.
        """
        state = await self._current_state_events(room_id, [(C.GUEST_ACCESS, "")])
        event = state.get((C.GUEST_ACCESS, ""))
        if event is None or event.content.get("guest_access") != "can_join":
            raise forbidden("Guest access is not allowed in this room")

    async def _invite_remote(
        self,
        remote: RemoteMembership,
        requester: Requester,
        room_id: str,
        target: str,
        reason: str | None,
        extra: Mapping[str, Any] | None,
        ratelimited: bool,
    ) -> str:
        """Invite a user of another server: their server co-signs the invite (``PUT /invite`` v2)."""
        await self._check_room(room_id)
        if ratelimited and requester.ratelimited:
            now = self._now()
            ratelimit(self._limits.invites_per_room, room_id, now)
            ratelimit(self._limits.invites_per_user, target, now)
            ratelimit(self._limits.invites_per_issuer, requester.user_id, now)
        content: dict[str, Any] = dict(extra or {})
        content.pop("membership", None)
        if reason is not None:
            content["reason"] = reason
        try:
            event = await remote.invite_remote(room_id, requester.user_id, target, content)
        except RemoteMembershipError as e:
            raise remote_error(e) from None
        except EventsError as e:
            raise events_error(e) from None
        return event.event_id

    async def on_profile_changed(self, requester: Requester, profile: ProfileRow) -> None:
        """A ``ProfileHandler`` hook: send a join with the new profile into every joined room."""
        for room_id in await self.joined_rooms(profile.user_id):
            try:
                await self.update_membership(requester, room_id, profile.user_id, C.JOIN, ratelimited=False)
            except MatrixError as e:
                logger.warning("could not update %s's profile in %s: %s", profile.user_id, room_id, e)

    async def forget(self, requester: Requester, room_id: str) -> None:
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        if entry is None:
            raise not_found("You have never been in this room")
        if entry[0] in (C.JOIN, C.INVITE):
            raise MatrixError(400, "M_UNKNOWN", "You must leave the room before forgetting it")
        await self._timeline.forget_room(requester.user_id, room_id)

    async def joined_rooms(self, user_id: str) -> list[str]:
        rooms = await self._timeline.get_rooms_for_user(user_id)
        return sorted(room_id for room_id, (membership, _) in rooms.items() if membership == C.JOIN)

    # --- state reads ------------------------------------------------------------------------

    async def _current_state_events(self, room_id: str, keys: list[StateKey]) -> dict[StateKey, FrozenEvent]:
        ids = await self._events_store.get_current_state_for_keys(room_id, keys)
        loaded = await self._loader.load_events(set(ids.values()))
        return {key: loaded[eid] for key, eid in ids.items() if eid in loaded}

    async def visible_state_ids(self, requester: Requester, room_id: str) -> dict[StateKey, str]:
        """The room state the user may see: current if joined, as of their leave if they left."""
        await self._check_room(room_id)
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        if entry is not None and entry[0] == C.JOIN:
            return await self._events_store.get_current_state_ids(room_id)
        if entry is not None and entry[0] in (C.LEAVE, C.BAN):
            return await self._client_events.state_after(entry[1])
        state = await self._current_state_events(room_id, [(C.HISTORY_VISIBILITY, "")])
        hv = state.get((C.HISTORY_VISIBILITY, ""))
        if hv is not None and hv.content.get("history_visibility") == "world_readable":
            return await self._events_store.get_current_state_ids(room_id)
        raise forbidden("You are not in this room")

    async def _wait_for_members(self, room_id: str) -> None:
        """While ``room_id`` is joined with partial state, wait (bounded) for its members."""
        if self._partial_state is not None:
            await self._partial_state.wait_for_full_state(room_id)

    async def get_state(self, requester: Requester, room_id: str) -> list[dict[str, Any]]:
        await self._wait_for_members(room_id)
        ids = await self.visible_state_ids(requester, room_id)
        events = await self._client_events.load(sorted(ids.values()))
        return await self._client_events.serialize(events)

    async def get_state_event(
        self, requester: Requester, room_id: str, event_type: str, state_key: str
    ) -> dict[str, Any]:
        """The state event as clients see it (the servlet answers its content unless ``format=event``)."""
        if event_type == C.MEMBER and state_key != requester.user_id:
            await self._wait_for_members(room_id)
        ids = await self.visible_state_ids(requester, room_id)
        event_id = ids.get((event_type, state_key))
        if event_id is None:
            raise not_found("Event not found")
        events = await self._client_events.load([event_id])
        if not events:
            raise not_found("Event not found")
        served: dict[str, Any] = (await self._client_events.serialize(events))[0]
        return served

    async def get_members(
        self, requester: Requester, room_id: str, *, membership: str | None, not_membership: str | None
    ) -> list[dict[str, Any]]:
        await self._wait_for_members(room_id)
        ids = await self.visible_state_ids(requester, room_id)
        member_ids = sorted(eid for (etype, _), eid in ids.items() if etype == C.MEMBER)
        events = await self._client_events.load(member_ids)
        if membership is not None:
            events = [e for e in events if e.membership == membership]
        if not_membership is not None:
            events = [e for e in events if e.membership != not_membership]
        return await self._client_events.serialize(events)

    async def get_joined_members(self, requester: Requester, room_id: str) -> dict[str, Any]:
        await self._check_room(room_id)
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        if entry is None or entry[0] != C.JOIN:
            raise forbidden("You are not in this room")
        await self._wait_for_members(room_id)
        profiles = await self._timeline.get_joined_profiles(room_id)
        return {
            "joined": {
                user_id: {"display_name": name, "avatar_url": avatar} for user_id, (name, avatar) in profiles.items()
            }
        }

    async def get_event(self, requester: Requester, room_id: str, event_id: str) -> dict[str, Any]:
        events = await self._client_events.load([event_id])
        if not events or events[0].room_id != room_id:
            raise not_found("Event not found")
        if await self._timeline.get_hidden_events([event_id]):
            raise not_found("Event not found")  # soft-failed, rejected or an outlier
        rooms = await self._timeline.get_rooms_for_user(requester.user_id)
        entry = rooms.get(room_id)
        joined_now = entry is not None and entry[0] == C.JOIN
        visible = await self._client_events.filter_visible(requester.user_id, events, joined_now=joined_now)
        if not visible:
            raise not_found("Event not found")
        served = await self._client_events.serialize(visible, access_token_id=requester.access_token_id,
                                                     bundle_for=requester.user_id)
        return served[0]

