"""The authorization rules of room versions 1 to 12, as pure functions.

``check_auth_rules`` decides one event against a state map (the event's auth events,
the state before it, or the current state: the three checks on receipt of a PDU);
``check_auth_events_list`` applies the state-independent rules about the event's own
``auth_events`` list. Rule numbers in comments are those of the room version 11 page
(v12 numbers are one higher from rule 2 on). Where versions differ, the code asks the
``RoomVersion``'s flags (``special_case_aliases_auth``, ``strict_integer_power_levels``,
``knock_join_rule``, ...), never the version's number; ``power_level_value`` is the one
place that reads a power level, strings included where the version allows them. Signatures are not checked here: the
"validly signed by the homeserver of join_authorised_via_users_server" rule is enforced
by ``signing.required_signers``.
"""

# tests: tests/unit/events/test_auth.py

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Set
from typing import Final

from homeserver.events import constants as C
from homeserver.events.canonical import JsonMapping, JsonValue, is_int
from homeserver.events.errors import AuthError, MissingEventsError
from homeserver.events.event import FrozenEvent, StateKey
from homeserver.events.hashing import create_event_id_from_room_id
from homeserver.events.identifiers import is_valid_user_id, server_name_of
from homeserver.events.room_versions import KNOWN_ROOM_VERSIONS, RoomVersion
from homeserver.events.signing import verify_third_party_signed

StateMap = Mapping[StateKey, FrozenEvent]
"""A room state (or the subset of it the auth rules need): (type, state_key) -> event."""

CREATOR_POWER_LEVEL: Final = 2**53
"""v12 creators' "infinite" power level: above every valid power level (at most 2**53-1)."""

_NAMED_LEVEL_DEFAULTS: Final[Mapping[str, int]] = {
    "users_default": 0,
    "events_default": 0,
    "state_default": 50,
    "ban": 50,
    "redact": 50,
    "kick": 50,
    # The spec's event schema (and every major server) default invite to 0; the
    # server-server "Definitions" once said 50 (matrix-spec issue 1187).
    "invite": 0,
}


ALIASES: Final = "m.room.aliases"

_STRING_LEVEL: Final = re.compile(r"[ \t\n\r\f\v]*[+-]?[0-9]{1,20}[ \t\n\r\f\v]*")
"""v1-v9 "m.room.power_levels events accept values as strings": base 10, optional sign,
leading zeroes and surrounding whitespace allowed (bounded, so ``int()`` stays cheap)."""


def power_level_value(room_version: RoomVersion, value: object) -> int | None:
    """A power level as the room version reads it: an integer, or (v1-v9) a string holding
    one (``" +050 "`` is 50); ``None`` for anything else."""
    if is_int(value):
        return value
    if (
        not room_version.strict_integer_power_levels
        and isinstance(value, str)
        and len(value) <= 64
        and value.isascii()
        and _STRING_LEVEL.fullmatch(value) is not None
    ):
        return int(value)
    return None


def _level(pl_event: FrozenEvent, value: object) -> int | None:
    return power_level_value(pl_event.room_version, value)


# --- auth events selection -------------------------------------------------------


def auth_types_for(
    room_version: RoomVersion,
    event_type: str,
    state_key: str | None,
    sender: str,
    content: Mapping[str, object],
) -> list[StateKey]:
    """The state keys whose current events an event's ``auth_events`` should reference.

    "Auth events selection" in the server-server API; v12 never selects the create event.
    """
    if event_type == C.CREATE:
        return []
    keys: list[StateKey] = []
    if room_version.create_event_in_auth_events:
        keys.append((C.CREATE, ""))
    keys.append((C.POWER_LEVELS, ""))
    keys.append((C.MEMBER, sender))
    if event_type == C.MEMBER and state_key is not None:
        membership = content.get("membership")
        if (C.MEMBER, state_key) not in keys:
            keys.append((C.MEMBER, state_key))
        if membership in (C.JOIN, C.INVITE, C.KNOCK):
            # Knock too: rule 4 reads the join rule for it (knock, knock_restricted).
            keys.append((C.JOIN_RULES, ""))
        if membership == C.INVITE:
            tpi = content.get("third_party_invite")
            signed = tpi.get("signed") if isinstance(tpi, Mapping) else None
            token = signed.get("token") if isinstance(signed, Mapping) else None
            if isinstance(token, str):
                keys.append((C.THIRD_PARTY_INVITE, token))
        authoriser = content.get(C.AUTHORISING_USER) if room_version.restricted_join_rule else None
        if isinstance(authoriser, str) and (C.MEMBER, authoriser) not in keys:
            keys.append((C.MEMBER, authoriser))
    return keys


