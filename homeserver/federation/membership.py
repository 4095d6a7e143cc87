"""Joining rooms across servers: serving and calling make_join / send_join (v2).

Serving: ``make_join`` (``make_leave``, ``make_knock``) hands a remote server an
unsigned template built on our forward extremities and current state, once the
auth rules allow it there (else 403); ``send_join`` checks the signed join
(signatures, auth against the state before it), signs it too, persists it and
answers with the state before the join and its auth chain, encoded once from the
stored JSON (``join_response.py``; with ``omit_members``, the partial state of MSC3706).

Calling: ``join_remote`` asks each candidate server in turn; the state and auth
chain that come back are checked in bulk (``join_state.py``: keys fetched once per
server, auth in one pass in auth order, off the reactor thread), then stored with
our join in bulk by ``EventPersister.persist_join`` (docs/federation.md, "Joining
big rooms"). Joins ask for partial state (``omit_members``) unless configured not to: the
room is then marked partial with the join, and ``partial_state.py`` fetches the rest
(docs/federation.md, "Partial-state joins").
"""

# tests: tests/integration/test_federation.py, tests/integration/test_federation_big_join.py,
#        tests/integration/test_federation_partial_join.py

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any, Final
from urllib.parse import quote

import attrs
from signedjson.types import SigningKey

from homeserver.events import (
    KNOWN_ROOM_VERSIONS,
    EventTemplate,
    FrozenEvent,
    RoomVersion,
    add_signature,
    auth_types_for,
    build_template,
    get_room_version,
    make_event,
    membership_from_template,
    sign_pdu,
    template_as_event,
)
from homeserver.events import constants as C
from homeserver.events.errors import AuthError, EventsError, InvalidEvent, MissingEventsError, SignatureError
from homeserver.events.identifiers import is_valid_user_id, server_name_of
from homeserver.events.restricted import (
    allowed_room_ids,
    authoriser_candidates,
    choose_authoriser,
    needs_authorisation,
)
from homeserver.remote.client import FederationClient, FederationClientError, HttpResponseError
from homeserver.federation.join_state import (
    CheckedState,
    RunInThread,
    order_and_check,
    run_inline,
    state_map,
    verify_batch,
)
from homeserver.federation.join_response import encode_send_join_response
from homeserver.events.canonical import EncodedJson
from homeserver.federation.keys import Keyring
from homeserver.federation.partial_state import BadPartialAnswer, parse_servers_in_room
from homeserver.federation.pdus import check_against_auth_events, check_against_state, parse_and_verify
from homeserver.handlers.rooms.event_loader import EventLoader
from homeserver.handlers.rooms.event_persistence import EventPersister
from homeserver.handlers.rooms.remote_invites import RemoteInvites
from homeserver.handlers.writers import InviteWriter
from homeserver.config import InviteRateLimits
from storage.kernel.ratelimit import Ratelimiter, ratelimit
from homeserver.handlers.rooms.rooms import RemoteMembershipError
from storage.kernel.errors import MatrixError, bad_json, forbidden, not_found
from storage.stores.events import EventsStore, SendContext, StateKey
from storage.stores.room_state import RoomStateStore

logger = logging.getLogger(__name__)


# The room state sent with an invite (``invite_room_state``) so the invitee's server can show
# the room: the spec's recommended events; the create event is required (MSC4311).
INVITE_ROOM_STATE_KEYS: tuple[StateKey, ...] = (
    (C.CREATE, ""), (C.JOIN_RULES, ""), ("m.room.canonical_alias", ""), ("m.room.avatar", ""),
    ("m.room.name", ""), ("m.room.encryption", ""),
)


# The most events (state and auth chain together) a send_join response may hold: a room
# far bigger than any seen on the public federation (the response's size limit comes first).
MAX_JOIN_EVENTS: Final = 500_000


# A send_join answer holds a room's whole state: 50,000 members are about 32 MB, over the
# client's usual 50 MB cap once a room is a little bigger. Synapse allows 500 MB; so do we.
MAX_SEND_JOIN_RESPONSE_BYTES: Final = 500 * 1024 * 1024


def quote_path(value: str) -> str:
    return quote(value, safe="")


@attrs.frozen
class InviteLimits:
    """Inbound invites (``PUT /invite``) per origin server and per invited user (``rc_invites``)."""

    per_origin: Ratelimiter
    per_user: Ratelimiter
    now: Callable[[], float]

    @classmethod
    def from_config(cls, config: InviteRateLimits, now: Callable[[], float]) -> InviteLimits:
        return cls(Ratelimiter.from_config(config.per_origin), Ratelimiter.from_config(config.per_user), now)

    def check(self, origin: str, invitee: str) -> None:
        """Count one invite, or raise 429 ``M_LIMIT_EXCEEDED`` (the origin's bucket first)."""
        now = self.now()
        ratelimit(self.per_origin, origin, now, update=False)
        ratelimit(self.per_user, invitee, now, update=False)
        self.per_origin.record(origin, now)
        self.per_user.record(invitee, now)


class JoinError(RemoteMembershipError):
    """No server could get us into the room (or take our leave or invite); the message says why for each."""


class MembershipHandler:
    def __init__(
        self,
        *,
        server_name: str,
        signing_key: SigningKey,
        store: EventsStore,
        room_state: RoomStateStore,
        persister: EventPersister, loader: EventLoader,
        keyring: Keyring,
        client: FederationClient,
        clock_ms: Callable[[], int],
        invites: RemoteInvites,
        invite_writer: InviteWriter,
        forward: Callable[[FrozenEvent, str], None] | None,
        invite_limits: InviteLimits | None = None,
        run_in_thread: RunInThread | None = None,
        partial_joins: bool = False,
        on_partial_join: Callable[[str], None] | None = None,
        is_partial: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        # Whether a room is joined with partial state here: we then make no membership
        # templates for it (our state lacks its members), as Synapse.
        self._is_partial = is_partial
        self._server_name = server_name
        # Ask for partial state (``omit_members``) when joining over federation; each room so
        # joined is handed to ``on_partial_join`` (the resync, partial_state.py).
        self._partial_joins = partial_joins
        self._on_partial_join = on_partial_join
        self._invite_limits = invite_limits
        self._signing_key = signing_key
        self._store = store
        self._room_state = room_state
        # Where the CPU-bound checks of a send_join response run (off the reactor thread).
        self._run_in_thread = run_in_thread
        self._persister = persister
        self._loader = loader
        self._keyring = keyring
        self._client = client
        self._clock_ms = clock_ms
        # Called with each remote membership event we accepted as the resident server and its
        # origin, so the other servers in the room get it (the sender, or the process that has one).
        self._forward = forward
        # Invites of our users to rooms this server is not in: read here, recorded by their writer.
        self._invites = invites
        self._invite_writer = invite_writer

    # --- serving ---------------------------------------------------------------------------

    async def _room_version(self, room_id: str) -> RoomVersion:
        identifier = await self._store.get_room_version(room_id)
        if identifier is None:
            raise not_found(f"Room {room_id} is not known to this server")
        return get_room_version(identifier)

    async def make_join(self, origin: str, room_id: str, user_id: str, versions: Iterable[str]) -> dict[str, Any]:
        return await self.make_membership(origin, room_id, user_id, C.JOIN, versions)

    async def make_leave(self, origin: str, room_id: str, user_id: str) -> dict[str, Any]:
        return await self.make_membership(origin, room_id, user_id, C.LEAVE, None)

    async def make_knock(self, origin: str, room_id: str, user_id: str, versions: Iterable[str]) -> dict[str, Any]:
        # Knocking exists from room version 7; the auth rules run on the template refuse it
        # before that, and unless the join rule is knock (or knock_restricted, v10+).
        return await self.make_membership(origin, room_id, user_id, C.KNOCK, versions)

    async def make_membership(self, origin: str, room_id: str, user_id: str, membership: str,
                              versions: Iterable[str] | None) -> dict[str, Any]:
        """A membership event template (``make_join``/``make_leave``) built on our view of the room."""
        if server_name_of(user_id) != origin:
            raise forbidden(f"{origin} may not make a {membership} for {user_id}")
        room_version = await self._room_version(room_id)
        # No ``ver`` at all means the asking server only knows room version 1 (the spec's default).
        if versions is not None and room_version.identifier not in (set(versions) or {"1"}):
            raise MatrixError(
                400, "M_INCOMPATIBLE_ROOM_VERSION",
                f"room {room_id} is version {room_version.identifier}, which your server does not support",
                room_version=room_version.identifier,
            )
        if self._server_name not in await self._store.get_joined_servers(room_id):
            raise not_found(f"this server is not in room {room_id}")
        if self._is_partial is not None and await self._is_partial(room_id):
            raise not_found(f"this server is still fetching the state of room {room_id} (a partial-state join); "
                            "ask another server")
        content: dict[str, Any] = {"membership": membership}
        if membership == C.JOIN and room_version.restricted_join_rule:
            authoriser = await self._restricted_authoriser(room_version, room_id, user_id)
            if authoriser is not None:
                content[C.AUTHORISING_USER] = authoriser
        template = EventTemplate(type=C.MEMBER, content=content, state_key=user_id)
        keys = set(auth_types_for(room_version, C.MEMBER, user_id, user_id, content))
        keys.add((C.CREATE, ""))
        pdu, context = await self._build(room_version, template, user_id, room_id, keys, origin=self._server_name)
        # The spec answers 403 here, not a template that send_* would then refuse: run the auth
        # rules on the template against the current state.
        try:
            candidate = template_as_event(room_version, pdu, joining_server=origin)
            await check_against_state(self._loader, room_version, candidate, context.auth_state)
        except AuthError as e:
            raise forbidden(f"{user_id} may not {membership} room {room_id}: {e}") from None
        except EventsError as e:
            raise bad_json(f"cannot make a {membership} event for {user_id}: {e}") from None
        return {"event": pdu, "room_version": room_version.identifier}

    async def send_join(self, origin: str, room_id: str, event_id: str, body: object, *,
                        omit_members: bool = False) -> EncodedJson:
        """``PUT /send_join`` (v2): the join, cosigned, with the room's state before it and that
        state's auth chain, encoded once from the stored JSON (join_response.py). With
        ``omit_members`` (MSC3706), the state leaves out member events but the heroes'."""
        started = time.perf_counter()
        signed, state_before = await self._send_membership(origin, room_id, event_id, body, C.JOIN)
        checked = time.perf_counter()
        answer = await encode_send_join_response(
            self._store, self._room_state, server_name=self._server_name, join=signed, state_before=state_before,
            omit_members=omit_members,
        )
        logger.info("[%s] %s joined through us (omit_members=%s): join checked and stored %.2fs, answer of %d bytes "
                    "encoded %.2fs", room_id, signed.sender, omit_members, checked - started, len(answer),
                    time.perf_counter() - checked)
        return answer

    async def send_leave(self, origin: str, room_id: str, event_id: str, body: object) -> dict[str, Any]:
        await self._send_membership(origin, room_id, event_id, body, C.LEAVE)
        return {}

    async def send_knock(self, origin: str, room_id: str, event_id: str, body: object) -> dict[str, Any]:
        """``PUT /send_knock`` (v1): the knock, then the room's state a knocker may see."""
        await self._send_membership(origin, room_id, event_id, body, C.KNOCK)
        current = await self._store.get_current_state_for_keys(room_id, INVITE_ROOM_STATE_KEYS)
        loaded = await self._loader.load_events(list(current.values()))
        return {"knock_room_state": [loaded[i].get_pdu_json() for i in current.values() if i in loaded]}

    async def _send_membership(self, origin: str, room_id: str, event_id: str, body: object,
                               membership: str) -> tuple[FrozenEvent, dict[StateKey, str]]:
        """Check and persist a remote server's join, leave or knock; the event as we cosigned it
        and the state before it."""
        room_version = await self._room_version(room_id)
        if membership == C.JOIN and room_version.restricted_join_rule:
            body = await self._authorise_restricted_join(room_version, room_id, body)
        try:
            event = await parse_and_verify(self._keyring, room_version, body)
        except (InvalidEvent, SignatureError) as e:
            raise bad_json(f"join event rejected: {e}") from None
        if event.event_id != event_id or event.room_id != room_id:
            raise bad_json(f"event ID/room ID in the path do not match the event ({event.event_id})")
        if event.type != C.MEMBER or event.membership != membership or event.state_key != event.sender:
            raise bad_json(f"send_{membership} takes an m.room.member {membership} event for its sender")
        if server_name_of(event.sender) != origin:
            raise forbidden(f"{origin} may not send a {membership} for {event.sender}")
        try:
            await check_against_auth_events(self._loader, room_version, event)
            state_before = await self._loader.state_before_event(room_version, event)
            await check_against_state(self._loader, room_version, event, state_before)
        except EventsError as e:
            raise forbidden(f"{membership} not allowed: {e}") from None
        signed = self._cosign(room_version, event)
        result = await self._persister.persist(room_version, signed, is_local=False)
        if self._forward is not None and not result.already_persisted:
            self._forward(signed, origin)
        return signed, state_before

    async def _restricted_authoriser(self, room_version: RoomVersion, room_id: str, user_id: str) -> str | None:
        """For a join under a restricted join rule (v8+) by a user neither invited nor joined:
        the local user who vouches for it (``join_authorised_via_users_server``), once the
        user meets an ``allow`` condition in a room this server is in. ``None`` when the join
        needs no authoriser. 400 ``M_UNABLE_TO_AUTHORISE_JOIN`` when we are in none of the
        allowed rooms (another resident may be), 403 when the user is in none of them, 400
        ``M_UNABLE_TO_GRANT_JOIN`` when none of our users can invite."""
        keys = [(C.CREATE, ""), (C.JOIN_RULES, ""), (C.POWER_LEVELS, ""), (C.MEMBER, user_id)]
        state = await self._state_events(room_id, keys)
        if not needs_authorisation(room_version, state, user_id):
            return None
        known = False
        for allowed in allowed_room_ids(state):
            if self._server_name not in await self._store.get_joined_servers(allowed):
                continue
            known = True
            member = (await self._state_events(allowed, [(C.MEMBER, user_id)])).get((C.MEMBER, user_id))
            if member is not None and member.membership == C.JOIN:
                break
        else:
            if not known:
                raise MatrixError(400, "M_UNABLE_TO_AUTHORISE_JOIN",
                                  "this server is in none of the rooms the join rule allows")
            raise forbidden(f"{user_id} is not a member of any of the rooms the join rule allows")
        state.update(await self._state_events(room_id, [(C.MEMBER, u) for u in authoriser_candidates(state)]))
        authoriser = choose_authoriser(room_version, state, self._server_name)
        if authoriser is None:
            raise MatrixError(400, "M_UNABLE_TO_GRANT_JOIN", "no user of this server can authorise the join")
        return authoriser

    async def _authorise_restricted_join(self, room_version: RoomVersion, room_id: str, body: object) -> object:
        """``send_join`` of a restricted join naming one of our users: check the joiner still
        meets the join rule, then add our signature (the auth rules need it from the authoriser's
        server) before the usual verification. Anything else is returned unchanged."""
        content = body.get("content") if isinstance(body, dict) else None
        authoriser = content.get(C.AUTHORISING_USER) if isinstance(content, dict) else None
        if not isinstance(body, dict) or not isinstance(authoriser, str) or not is_valid_user_id(authoriser):
            return body
        if server_name_of(authoriser) != self._server_name:
            return body
        sender = body.get("sender")
        if not isinstance(sender, str):
            return body
        await self._restricted_authoriser(room_version, room_id, sender)
        try:
            return add_signature(room_version, body, self._server_name, self._signing_key)
        except (InvalidEvent, TypeError, ValueError) as e:
            raise bad_json(f"join event cannot be signed: {e}") from None

    async def _state_events(self, room_id: str, keys: list[StateKey]) -> dict[StateKey, FrozenEvent]:
        ids = await self._store.get_current_state_for_keys(room_id, keys)
        loaded = await self._loader.load_events(set(ids.values()))
        return {key: loaded[event_id] for key, event_id in ids.items() if event_id in loaded}

    async def _build(self, room_version: RoomVersion, template: EventTemplate, sender: str, room_id: str,
                     keys: Collection[StateKey], *, origin: str | None = None) -> tuple[dict[str, Any], SendContext]:
        """The unsigned event ``build_template`` makes of ``template`` on the room as it is now
        (its forward extremities, and the current state for ``keys``: the event's auth types and
        whatever else the caller needs of it), and that read of the room."""
        context = await self._store.get_send_context(room_id, keys)
        pdu = build_template(
            room_version, template, sender=sender, room_id=room_id, current_state=context.auth_state,
            forward_extremities=context.forward_extremities, origin_server_ts=self._clock_ms(),
            edge_hashes=await self._loader.edge_hashes(
                room_version, [*context.forward_extremities, *context.auth_state.values()]),
            origin=origin,
        )
        return pdu, context

    def _cosign(self, room_version: RoomVersion, event: FrozenEvent) -> FrozenEvent:
        """``event`` with our signature added beside the sender's."""
        pdu = add_signature(room_version, event.pdu, self._server_name, self._signing_key)
        return make_event(room_version, pdu, trusted_event_id=event.event_id)

    def _membership_from(self, room_version: RoomVersion, made: Mapping[str, Any], room_id: str, user_id: str,
                         membership: str, content: Mapping[str, object]) -> FrozenEvent:
        """Our ``membership`` event from a resident's make_* template, signed now (``InvalidEvent``
        when it is not ``user_id``'s own member event in ``room_id``)."""
        return membership_from_template(
            room_version, made, user_id=user_id, room_id=room_id, membership=membership, content=content,
            origin_server_ts=self._clock_ms(), server_name=self._server_name, signing_key=self._signing_key,
        )

    # --- calling ---------------------------------------------------------------------------

    async def servers_in_room(self, room_id: str) -> set[str]:
        return await self._store.get_joined_servers(room_id)

    async def resolve_alias(self, alias: str) -> tuple[str, list[str]]:
        """Room ID and candidate servers of a room alias on another server (``GET /query/directory``)."""
        server = alias.split(":", 1)[1] if alias.startswith("#") and ":" in alias else ""
        if not server:
            raise JoinError(f"{alias[:255]!r} is not a room alias")
        answer = await self._client.get_json(server, "/_matrix/federation/v1/query/directory",
                                              query={"room_alias": alias})
        room_id = answer.get("room_id") if isinstance(answer, dict) else None
        servers = answer.get("servers") if isinstance(answer, dict) else None
        if not isinstance(room_id, str):
            raise JoinError(f"{server} sent a directory answer without a room_id")
        candidates = [s for s in servers if isinstance(s, str)] if isinstance(servers, list) else []
        return room_id, [server, *candidates]

    async def lookup_alias(self, alias: str) -> tuple[str, list[str]]:
        """``resolve_alias`` for the client API: every failure is a ``JoinError``."""
        try:
            return await self.resolve_alias(alias)
        except FederationClientError as e:
            raise JoinError(str(e), forbidden=isinstance(e, HttpResponseError) and e.code == 403) from None

    async def pending_invite(self, room_id: str, user_id: str) -> FrozenEvent | None:
        """The invite of a local user to a room this server is not in, if one came."""
        return await self._invites.pending(room_id, user_id)

    async def join_by_alias(self, alias: str, user_id: str) -> FrozenEvent:
        room_id, servers = await self.resolve_alias(alias)
        return await self.join_remote(room_id, user_id, servers)

    async def join_remote(self, room_id: str, user_id: str, servers: Iterable[str],
                          content: Mapping[str, object] | None = None) -> FrozenEvent:
        """Join ``user_id`` to a room this server is not in, via the first of ``servers`` that works."""
        errors: list[str] = []
        refused = False
        for server in dict.fromkeys(servers):
            if server == self._server_name:
                continue
            try:
                joined = await self._join_via(server, room_id, user_id, content or {})
            except (FederationClientError, EventsError, JoinError) as e:
                logger.warning("[%s] joining %s via %s failed: %s", room_id, user_id, server, e)
                errors.append(f"{server}: {e}")
                refused = refused or (isinstance(e, HttpResponseError) and e.code == 403)
                continue
            await self._invites.forget(room_id, user_id)
            return joined
        raise JoinError("; ".join(errors) or "no server to join through", forbidden=refused)

    async def _join_via(self, server: str, room_id: str, user_id: str, content: Mapping[str, object]) -> FrozenEvent:
        versions = sorted(KNOWN_ROOM_VERSIONS)
        made = await self._client.get_json(
            server,
            f"/_matrix/federation/v1/make_join/{quote_path(room_id)}/{quote_path(user_id)}",
            query={"ver": versions},
        )
        if not isinstance(made, dict) or not isinstance(made.get("event"), dict):
            raise JoinError(f"{server} sent a make_join response without an event")
        room_version = get_room_version(str(made.get("room_version", "1")))
        # A restricted room's resident names the local user who authorises the join (kept by
        # the builder); the resident signs the join for it in send_join.
        join = self._membership_from(room_version, made["event"], room_id, user_id, C.JOIN, content)
        asked = time.perf_counter()
        response = await self._send_join(server, join, omit_members=self._partial_joins)
        partial_servers: list[str] | None = None
        if response.get("members_omitted") is True and self._partial_joins:
            try:
                partial_servers = parse_servers_in_room(response.get("servers_in_room"), answered_by=server,
                                                        own=self._server_name)
            except BadPartialAnswer as e:
                # Unusable as a partial join: ask the same server for the whole state (our join
                # is the same event; the resident stored it already and answers again).
                logger.warning("[%s] %s's partial-state answer is unusable (%s); asking for the full state",
                               room_id, server, e)
                response = await self._send_join(server, join, omit_members=False)
                if response.get("members_omitted") is True:
                    raise JoinError(f"{server} left the members out of a send_join that asked for them") from None
        elif response.get("members_omitted") is True:
            raise JoinError(f"{server} left the members out of a send_join that asked for them")
        returned = response.get("event")
        if isinstance(returned, dict):
            try:
                cosigned = await parse_and_verify(self._keyring, room_version, returned)
                if cosigned.event_id == join.event_id:
                    join = cosigned
            except EventsError as e:
                logger.warning("[%s] %s returned a join we cannot verify (%s); keeping ours", room_id, server, e)
        received = time.perf_counter()
        joined_state = await self._check_join_state(room_version, room_id, server, response)
        checked = time.perf_counter()
        try:
            if partial_servers is None:
                await check_against_state(self._loader, room_version, join, joined_state.state,
                                          known=joined_state.events)
            else:
                # The partial state may lack member events the join's auth needs (a restricted
                # join's authoriser's: a resident may send it in the auth chain only), so the
                # join is checked against its own auth events, which the answer must hold.
                accepted = {i: e for i, e in joined_state.events.items() if i not in joined_state.rejected}
                await check_against_auth_events(self._loader, room_version, join, accepted)
        except (AuthError, MissingEventsError) as e:
            raise JoinError(f"our join does not pass auth against {server}'s state: {e}") from None
        members = (joined_state.events[i] for k, i in joined_state.state.items() if k[0] == C.MEMBER)
        joined = {server_name_of(e.state_key) for e in members if e.membership == C.JOIN and e.state_key}
        joined |= set(partial_servers or ())
        await self._persister.persist_join(room_version, join, joined_state.order, joined_state.rejected,
                                           joined_state.state, frozenset(joined | {server}) - {self._server_name},
                                           partial_servers)
        logger.info("[%s] %s joined via %s (%d state events%s, %d rejected): send_join %.2fs, checks %.2fs, "
                    "storing %.2fs", room_id, user_id, server, len(joined_state.state),
                    "" if partial_servers is None else f", members omitted, {len(partial_servers)} servers",
                    len(joined_state.rejected), received - asked, checked - received, time.perf_counter() - checked)
        if partial_servers is not None and self._on_partial_join is not None:
            self._on_partial_join(room_id)
        return join

    async def _send_join(self, server: str, join: FrozenEvent, *, omit_members: bool) -> dict[str, Any]:
        response = await self._client.request(
            "PUT", server,
            f"/_matrix/federation/v2/send_join/{quote_path(join.room_id)}/{quote_path(join.event_id)}",
            content=join.get_pdu_json(), max_bytes=MAX_SEND_JOIN_RESPONSE_BYTES,
            query={"omit_members": "true"} if omit_members else None,
        )
        if not isinstance(response, dict):
            raise JoinError(f"{server} sent a send_join response that is not an object")
        return response

    async def _check_join_state(self, room_version: RoomVersion, room_id: str, server: str,
                                response: Mapping[str, Any]) -> CheckedState:
        """The state and auth chain of ``server``'s send_join response, checked in bulk
        (homeserver/federation/join_state.py)."""
        raw_state, raw_chain = response.get("state"), response.get("auth_chain")
        if not isinstance(raw_state, list) or not isinstance(raw_chain, list):
            raise JoinError("send_join response lacks a list of events")
        if len(raw_state) + len(raw_chain) > MAX_JOIN_EVENTS:
            raise JoinError(f"send_join response holds more than {MAX_JOIN_EVENTS} events")
        verified, state_ids, foreign = await verify_batch(self._keyring, room_version, room_id, raw_state, raw_chain,
                                                          source=server, run_in_thread=self._run_in_thread)
        if foreign is not None:
            raise JoinError(f"send_join response holds event {foreign} of another room")
        creates = [e for e in verified.values() if e.type == C.CREATE and e.state_key == ""]
        if len(creates) != 1:
            raise JoinError(f"{server}'s send_join state has {len(creates)} create events")
        run = self._run_in_thread or run_inline
        cited = {a for e in verified.values() for a in e.auth_event_ids if a not in verified}
        known = await self._loader.load_events(cited) if cited else {}
        order, rejected = await run(order_and_check, room_version, verified.values(), known)
        if creates[0].event_id in rejected:
            raise JoinError(f"{server}'s create event fails the auth rules: {rejected[creates[0].event_id]}")
        state = state_map((verified[i] for i in state_ids), rejected)
        return CheckedState(events=verified, order=order, rejected=rejected, state=state)

    # --- knocking on a room we are not in ------------------------------------------------

    async def pending_knock(self, room_id: str, user_id: str) -> FrozenEvent | None:
        """The knock of a local user on a room this server is not in, while it waits."""
        return await self._invites.pending_knock(room_id, user_id)

    async def knock_servers(self, room_id: str, user_id: str) -> list[str]:
        """Where to withdraw a pending knock through (make_leave/send_leave)."""
        return [s for s in await self._invites.knock_servers(room_id, user_id) if s != self._server_name]

    async def knock_remote(self, room_id: str, user_id: str, servers: Iterable[str],
                           content: Mapping[str, object] | None = None) -> FrozenEvent:
        """Knock on a room this server is not in: make_knock (with our room versions), sign,
        send_knock (v1); keep the knock and the ``knock_room_state`` for /sync ``rooms.knock``."""
        errors: list[str] = []
        refused = False
        for server in dict.fromkeys(servers):
            if server == self._server_name:
                continue
            try:
                made = await self._client.get_json(
                    server, f"/_matrix/federation/v1/make_knock/{quote_path(room_id)}/{quote_path(user_id)}",
                    query={"ver": sorted(KNOWN_ROOM_VERSIONS)},
                )
                if not isinstance(made, dict) or not isinstance(made.get("event"), dict):
                    raise JoinError(f"{server} sent a make_knock response without an event")
                room_version = get_room_version(str(made.get("room_version", "1")))
                if not room_version.knock_join_rule:
                    raise JoinError(f"room version {room_version.identifier} has no knocking")
                knock = self._membership_from(room_version, made["event"], room_id, user_id, C.KNOCK, content or {})
                response = await self._client.put_json(
                    server,
                    f"/_matrix/federation/v1/send_knock/{quote_path(room_id)}/{quote_path(knock.event_id)}",
                    knock.get_pdu_json(),
                )
                state = response.get("knock_room_state") if isinstance(response, dict) else None
                await self._invite_writer.record_knock(user_id, room_id, room_version.identifier, knock.event_id,
                                                       knock.get_pdu_json(), state if isinstance(state, list) else [])
                logger.info("[%s] %s knocked via %s", room_id, user_id, server)
                return knock
            except (FederationClientError, EventsError, JoinError) as e:
                logger.warning("[%s] knocking for %s via %s failed: %s", room_id, user_id, server, e)
                errors.append(f"{server}: {e}")
                refused = refused or (isinstance(e, HttpResponseError) and e.code == 403)
        raise JoinError("; ".join(errors) or "no server to knock through", forbidden=refused)

    # --- leaving a room we are not in (rejecting an invite) ------------------------------

    async def leave_remote(self, room_id: str, user_id: str, servers: Iterable[str]) -> FrozenEvent:
        """Leave (or reject an invite to) a room this server is not in, via make_leave/send_leave."""
        errors: list[str] = []
        for server in dict.fromkeys(servers):
            if server == self._server_name:
                continue
            try:
                made = await self._client.get_json(
                    server, f"/_matrix/federation/v1/make_leave/{quote_path(room_id)}/{quote_path(user_id)}"
                )
                if not isinstance(made, dict) or not isinstance(made.get("event"), dict):
                    raise JoinError(f"{server} sent a make_leave response without an event")
                room_version = get_room_version(str(made.get("room_version", "1")))
                leave = self._membership_from(room_version, made["event"], room_id, user_id, C.LEAVE, {})
                await self._client.put_json(
                    server,
                    f"/_matrix/federation/v2/send_leave/{quote_path(room_id)}/{quote_path(leave.event_id)}",
                    leave.get_pdu_json(),
                )
                await self._invite_writer.record_rejection(user_id, room_id, room_version.identifier,
                                                           leave.event_id, leave.get_pdu_json())
                return leave
            except (FederationClientError, EventsError, JoinError) as e:
                logger.warning("[%s] leaving %s via %s failed: %s", room_id, user_id, server, e)
                errors.append(f"{server}: {e}")
        raise JoinError("; ".join(errors) or "no server to leave through")

    # --- invites ---------------------------------------------------------------------------

    async def on_invite(self, origin: str, room_id: str, event_id: str, body: object) -> dict[str, Any]:
        """``PUT /_matrix/federation/v2/invite``: check an invite of one of our users, cosign it."""
        if not isinstance(body, dict) or not isinstance(body.get("event"), dict):
            raise bad_json("invite body must hold an 'event' object")
        identifier = body.get("room_version")
        if not isinstance(identifier, str) or identifier not in KNOWN_ROOM_VERSIONS:
            raise MatrixError(400, "M_INCOMPATIBLE_ROOM_VERSION", f"room version {identifier!r} is not supported",
                              room_version=str(identifier))
        room_version = get_room_version(identifier)
        try:
            event = await parse_and_verify(self._keyring, room_version, body["event"])
        except EventsError as e:
            raise bad_json(f"invite event rejected: {e}") from None
        if event.event_id != event_id or event.room_id != room_id:
            raise bad_json("event ID/room ID in the path do not match the event")
        if event.type != C.MEMBER or event.membership != C.INVITE or not event.state_key:
            raise bad_json("invite takes an m.room.member invite event")
        if server_name_of(event.state_key) != self._server_name:
            raise bad_json(f"{event.state_key} is not a user of this server")
        if server_name_of(event.sender) != origin:
            raise forbidden(f"{origin} may not send an invite from {event.sender}")
        if self._invite_limits is not None:
            self._invite_limits.check(origin, event.state_key)
        signed = self._cosign(room_version, event)
        if self._server_name not in await self._store.get_joined_servers(room_id):
            # Not in the room: nothing in our graph to put it in; kept for /sync and the client API.
            state = body.get("invite_room_state")
            await self._invite_writer.record_invite(event.state_key, room_id, room_version.identifier, signed.event_id,
                                             signed.get_pdu_json(), state if isinstance(state, list) else [])
        return {"event": signed.get_pdu_json()}

    async def invite_remote(self, room_id: str, inviter: str, invitee: str,
                            content: Mapping[str, object] | None = None) -> FrozenEvent:
        """Invite a user of another server: build and check the invite, have the invitee's server
        cosign it (``PUT /invite`` v2), then persist it; it reaches the room's servers as usual.
        ``content``: more of the invite's content (``reason``, ``is_direct``)."""
        room_version = await self._room_version(room_id)
        extra = {k: v for k, v in (content or {}).items() if k != "membership"}
        template = EventTemplate(type=C.MEMBER, content={**extra, "membership": C.INVITE}, state_key=invitee)
        async with self._persister.room_lock(room_id):
            keys = set(auth_types_for(room_version, C.MEMBER, invitee, inviter, {"membership": C.INVITE}))
            keys.update(INVITE_ROOM_STATE_KEYS)
            pdu, context = await self._build(room_version, template, inviter, room_id, keys)
            invite = sign_pdu(room_version, pdu, self._server_name, self._signing_key)
            await check_against_state(self._loader, room_version, invite, context.auth_state)
            # Full PDUs, not the client API's stripped form: since Matrix 1.16 (MSC4311) the
            # receiver may check each one's format and signatures, and the create event must be there.
            state_ids = [context.auth_state[k] for k in INVITE_ROOM_STATE_KEYS if k in context.auth_state]
            loaded_state = await self._loader.load_events(state_ids)
            invite_room_state = [loaded_state[i].get_pdu_json() for i in state_ids if i in loaded_state]
            try:
                response = await self._client.put_json(
                    server_name_of(invitee),
                    f"/_matrix/federation/v2/invite/{quote_path(room_id)}/{quote_path(invite.event_id)}",
                    {"event": invite.get_pdu_json(), "room_version": room_version.identifier,
                     "invite_room_state": invite_room_state},
                )
            except FederationClientError as e:
                logger.warning("[%s] inviting %s failed: %s", room_id, invitee, e)
                raise JoinError(f"{server_name_of(invitee)}: {e}",
                                forbidden=isinstance(e, HttpResponseError) and e.code == 403) from None
            returned = response.get("event") if isinstance(response, dict) else None
            cosigned = await parse_and_verify(self._keyring, room_version, returned)
            if cosigned.event_id != invite.event_id:
                raise JoinError(f"{server_name_of(invitee)} returned another event than our invite")
            await self._persister.persist_locked(room_version, cosigned, is_local=True)
        return cosigned