def auth_types_for_event(room_version: RoomVersion, event: FrozenEvent) -> list[StateKey]:
    """``auth_types_for`` applied to an existing event."""
    return auth_types_for(room_version, event.type, event.state_key, event.sender, event.content)


def check_auth_events_list(
    room_version: RoomVersion,
    event: FrozenEvent,
    auth_events: Mapping[str, FrozenEvent],
    *,
    rejected_event_ids: Set[str] = frozenset(),
) -> None:
    """The rules "considering the event's auth_events" (v11 rule 2, v12 rule 3).

    ``auth_events`` maps event ID to event and must hold every ID the event lists
    (else ``MissingEventsError``). Raises ``AuthError`` for duplicate (type, state_key)
    entries, entries the selection algorithm would not pick (in v12: the create event),
    rejected entries, entries from another room, and (v10, v11) a missing create event.
    """
    if event.type == C.CREATE:
        return
    missing = frozenset(e for e in event.auth_event_ids if e not in auth_events)
    if missing:
        raise MissingEventsError(missing, f"auth events of {event.event_id}")
    allowed = set(auth_types_for_event(room_version, event))
    seen: set[StateKey] = set()
    for auth_id in event.auth_event_ids:
        auth_event = auth_events[auth_id]
        key = auth_event.state_key_tuple
        if key is None:
            raise AuthError(f"auth event {auth_id} is not a state event")
        if key in seen:
            raise AuthError(f"duplicate auth events for {key}")
        seen.add(key)
        if key == (C.CREATE, "") and not room_version.create_event_in_auth_events:
            raise AuthError("m.room.create must not be listed in auth_events in this room version")
        if key not in allowed:
            raise AuthError(f"auth event {auth_id} for {key} is not one the event may cite")
        if auth_id in rejected_event_ids:
            raise AuthError(f"auth event {auth_id} was rejected")
        if auth_event.room_id != event.room_id:
            raise AuthError(f"auth event {auth_id} belongs to room {auth_event.room_id}")
    if room_version.create_event_in_auth_events and (C.CREATE, "") not in seen:
        raise AuthError("no m.room.create event among the auth events")


def auth_state_from_auth_events(
    room_version: RoomVersion,
    auth_events: Iterable[FrozenEvent],
    *,
    create_event: FrozenEvent | None = None,
) -> dict[StateKey, FrozenEvent]:
    """Build the state map for "auth rules based on the event's auth events".

    In v12 the create event is not among the auth events: pass it as ``create_event``
    (its ID is ``create_event_id_from_room_id(event.room_id)``).
    """
    state: dict[StateKey, FrozenEvent] = {}
    for auth_event in auth_events:
        key = auth_event.state_key_tuple
        if key is not None:
            state[key] = auth_event
    if create_event is not None:
        state[(C.CREATE, "")] = create_event
    return state


# --- power levels ----------------------------------------------------------------


def room_creators(room_version: RoomVersion, create_event: FrozenEvent) -> frozenset[str]:
    """The room's creators: ``content.creator`` (v10), the sender (v11), plus
    ``additional_creators`` (v12)."""
    if room_version.create_content_has_creator:
        creator = create_event.content.get("creator")
        return frozenset([creator]) if isinstance(creator, str) else frozenset()
    creators = {create_event.sender}
    if room_version.privileged_creators:
        extra = create_event.content.get(C.ADDITIONAL_CREATORS)
        if isinstance(extra, tuple):
            creators.update(u for u in extra if isinstance(u, str))
    return frozenset(creators)


def _pl_content(state: StateMap) -> JsonMapping | None:
    pl = state.get((C.POWER_LEVELS, ""))
    return None if pl is None else pl.content


def _pl_level(state: StateMap, value: object) -> int | None:
    pl = state.get((C.POWER_LEVELS, ""))
    return None if pl is None else _level(pl, value)


def get_user_power_level(room_version: RoomVersion, user_id: str, state: StateMap) -> int:
    """A user's power level in ``state`` (v12 creators: ``CREATOR_POWER_LEVEL``)."""
    create = state.get((C.CREATE, ""))
    if room_version.privileged_creators and create is not None:
        if user_id in room_creators(room_version, create):
            return CREATOR_POWER_LEVEL
    content = _pl_content(state)
    if content is not None:
        users = content.get("users")
        if isinstance(users, Mapping):
            level = _pl_level(state, users.get(user_id))
            if level is not None:
                return level
        default = _pl_level(state, content.get("users_default"))
        return 0 if default is None else default
    # No power levels event: the creator has 100, everyone else 0.
    if create is not None and user_id in room_creators(room_version, create):
        return 100
    return 0


def get_named_level(state: StateMap, name: str) -> int:
    """``invite``/``kick``/``ban``/``redact``/``*_default`` with the spec's defaults."""
    default = _NAMED_LEVEL_DEFAULTS[name]
    content = _pl_content(state)
    if content is None:
        return default
    value = _pl_level(state, content.get(name))
    return default if value is None else value


def get_send_level(state: StateMap, event_type: str, is_state_event: bool) -> int:
    """The *required power level* to send an event of ``event_type``."""
    content = _pl_content(state)
    if content is not None:
        events = content.get("events")
        if isinstance(events, Mapping):
            level = _pl_level(state, events.get(event_type))
            if level is not None:
                return level
    return get_named_level(state, "state_default" if is_state_event else "events_default")


def _membership(state: StateMap, user_id: str) -> str | None:
    member = state.get((C.MEMBER, user_id))
    return None if member is None else member.membership


def _join_rule(state: StateMap) -> str:
    event = state.get((C.JOIN_RULES, ""))
    rule = None if event is None else event.content.get("join_rule")
    # No join rules event: treat as "invite" (the spec is silent; Synapse and
    # Dendrite both default to invite).
    return rule if isinstance(rule, str) else C.JR_INVITE


# --- the rules --------------------------------------------------------------------


def check_auth_rules(room_version: RoomVersion, event: FrozenEvent, auth_events: StateMap) -> None:
    """Raise ``AuthError(reason)`` unless the rules of ``room_version`` allow ``event``.

    ``auth_events`` is the state to check against, keyed by (type, state_key). It must
    include the room's create event, in every room version (v12 finds it through the
    room ID rather than ``auth_events``; the caller supplies it), and must not contain
    events that were rejected.
    """
    if event.type == C.CREATE:
        _check_create(room_version, event)
        return

    create = auth_events.get((C.CREATE, ""))
    if create is None:
        raise AuthError("no m.room.create event in the auth state")
    if room_version.room_id_is_create_event_id:
        # v12 rule 2: the room ID must be the create event's ID.
        if create_event_id_from_room_id(event.room_id) != create.event_id:
            raise AuthError(f"room_id {event.room_id} is not derived from create event {create.event_id}")
    elif create.room_id != event.room_id:
        raise AuthError(f"create event {create.event_id} is for another room")

    # Rule 3: m.federate.
    if create.content.get("m.federate") is False and server_name_of(event.sender) != server_name_of(
        create.sender
    ):
        raise AuthError("room is not federated and the sender is from another server")

    if event.type == ALIASES and room_version.special_case_aliases_auth:
        # v1-v5 rule 4: a server may set the aliases of its own domain, whatever its power.
        if event.state_key is None:
            raise AuthError("m.room.aliases needs a state_key")
        if event.state_key != server_name_of(event.sender):
            raise AuthError("m.room.aliases state_key must be the sender's server name")
        return

    if event.type == C.MEMBER:
        _check_membership(room_version, event, create, auth_events)
        return

    # Rule 5: the sender must be joined.
    if _membership(auth_events, event.sender) != C.JOIN:
        raise AuthError(f"sender {event.sender} is not joined to the room")

    sender_level = get_user_power_level(room_version, event.sender, auth_events)

    # Rule 6: third-party invites need the invite level.
    if event.type == C.THIRD_PARTY_INVITE:
        if sender_level >= get_named_level(auth_events, "invite"):
            return
        raise AuthError("sender's power level is below the invite level")

    # Rule 7: the event type's required power level.
    required = get_send_level(auth_events, event.type, event.is_state())
    if required > sender_level:
        raise AuthError(f"sending {event.type} needs power level {required}, sender has {sender_level}")

    # Rule 8: user-owned state keys.
    state_key = event.state_key
    if state_key is not None and state_key.startswith("@") and state_key != event.sender:
        raise AuthError(f"state_key {state_key} starts with '@' and is not the sender")

    if event.type == C.POWER_LEVELS:
        _check_power_levels(room_version, event, create, auth_events, sender_level)
        return

    if event.type == C.REDACTION and room_version.redaction_auth_rule:
        # v1, v2 rule 11: the redact level, or a redaction of an event from the same server.
        if sender_level >= get_named_level(auth_events, "redact"):
            return
        redacts = event.redacts
        if redacts is not None and server_name_of(redacts) == server_name_of(event.event_id):
            return
        raise AuthError("redacting another server's event needs the redact level")


def _check_create(room_version: RoomVersion, event: FrozenEvent) -> None:
    """Rule 1: the create event."""
    if event.prev_event_ids:
        raise AuthError("m.room.create must not have prev_events")
    content = event.content
    if room_version.room_id_is_create_event_id:
        if "room_id" in event.pdu:
            raise AuthError("m.room.create must not have a room_id in this room version")
    elif room_version.room_id_domain_checked:
        if server_name_of(event.room_id) != server_name_of(event.sender):
            raise AuthError("the create event's room_id domain does not match its sender's")
    if "room_version" in content:
        version = content["room_version"]
        if not isinstance(version, str) or version not in KNOWN_ROOM_VERSIONS:
            raise AuthError(f"unrecognised room_version {version!r} in m.room.create")
    if room_version.privileged_creators and C.ADDITIONAL_CREATORS in content:
        extra = content[C.ADDITIONAL_CREATORS]
        if not isinstance(extra, tuple) or not all(is_valid_user_id(u) for u in extra):
            raise AuthError("additional_creators must be an array of valid user IDs")
    if room_version.create_content_has_creator and "creator" not in content:
        raise AuthError("m.room.create has no 'creator' in content")


def _user_can_invite(room_version: RoomVersion, user_id: str, state: StateMap) -> bool:
    return _membership(state, user_id) == C.JOIN and get_user_power_level(
        room_version, user_id, state
    ) >= get_named_level(state, "invite")


def restricted_join_rules(room_version: RoomVersion) -> frozenset[str]:
    """Join rules under which ``join_authorised_via_users_server`` can admit a join."""
    rules = set()
    if room_version.restricted_join_rule:
        rules.add(C.RESTRICTED)
    if room_version.knock_restricted_join_rule:
        rules.add(C.KNOCK_RESTRICTED)
    return frozenset(rules)


def _knock_rules(room_version: RoomVersion) -> frozenset[str]:
    """Join rules that allow knocking (none before v7)."""
    rules = set()
    if room_version.knock_join_rule:
        rules.add(C.JR_KNOCK)
    if room_version.knock_restricted_join_rule:
        rules.add(C.KNOCK_RESTRICTED)
    return frozenset(rules)


def _check_membership(
    room_version: RoomVersion, event: FrozenEvent, create: FrozenEvent, state: StateMap
) -> None:
    """Rule 4: m.room.member events."""
    target = event.state_key
    content = event.content
    if target is None or "membership" not in content:
        raise AuthError("m.room.member needs a state_key and content.membership")
    membership: JsonValue = content["membership"]
    sender = event.sender
    sender_membership = _membership(state, sender)
    target_membership = _membership(state, target)

    if membership == C.JOIN:
        prevs = event.prev_event_ids
        if len(prevs) == 1 and prevs[0] == create.event_id:
            # Rule 4.3.1: the creator's own first join (v10: content.creator; v11+: sender).
            first = (
                create.content.get("creator")
                if room_version.create_content_has_creator
                else create.sender
            )
            if target == first:
                return
        if sender != target:
            raise AuthError("cannot join on behalf of another user")
        if sender_membership == C.BAN:
            raise AuthError(f"{sender} is banned from the room")
        join_rule = _join_rule(state)
        if join_rule == C.JR_INVITE or (join_rule == C.JR_KNOCK and room_version.knock_join_rule):
            if target_membership in (C.INVITE, C.JOIN):
                return
            raise AuthError(f"join rule is {join_rule} and {sender} is not invited")
        if join_rule in restricted_join_rules(room_version):
            if target_membership in (C.JOIN, C.INVITE):
                return
            authoriser = content.get(C.AUTHORISING_USER)
            if not isinstance(authoriser, str) or not _user_can_invite(room_version, authoriser, state):
                raise AuthError(
                    f"restricted join: {C.AUTHORISING_USER} {authoriser!r} cannot invite users"
                )
            return
        if join_rule == C.PUBLIC:
            return
        raise AuthError(f"join rule {join_rule!r} does not allow joining")

    if membership == C.INVITE:
        if "third_party_invite" in content:
            _check_third_party_invite(event, target, target_membership, state)
            return
        if sender_membership != C.JOIN:
            raise AuthError(f"inviter {sender} is not joined")
        if target_membership in (C.JOIN, C.BAN):
            raise AuthError(f"{target} is already {target_membership}")
        if get_user_power_level(room_version, sender, state) >= get_named_level(state, "invite"):
            return
        raise AuthError("inviter's power level is below the invite level")

    if membership == C.LEAVE:
        if sender == target:
            if sender_membership in (C.INVITE, C.JOIN) or (
                sender_membership == C.KNOCK and room_version.knock_join_rule
            ):
                return
            raise AuthError(f"{sender} cannot leave from membership {sender_membership!r}")
        if sender_membership != C.JOIN:
            raise AuthError(f"kicker {sender} is not joined")
        sender_level = get_user_power_level(room_version, sender, state)
        if target_membership == C.BAN and sender_level < get_named_level(state, "ban"):
            raise AuthError("unbanning needs the ban level")
        target_level = get_user_power_level(room_version, target, state)
        if sender_level >= get_named_level(state, "kick") and target_level < sender_level:
            return
        raise AuthError("kick needs the kick level and a higher level than the target")

    if membership == C.BAN:
        if sender_membership != C.JOIN:
            raise AuthError(f"banner {sender} is not joined")
        sender_level = get_user_power_level(room_version, sender, state)
        target_level = get_user_power_level(room_version, target, state)
        if sender_level >= get_named_level(state, "ban") and target_level < sender_level:
            return
        raise AuthError("ban needs the ban level and a higher level than the target")

    if membership == C.KNOCK and room_version.knock_join_rule:
        join_rule = _join_rule(state)
        if join_rule not in _knock_rules(room_version):
            raise AuthError(f"join rule {join_rule!r} does not allow knocking")
        if sender != target:
            raise AuthError("cannot knock on behalf of another user")
        if sender_membership not in (C.BAN, C.INVITE, C.JOIN):
            return
        raise AuthError(f"cannot knock from membership {sender_membership!r}")

    raise AuthError(f"unknown membership {membership!r}")


def _check_third_party_invite(
    event: FrozenEvent, target: str, target_membership: str | None, state: StateMap
) -> None:
    """Rule 4.4.1: an invite carrying ``third_party_invite``."""
    if target_membership == C.BAN:
        raise AuthError(f"{target} is banned")
    tpi = event.content["third_party_invite"]
    signed = tpi.get("signed") if isinstance(tpi, Mapping) else None
    if not isinstance(signed, Mapping):
        raise AuthError("third_party_invite has no 'signed' object")
    mxid, token = signed.get("mxid"), signed.get("token")
    if not isinstance(mxid, str) or not isinstance(token, str):
        raise AuthError("third_party_invite.signed needs 'mxid' and 'token'")
    if mxid != target:
        raise AuthError("third_party_invite.signed.mxid does not match the state_key")
    invite_event = state.get((C.THIRD_PARTY_INVITE, token))
    if invite_event is None:
        raise AuthError(f"no m.room.third_party_invite with token {token!r}")
    if invite_event.sender != event.sender:
        raise AuthError("sender does not match the sender of the m.room.third_party_invite")
    keys: list[str] = []
    public_key = invite_event.content.get("public_key")
    if isinstance(public_key, str):
        keys.append(public_key)
    public_keys = invite_event.content.get("public_keys")
    if isinstance(public_keys, tuple):
        for entry in public_keys:
            if isinstance(entry, Mapping) and isinstance(entry.get("public_key"), str):
                keys.append(str(entry["public_key"]))
    if verify_third_party_signed(signed, keys):
        return
    raise AuthError("no signature in third_party_invite.signed matches the invite's public keys")


_LEVEL_NAMES: Final = ("users_default", "events_default", "state_default", "ban", "redact", "kick", "invite")


def _int_map(value: JsonValue | None) -> Mapping[str, JsonValue]:
    return value if isinstance(value, Mapping) else {}


def _changed_level(room_version: RoomVersion, what: str, value: JsonValue | None) -> int | None:
    """A level taking part in a change: absent is ``None``; present but not a level rejects
    (v10+ already refused such content up front; before, only the values that change matter)."""
    if value is None:
        return None
    level = power_level_value(room_version, value)
    if level is None:
        raise AuthError(f"power level {what} is not an integer: {value!r}")
    return level


def _check_power_levels(
    room_version: RoomVersion,
    event: FrozenEvent,
    create: FrozenEvent,
    state: StateMap,
    sender_level: int,
) -> None:
    """Rule 9 (v1: 10, v12: 10): m.room.power_levels."""
    new = event.content
    maps = ("events", "notifications") if room_version.notifications_power_levels else ("events",)
    if room_version.strict_integer_power_levels:
        for name in _LEVEL_NAMES:
            if name in new and not is_int(new[name]):
                raise AuthError(f"power level '{name}' must be an integer, got {new[name]!r}")
        for name in maps:
            if name in new:
                value = new[name]
                if not isinstance(value, Mapping) or not all(is_int(v) for v in value.values()):
                    raise AuthError(f"power levels '{name}' must be an object of integers")
    if "users" in new:
        users = new["users"]
        if not isinstance(users, Mapping):
            raise AuthError("power levels 'users' must be an object")
        for user_id, level in users.items():
            if not is_valid_user_id(user_id) or power_level_value(room_version, level) is None:
                raise AuthError(f"power levels 'users' entry {user_id!r}: {level!r} is invalid")
        if room_version.privileged_creators:
            listed = room_creators(room_version, create) & set(users)
            if listed:
                raise AuthError(f"room creators cannot be listed in power levels: {sorted(listed)}")

    current = state.get((C.POWER_LEVELS, ""))
    if current is None:
        return
    old = current.content

    for name in _LEVEL_NAMES:
        if old.get(name) == new.get(name):
            continue
        old_value = _changed_level(room_version, repr(name), old.get(name))
        new_value = _changed_level(room_version, repr(name), new.get(name))
        if old_value is not None and old_value > sender_level:
            raise AuthError(f"cannot change '{name}' from {old_value}: above sender's level {sender_level}")
        if new_value is not None and new_value > sender_level:
            raise AuthError(f"cannot set '{name}' to {new_value}: above sender's level {sender_level}")

    for name in maps:
        old_map, new_map = _int_map(old.get(name)), _int_map(new.get(name))
        for key in set(old_map) | set(new_map):
            if old_map.get(key) == new_map.get(key):
                continue
            old_value = _changed_level(room_version, f"{name}[{key!r}]", old_map.get(key))
            new_value = _changed_level(room_version, f"{name}[{key!r}]", new_map.get(key))
            if old_value is not None and old_value > sender_level:
                raise AuthError(f"cannot change {name}[{key!r}] from {old_value}: above sender's level")
            if new_value is not None and new_value > sender_level:
                raise AuthError(f"cannot set {name}[{key!r}] to {new_value}: above sender's level")

    old_users, new_users = _int_map(old.get("users")), _int_map(new.get("users"))
    for user_id in set(old_users) | set(new_users):
        if old_users.get(user_id) == new_users.get(user_id):
            continue
        old_value = _changed_level(room_version, f"users[{user_id!r}]", old_users.get(user_id))
        new_value = _changed_level(room_version, f"users[{user_id!r}]", new_users.get(user_id))
        if old_value is not None and user_id != event.sender and old_value >= sender_level:
            raise AuthError(f"cannot change the level of {user_id} ({old_value}): not below sender's")
        if new_value is not None and new_value > sender_level:
            raise AuthError(f"cannot give {user_id} level {new_value}: above sender's level")


# --- redactions -------------------------------------------------------------------


def can_apply_redaction(
    room_version: RoomVersion, redaction: FrozenEvent, original: FrozenEvent, state: StateMap
) -> bool:
    """"Handling redactions": apply when the redacter has the redact level in ``state``
    (the state at the redaction) or is on the same server as the original's sender."""
    if redaction.room_id != original.room_id:
        return False
    if server_name_of(redaction.sender) == server_name_of(original.sender):
        return True
    return get_user_power_level(room_version, redaction.sender, state) >= get_named_level(state, "redact")
