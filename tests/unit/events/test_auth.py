"""The authorization rules, one table row per rule: allowed and rejected, per room version.

Each row builds a room (Alice creates it, joins, sets power levels and a join rule, via
``standard_room``), adds whatever state the rule needs, builds the candidate event, and
checks it against the room's current state with ``check_auth_rules``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from signedjson.key import encode_verify_key_base64, generate_signing_key, get_verify_key

from homeserver.events import (
    AuthError,
    FrozenEvent,
    MissingEventsError,
    auth_types_for_event,
    can_apply_redaction,
    check_auth_events_list,
    check_auth_rules,
    get_user_power_level,
)
from homeserver.events import constants as C
from homeserver.events.auth import CREATOR_POWER_LEVEL, auth_state_from_auth_events
from homeserver.events.hashing import create_event_id_from_room_id
from homeserver.events.room_versions import ALL_ROOM_VERSIONS, V10, V11, V12, RoomVersion
from homeserver.events.signing import sign_json_object

from .helpers import ALICE, BOB, CAROL, EVE, RoomBuilder, standard_room

ALL = ALL_ROOM_VERSIONS
PRE_V12 = ALL_ROOM_VERSIONS[:-1]
KNOCK = tuple(v for v in ALL if v.knock_join_rule)
PRE_KNOCK = tuple(v for v in ALL if not v.knock_join_rule)
RESTRICTED = tuple(v for v in ALL if v.restricted_join_rule)
PRE_RESTRICTED = tuple(v for v in ALL if not v.restricted_join_rule)
KNOCK_RESTRICTED = tuple(v for v in ALL if v.knock_restricted_join_rule)
STRICT_LEVELS = tuple(v for v in ALL if v.strict_integer_power_levels)
STRING_LEVELS = tuple(v for v in ALL if not v.strict_integer_power_levels)
NOTIFICATIONS = tuple(v for v in ALL if v.notifications_power_levels)
PRE_NOTIFICATIONS = tuple(v for v in ALL if not v.notifications_power_levels)
ALIASES_RULE = tuple(v for v in ALL if v.special_case_aliases_auth)
REDACTION_RULE = tuple(v for v in ALL if v.redaction_auth_rule)

Build = Callable[[RoomBuilder], FrozenEvent]


@attrs.frozen
class Case:
    name: str
    build: Build
    allowed: bool
    versions: tuple[RoomVersion, ...] = ALL
    join_rule: str = C.PUBLIC
    reason: str = ""


def _fresh_create(room: RoomBuilder, **kw: object) -> FrozenEvent:
    fresh = RoomBuilder(room.room_version, events=room.events)
    fresh.room_id = None if room.room_version.room_id_is_create_event_id else "!new:a.test"
    content: dict[str, object] = {"room_version": room.room_version.identifier}
    if room.room_version.create_content_has_creator:
        content["creator"] = ALICE
    content.update(kw.pop("content", {}))  # type: ignore[call-overload]
    return fresh.build(C.CREATE, ALICE, content, "", **kw)  # type: ignore[arg-type]


def _first_join(user: str) -> Build:
    def build(room: RoomBuilder) -> FrozenEvent:
        fresh = RoomBuilder(room.room_version)
        fresh.create(ALICE)
        room.state, room.events, room.room_id = fresh.state, fresh.events, fresh.room_id
        return fresh.build(C.MEMBER, user, {"membership": C.JOIN}, user)
    return build


def _third_party_invite(*, mxid: str = BOB, sign_with_other_key: bool = False, tpi_sender: str = ALICE,
                        sender: str = ALICE, signed: bool = True, ban_target: bool = False) -> Build:
    def build(room: RoomBuilder) -> FrozenEvent:
        key = generate_signing_key("0")
        public_key = encode_verify_key_base64(get_verify_key(key))
        if tpi_sender != ALICE:
            room.join(tpi_sender)
            room.power_levels(ALICE, _users(room, {tpi_sender: 100}))
        if ban_target:
            room.member(ALICE, BOB, C.BAN)
        room.add(C.THIRD_PARTY_INVITE, tpi_sender,
                 {"display_name": "b...", "key_validity_url": "https://id.test/isvalid",
                  "public_keys": [{"public_key": public_key}]}, "tok")
        body = sign_json_object({"mxid": mxid, "token": "tok"}, "id.test",
                                generate_signing_key("0") if sign_with_other_key else key)
        tpi: dict[str, object] = {"display_name": "b..."}
        if signed:
            tpi["signed"] = body
        return room.build(C.MEMBER, sender, {"membership": C.INVITE, "third_party_invite": tpi}, BOB)
    return build


def _users(room: RoomBuilder, levels: dict[str, int]) -> dict[str, int]:
    base = {} if room.room_version.privileged_creators else {ALICE: 100}
    return {**base, **levels}


def _with(*steps: Callable[[RoomBuilder], object], then: Build) -> Build:
    def build(room: RoomBuilder) -> FrozenEvent:
        for step in steps:
            step(room)
        return then(room)
    return build


def join(user: str) -> Callable[[RoomBuilder], object]:
    return lambda room: room.join(user)


def member(sender: str, target: str, membership: str, **content: object) -> Build:
    return lambda room: room.build(C.MEMBER, sender, {"membership": membership, **content}, target)


def levels(**users: int) -> Callable[[RoomBuilder], object]:
    return lambda room: room.power_levels(ALICE, _users(room, {f"@{k}:{k[0]}.test": v for k, v in users.items()}))


def pl_event(sender: str, **content: object) -> Build:
    def build(room: RoomBuilder) -> FrozenEvent:
        current = dict(room.events[room.state[(C.POWER_LEVELS, "")]].content)
        merged = {**{k: v for k, v in current.items()}, **content}
        return room.build(C.POWER_LEVELS, sender, merged, "")
    return build


def _no_creator(room: RoomBuilder) -> FrozenEvent:
    fresh = RoomBuilder(room.room_version, events=room.events)
    fresh.room_id = None if room.room_version.room_id_is_create_event_id else "!new:a.test"
    return fresh.build(C.CREATE, ALICE, {"room_version": room.room_version.identifier}, "")


def _unfederated(room: RoomBuilder) -> None:
    fresh = RoomBuilder(room.room_version)
    fresh.create(ALICE, **{"m.federate": False})
    fresh.join(ALICE)
    fresh.power_levels(ALICE, _users(fresh, {}))
    fresh.join_rules(ALICE, C.PUBLIC)
    room.state, room.events, room.room_id, room.last = fresh.state, fresh.events, fresh.room_id, fresh.last


def _only_create_and_join(room: RoomBuilder) -> None:
    fresh = RoomBuilder(room.room_version)
    fresh.create(ALICE)
    fresh.join(ALICE)
    room.state, room.events, room.room_id, room.last = fresh.state, fresh.events, fresh.room_id, fresh.last


CASES = [
    # Rule 1: m.room.create.
    Case("create: allowed", lambda r: _fresh_create(r), True),
    Case("create: prev_events", lambda r: _fresh_create(r, prev=[r.last[0]]), False, reason="prev_events"),
    Case("create: room_id domain differs from sender", lambda r: _fresh_create(r, extra={"room_id": "!x:other.test"}),
         False, PRE_V12, reason="domain"),
    Case("create: v12 has a room_id", lambda r: _fresh_create(r, extra={"room_id": "!x:a.test"}),
         False, (V12,), reason="room_id"),
    Case("create: unknown content.room_version", lambda r: _fresh_create(r, content={"room_version": "99"}),
         False, reason="room_version"),
    Case("create: v10 needs content.creator", _no_creator, False, (V10,), reason="creator"),
    Case("create: v11+ without creator", _no_creator, True, (V11, V12)),
    Case("create: v12 additional_creators valid", lambda r: _fresh_create(r, content={"additional_creators": [BOB]}),
         True, (V12,)),
    Case("create: v12 additional_creators invalid", lambda r: _fresh_create(r, content={"additional_creators": ["bob"]}),
         False, (V12,), reason="additional_creators"),
    # v12 rule 2 / create consistency.
    Case("message: room_id not the room's", lambda r: r.build("m.room.message", ALICE, {}, extra={"room_id": "!elsewhere:a.test"}),
         False, reason="room"),
    # Rule 3: m.federate.
    Case("m.federate false: remote join", _with(lambda r: _unfederated(r), then=member(BOB, BOB, C.JOIN)),
         False, reason="federated"),
    Case("m.federate false: local user", _with(lambda r: _unfederated(r), then=member("@al2:a.test", "@al2:a.test", C.JOIN)),
         True),
    # Rule 4.1.
    Case("member: no membership", lambda r: r.build(C.MEMBER, BOB, {}, BOB), False, reason="membership"),
    Case("member: unknown membership", member(BOB, BOB, "dance"), False, reason="unknown membership"),
    # Rule 4.3: join.
    Case("join: creator's first join", _first_join(ALICE), True),
    Case("join: non-creator right after create", _first_join(BOB), False),
    Case("join: public", member(BOB, BOB, C.JOIN), True),
    Case("join: for someone else", member(ALICE, BOB, C.JOIN), False, reason="behalf"),
    Case("join: banned", _with(lambda r: r.member(ALICE, BOB, C.BAN), then=member(BOB, BOB, C.JOIN)), False, reason="banned"),
    Case("join: invite rule, not invited", member(BOB, BOB, C.JOIN), False, join_rule=C.JR_INVITE, reason="not invited"),
    Case("join: invite rule, invited", _with(lambda r: r.member(ALICE, BOB, C.INVITE), then=member(BOB, BOB, C.JOIN)),
         True, join_rule=C.JR_INVITE),
    Case("join: knock rule, invited", _with(lambda r: r.member(ALICE, BOB, C.INVITE), then=member(BOB, BOB, C.JOIN)),
         True, KNOCK, join_rule=C.JR_KNOCK),
    Case("join: knock rule before v7 (an unknown rule), invited",
         _with(lambda r: r.member(ALICE, BOB, C.INVITE), then=member(BOB, BOB, C.JOIN)),
         False, PRE_KNOCK, join_rule=C.JR_KNOCK, reason="does not allow"),
    Case("join: knock rule, not invited", member(BOB, BOB, C.JOIN), False, join_rule=C.JR_KNOCK),
    Case("join: restricted, no authoriser", member(BOB, BOB, C.JOIN), False, join_rule=C.RESTRICTED,
         reason="restricted"),
    Case("join: restricted, authorised by admin", member(BOB, BOB, C.JOIN, join_authorised_via_users_server=ALICE),
         True, RESTRICTED, join_rule=C.RESTRICTED),
    Case("join: restricted before v8 (an unknown rule), authorised",
         member(BOB, BOB, C.JOIN, join_authorised_via_users_server=ALICE),
         False, PRE_RESTRICTED, join_rule=C.RESTRICTED, reason="does not allow"),
    Case("join: restricted, authoriser not joined", member(BOB, BOB, C.JOIN, join_authorised_via_users_server=CAROL),
         False, join_rule=C.RESTRICTED, reason="restricted"),
    Case("join: restricted, authoriser below invite level",
         _with(lambda r: r.join_rules(ALICE, C.PUBLIC), join(CAROL), lambda r: r.power_levels(ALICE, _users(r, {}), invite=50),
               lambda r: r.join_rules(ALICE, C.RESTRICTED),
               then=member(BOB, BOB, C.JOIN, join_authorised_via_users_server=CAROL)),
         False, reason="restricted"),
    Case("join: restricted, already invited", _with(lambda r: r.member(ALICE, BOB, C.INVITE), then=member(BOB, BOB, C.JOIN)),
         True, RESTRICTED, join_rule=C.RESTRICTED),
    Case("join: knock_restricted, authorised", member(BOB, BOB, C.JOIN, join_authorised_via_users_server=ALICE),
         True, KNOCK_RESTRICTED, join_rule=C.KNOCK_RESTRICTED),
    Case("join: knock_restricted before v10 (an unknown rule)",
         member(BOB, BOB, C.JOIN, join_authorised_via_users_server=ALICE),
         False, ALL[:9], join_rule=C.KNOCK_RESTRICTED, reason="does not allow"),
    Case("join: private join rule", member(BOB, BOB, C.JOIN), False, join_rule=C.PRIVATE),
    # Rule 4.4: invite.
    Case("invite: by a member", member(ALICE, BOB, C.INVITE), True),
    Case("invite: by a non-member", member(CAROL, BOB, C.INVITE), False, reason="not joined"),
    Case("invite: target already joined", _with(join(BOB), then=member(ALICE, BOB, C.INVITE)), False, reason="already"),
    Case("invite: target banned", _with(lambda r: r.member(ALICE, BOB, C.BAN), then=member(ALICE, BOB, C.INVITE)),
         False, reason="already"),
    Case("invite: default invite level is 0", _with(join(CAROL), then=member(CAROL, BOB, C.INVITE)), True),
    Case("invite: below invite level",
         _with(join(CAROL), lambda r: r.power_levels(ALICE, _users(r, {}), invite=50), then=member(CAROL, BOB, C.INVITE)),
         False, reason="invite level"),
    # Rule 4.4.1: third-party invites.
    Case("3pid invite: valid signature", _third_party_invite(), True),
    Case("3pid invite: signed by another key", _third_party_invite(sign_with_other_key=True), False, reason="signature"),
    Case("3pid invite: mxid mismatch", _third_party_invite(mxid=CAROL), False, reason="mxid"),
    Case("3pid invite: no signed", _third_party_invite(signed=False), False, reason="signed"),
    Case("3pid invite: sender differs from the m.room.third_party_invite's",
         _third_party_invite(tpi_sender=CAROL), False, reason="sender"),
    Case("3pid invite: target banned", _third_party_invite(ban_target=True), False, reason="banned"),
    Case("3pid invite: no matching m.room.third_party_invite",
         member(ALICE, BOB, C.INVITE, third_party_invite={"signed": {"mxid": BOB, "token": "nope", "signatures": {}}}),
         False, reason="token"),
    # Rule 4.5: leave.
    Case("leave: self, joined", _with(join(BOB), then=member(BOB, BOB, C.LEAVE)), True),
    Case("leave: self, never joined", member(BOB, BOB, C.LEAVE), False, reason="cannot leave"),
    Case("leave: reject an invite", _with(lambda r: r.member(ALICE, BOB, C.INVITE), then=member(BOB, BOB, C.LEAVE)), True),
    Case("leave: rescind a knock", _with(lambda r: r.member(BOB, BOB, C.KNOCK), then=member(BOB, BOB, C.LEAVE)),
         True, KNOCK, join_rule=C.JR_KNOCK),
    Case("leave: rescind a knock before v7 (no such membership)",
         _with(lambda r: r.member(BOB, BOB, C.KNOCK), then=member(BOB, BOB, C.LEAVE)),
         False, PRE_KNOCK, join_rule=C.JR_KNOCK, reason="cannot leave"),
    Case("kick: admin kicks member", _with(join(BOB), then=member(ALICE, BOB, C.LEAVE)), True),
    Case("kick: member kicks admin", _with(join(BOB), then=member(BOB, ALICE, C.LEAVE)), False, reason="kick"),
    Case("kick: equal level", _with(join(BOB), join(CAROL), levels(bob=50, carol=50), then=member(BOB, CAROL, C.LEAVE)),
         False, reason="kick"),
    Case("kick: lower level", _with(join(BOB), join(CAROL), levels(bob=50, carol=49), then=member(BOB, CAROL, C.LEAVE)),
         True),
    Case("kick: kicker not joined", _with(join(BOB), then=member(CAROL, BOB, C.LEAVE)), False, reason="not joined"),
    Case("unban: by admin", _with(lambda r: r.member(ALICE, BOB, C.BAN), then=member(ALICE, BOB, C.LEAVE)), True),
    Case("unban: below ban level",
         _with(join(CAROL), levels(carol=50), lambda r: r.member(ALICE, BOB, C.BAN),
               lambda r: r.power_levels(ALICE, _users(r, {CAROL: 50}), ban=60, kick=10),
               then=member(CAROL, BOB, C.LEAVE)),
         False, reason="ban level"),
    # Rule 4.6: ban.
    Case("ban: admin bans member", _with(join(BOB), then=member(ALICE, BOB, C.BAN)), True),
    Case("ban: member bans admin", _with(join(BOB), then=member(BOB, ALICE, C.BAN)), False, reason="ban"),
    Case("ban: banner not joined", member(CAROL, BOB, C.BAN), False, reason="not joined"),
    Case("ban: the creator, by a 100 when the creator lowered herself",
         _with(join(BOB), lambda r: r.power_levels(ALICE, {ALICE: 50, BOB: 100}) if not r.room_version.privileged_creators
               else r.power_levels(ALICE, {BOB: 100}), then=member(BOB, ALICE, C.BAN)),
         True, PRE_V12),
    Case("ban: the creator in v12 (infinite power)",
         _with(join(BOB), lambda r: r.power_levels(ALICE, {BOB: 100}), then=member(BOB, ALICE, C.BAN)),
         False, (V12,), reason="ban"),
    # Rule 4.7: knock.
    Case("knock: knock rule", member(BOB, BOB, C.KNOCK), True, KNOCK, join_rule=C.JR_KNOCK),
    Case("knock: knock rule before v7 (an unknown membership)", member(BOB, BOB, C.KNOCK), False, PRE_KNOCK,
         join_rule=C.JR_KNOCK, reason="unknown membership"),
    Case("knock: knock_restricted rule", member(BOB, BOB, C.KNOCK), True, KNOCK_RESTRICTED,
         join_rule=C.KNOCK_RESTRICTED),
    Case("knock: knock_restricted rule in v7-v9", member(BOB, BOB, C.KNOCK), False, KNOCK[:3],
         join_rule=C.KNOCK_RESTRICTED, reason="knocking"),
    Case("knock: public rule", member(BOB, BOB, C.KNOCK), False, KNOCK, reason="knocking"),
    Case("knock: for someone else", member(ALICE, BOB, C.KNOCK), False, KNOCK, join_rule=C.JR_KNOCK, reason="behalf"),
    Case("knock: while banned", _with(lambda r: r.member(ALICE, BOB, C.BAN), then=member(BOB, BOB, C.KNOCK)),
         False, KNOCK, join_rule=C.JR_KNOCK, reason="cannot knock"),
    # Rule 5: sender must be joined.
    Case("message: by a member", lambda r: r.build("m.room.message", ALICE, {"body": "hi"}), True),
    Case("message: by a non-member", lambda r: r.build("m.room.message", BOB, {"body": "hi"}), False, reason="not joined"),
    # Rule 6: m.room.third_party_invite.
    Case("third_party_invite event: at invite level", _with(join(BOB), then=lambda r: r.build(
        C.THIRD_PARTY_INVITE, BOB, {"public_key": "x"}, "t")), True),
    Case("third_party_invite event: below invite level", _with(join(BOB), lambda r: r.power_levels(ALICE, _users(r, {}), invite=50),
         then=lambda r: r.build(C.THIRD_PARTY_INVITE, BOB, {"public_key": "x"}, "t")), False, reason="invite level"),
    # Rule 7: required power level.
    Case("state event: below state_default", _with(join(BOB), then=lambda r: r.build(C.TOPIC, BOB, {"topic": "t"}, "")),
         False, reason="needs power level"),
    Case("state event: admin", lambda r: r.build(C.TOPIC, ALICE, {"topic": "t"}, ""), True),
    Case("message: events override above sender",
         _with(join(BOB), lambda r: r.power_levels(ALICE, _users(r, {}), events={"m.room.message": 10}),
               then=lambda r: r.build("m.room.message", BOB, {"body": "x"})), False, reason="needs power level"),
    # Rule 8: state keys starting with @.
    Case("state_key: @other", lambda r: r.build("m.custom", ALICE, {}, BOB), False, reason="starts with '@'"),
    Case("state_key: @self", lambda r: r.build("m.custom", ALICE, {}, ALICE), True),
    # Rule 9: power levels.
    Case("power levels: first one", _with(_only_create_and_join, then=lambda r: r.build(
        C.POWER_LEVELS, ALICE, {"users": _users(r, {BOB: 50})}, "")), True),
    Case("power levels: string level", pl_event(ALICE, ban="50"), False, STRICT_LEVELS, reason="integer"),
    Case("power levels: string level before v10", pl_event(ALICE, ban=" +050 "), True, STRING_LEVELS),
    Case("power levels: string that is not an integer before v10", pl_event(ALICE, ban="5.0"), False,
         STRING_LEVELS, reason="integer"),
    Case("power levels: string users level before v10", pl_event(ALICE, users={ALICE: "100", BOB: "-5"}), True,
         STRING_LEVELS),
    Case("power levels: string events value", pl_event(ALICE, events={"m.x": "5"}), False, STRICT_LEVELS,
         reason="integers"),
    Case("power levels: string events value before v10", pl_event(ALICE, events={"m.x": "5"}), True, STRING_LEVELS),
    Case("power levels: bad user id", pl_event(ALICE, users={"bob": 5}), False, reason="users"),
    Case("power levels: non-int user level", pl_event(ALICE, users={BOB: True}), False, reason="users"),
    Case("power levels: v12 lists the creator", pl_event(ALICE, users={ALICE: 100}), False, (V12,), reason="creators"),
    Case("power levels: v10/11 list the creator", pl_event(ALICE, users={ALICE: 100}), True, PRE_V12),
    Case("power levels: raise ban above own level", _with(join(BOB), levels(bob=55), then=pl_event(BOB, ban=60)),
         False, reason="ban"),
    Case("power levels: raise ban to own level", _with(join(BOB), levels(bob=55),
         lambda r: r.power_levels(ALICE, _users(r, {BOB: 55}), ban=50),
         then=pl_event(BOB, ban=55)), True),
    Case("power levels: lower a level above own", _with(join(BOB), levels(bob=55),
         lambda r: r.power_levels(ALICE, _users(r, {BOB: 55}), kick=60), then=pl_event(BOB, kick=40)),
         False, reason="kick"),
    Case("power levels: add events entry above own", _with(join(BOB), levels(bob=55),
         then=pl_event(BOB, events={"m.x": 56})), False, reason="events"),
    Case("power levels: change notifications within own level", _with(join(BOB), levels(bob=55),
         lambda r: r.power_levels(ALICE, _users(r, {BOB: 55}), notifications={"room": 50}),
         then=pl_event(BOB, notifications={"room": 55})), True),
    Case("power levels: change notifications entry above own", _with(join(BOB), levels(bob=55),
         lambda r: r.power_levels(ALICE, _users(r, {BOB: 55}), notifications={"room": 60}),
         then=pl_event(BOB, notifications={"room": 10})), False, NOTIFICATIONS, reason="notifications"),
    Case("power levels: notifications are not checked before v6", _with(join(BOB), levels(bob=55),
         lambda r: r.power_levels(ALICE, _users(r, {BOB: 55}), notifications={"room": 60}),
         then=pl_event(BOB, notifications={"room": 10})), True, PRE_NOTIFICATIONS),
    Case("power levels: demote an equal", _with(join(BOB), join(CAROL), levels(bob=55, carol=55),
         then=lambda r: pl_event(BOB, users=_users(r, {BOB: 55, CAROL: 0}))(r)), False, reason="not below"),
    Case("power levels: demote a lower user", _with(join(BOB), join(CAROL), levels(bob=55, carol=50),
         then=lambda r: pl_event(BOB, users=_users(r, {BOB: 55, CAROL: 0}))(r)), True),
    Case("power levels: promote above own", _with(join(BOB), levels(bob=55),
         then=lambda r: pl_event(BOB, users=_users(r, {BOB: 55, EVE: 56}))(r)), False, reason="above"),
    Case("power levels: demote self", _with(join(BOB), levels(bob=55),
         then=lambda r: pl_event(BOB, users=_users(r, {BOB: 10}))(r)), True),
    # Redactions are ordinary events for the auth rules (the redact level is not checked).
    Case("redaction: by a level-0 member", _with(join(BOB), then=lambda r: r.build(
        C.REDACTION, BOB, {}, redacts=r.last[0])), True),
    Case("redaction: another server's event, below the redact level (v3+: checked when applied)",
         _with(join(BOB), then=lambda r: r.build(C.REDACTION, BOB, {}, redacts=r.state[(C.CREATE, "")])),
         True, ALL[2:]),
    # v1, v2 rule 11: the redact level, or the same server in both event IDs.
    Case("redaction: v1/v2 another server's event, below the redact level",
         _with(join(BOB), then=lambda r: r.build(C.REDACTION, BOB, {}, redacts=r.state[(C.CREATE, "")])),
         False, REDACTION_RULE, reason="redact level"),
    Case("redaction: v1/v2 another server's event, at the redact level",
         _with(join(BOB), then=lambda r: r.build(C.REDACTION, ALICE, {}, redacts=r.state[(C.MEMBER, BOB)])),
         True, REDACTION_RULE),
    # v1-v5 rule 4: m.room.aliases is the sender's server's own, whatever its membership or power.
    Case("aliases: own server, not joined", lambda r: r.build("m.room.aliases", EVE, {"aliases": []}, "e.test"),
         True, ALIASES_RULE),
    Case("aliases: another server's key", lambda r: r.build("m.room.aliases", EVE, {"aliases": []}, "a.test"),
         False, ALIASES_RULE, reason="sender's server"),
    Case("aliases: an ordinary state event from v6", lambda r: r.build("m.room.aliases", EVE, {"aliases": []},
         "e.test"), False, ALL[5:], reason="not joined"),
]


PARAMS = [
    pytest.param(case, version, id=f"v{version.identifier}: {case.name}")
    for case in CASES
    for version in case.versions
]


@pytest.mark.parametrize(("case", "version"), PARAMS)
def test_auth_rule(case: Case, version: RoomVersion) -> None:
    room = standard_room(version, case.join_rule)
    event = case.build(room)
    state = room.state_events()
    if case.allowed:
        check_auth_rules(version, event, state)
    else:
        with pytest.raises(AuthError) as info:
            check_auth_rules(version, event, state)
        assert case.reason.lower() in info.value.reason.lower()


def test_every_rule_has_both_outcomes() -> None:
    """A guard on the table itself: every rule group has an allowed and a rejected row."""
    groups: dict[str, set[bool]] = {}
    for case in CASES:
        groups.setdefault(case.name.split(":")[0], set()).add(case.allowed)
    one_sided = {g for g, outcomes in groups.items() if len(outcomes) < 2}
    assert one_sided <= {"member", "redaction"}


# --- the auth_events list, selection and power levels --------------------------------


def _listed_auth(room: RoomBuilder, event: FrozenEvent) -> dict[str, FrozenEvent]:
    return {e: room.events[e] for e in event.auth_event_ids}


@pytest.mark.parametrize("version", ALL)
def test_auth_events_list_accepts_the_selected_events(version: RoomVersion) -> None:
    room = standard_room(version)
    event = room.build(C.MEMBER, BOB, {"membership": C.JOIN}, BOB)
    check_auth_events_list(version, event, _listed_auth(room, event))
    keys = {room.events[e].state_key_tuple for e in event.auth_event_ids}
    assert ((C.CREATE, "") in keys) is version.create_event_in_auth_events
    assert (C.JOIN_RULES, "") in keys and (C.POWER_LEVELS, "") in keys


@pytest.mark.parametrize("version", ALL)
def test_auth_events_list_rejections(version: RoomVersion) -> None:
    room = standard_room(version)
    old_pl = room.state[(C.POWER_LEVELS, "")]
    room.power_levels(ALICE, _users(room, {BOB: 1}))
    topic = room.add(C.TOPIC, ALICE, {"topic": "t"}, "")
    base = room.build("m.room.message", ALICE, {})
    create_id = create_event_id_from_room_id(room.room_id or "") if version.room_id_is_create_event_id else room.state[(C.CREATE, "")]

    def check(auth_ids: list[str], rejected: frozenset[str] = frozenset()) -> None:
        event = room.build("m.room.message", ALICE, {}, auth_ids=auth_ids)
        check_auth_events_list(version, event, room.events, rejected_event_ids=rejected)

    ids = list(base.auth_event_ids)
    check(ids)
    with pytest.raises(AuthError, match="duplicate"):
        check([*ids, old_pl])
    with pytest.raises(AuthError, match="may cite"):
        check([*ids, topic.event_id])
    with pytest.raises(AuthError, match="rejected"):
        check(ids, frozenset({ids[-1]}))
    if version.create_event_in_auth_events:
        with pytest.raises(AuthError, match="no m.room.create"):
            check([i for i in ids if i != create_id])
    else:
        with pytest.raises(AuthError, match="must not"):
            check([*ids, create_id])
    with pytest.raises(MissingEventsError):
        check_auth_events_list(version, base, {})


def test_auth_events_from_another_room_are_rejected() -> None:
    room = standard_room(V11)
    other = standard_room(V11)
    other.room_id = "!other:a.test"
    event = room.build("m.room.message", ALICE, {})
    foreign = other.fork()
    foreign_pl = foreign.build(C.POWER_LEVELS, ALICE, {"users": {ALICE: 100}}, "", prev=[])
    pdu = event.get_pdu_json()
    ids = [i for i in event.auth_event_ids if room.events[i].type != C.POWER_LEVELS] + [foreign_pl.event_id]
    forged = room.build("m.room.message", ALICE, {}, auth_ids=ids)
    with pytest.raises(AuthError, match="belongs to room"):
        check_auth_events_list(V11, forged, {**room.events, foreign_pl.event_id: foreign_pl})
    assert pdu  # the untouched original still passes
    check_auth_events_list(V11, event, room.events)


@pytest.mark.parametrize("version", ALL)
def test_auth_types_for_memberships(version: RoomVersion) -> None:
    room = standard_room(version)
    invite = room.build(C.MEMBER, ALICE, {"membership": C.INVITE, "third_party_invite": {"signed": {"token": "tk"}}}, BOB)
    types = auth_types_for_event(version, invite)
    assert (C.THIRD_PARTY_INVITE, "tk") in types and (C.MEMBER, BOB) in types and (C.JOIN_RULES, "") in types
    restricted = room.build(C.MEMBER, BOB, {"membership": C.JOIN, C.AUTHORISING_USER: CAROL}, BOB)
    assert ((C.MEMBER, CAROL) in auth_types_for_event(version, restricted)) is version.restricted_join_rule
    leave = room.build(C.MEMBER, BOB, {"membership": C.LEAVE}, BOB)
    assert (C.JOIN_RULES, "") not in auth_types_for_event(version, leave)
    assert ((C.CREATE, "") in auth_types_for_event(version, leave)) is (version is not V12)
    # A knock cites the join rules: the auth rules allow it only under knock/knock_restricted.
    knock = room.build(C.MEMBER, EVE, {"membership": C.KNOCK}, EVE)
    assert (C.JOIN_RULES, "") in auth_types_for_event(version, knock)


def test_v12_state_from_auth_events_needs_the_create_event() -> None:
    room = standard_room(V12)
    event = room.build("m.room.message", ALICE, {})
    auth = [room.events[e] for e in event.auth_event_ids]
    with pytest.raises(AuthError, match="create"):
        check_auth_rules(V12, event, auth_state_from_auth_events(V12, auth))
    create = room.events[create_event_id_from_room_id(event.room_id)]
    check_auth_rules(V12, event, auth_state_from_auth_events(V12, auth, create_event=create))


def test_power_level_defaults_without_power_levels_event() -> None:
    for version in ALL:
        room = RoomBuilder(version)
        room.create(ALICE)
        state = room.state_events()
        expected = CREATOR_POWER_LEVEL if version.privileged_creators else 100
        assert get_user_power_level(version, ALICE, state) == expected
        assert get_user_power_level(version, BOB, state) == 0


def test_v12_additional_creators_are_infinite() -> None:
    room = RoomBuilder(V12)
    room.create(ALICE, additional_creators=[BOB])
    room.join(ALICE)
    room.power_levels(ALICE, {CAROL: 100})
    state = room.state_events()
    assert get_user_power_level(V12, BOB, state) == CREATOR_POWER_LEVEL
    assert get_user_power_level(V12, CAROL, state) == 100


def test_can_apply_redaction() -> None:
    room = standard_room(V11)
    room.join(BOB)
    room.join("@bob2:b.test")
    message = room.add("m.room.message", BOB, {"body": "x"})
    state = room.state_events()
    by_admin = room.build(C.REDACTION, ALICE, {}, redacts=message.event_id)
    by_same_server = room.build(C.REDACTION, "@bob2:b.test", {}, redacts=message.event_id)
    room.join(CAROL)
    by_other = room.build(C.REDACTION, CAROL, {}, redacts=message.event_id)
    assert can_apply_redaction(V11, by_admin, message, state)
    assert can_apply_redaction(V11, by_same_server, message, state)
    assert not can_apply_redaction(V11, by_other, message, room.state_events())


@pytest.mark.parametrize(
    ("value", "strict", "lenient"),
    [
        (50, 50, 50), ("50", None, 50), (" +050 ", None, 50), ("-7", None, -7), ("\t12\n", None, 12),
        ("5.0", None, None), ("1e3", None, None), ("", None, None), ("+", None, None), ("0x10", None, None),
        (" " * 50 + "5" + " " * 13 + "x", None, None), ("1" * 21, None, None), ("٣", None, None),
        (True, None, None), (None, None, None), (5.0, None, None), ([5], None, None),
    ],
)
def test_power_level_values_by_version(value: object, strict: int | None, lenient: int | None) -> None:
    """v10+ read only integers; v1-v9 also strings holding one (sign, leading zeroes and
    surrounding whitespace allowed), and nothing else: never an exception."""
    from homeserver.events.auth import power_level_value
    from homeserver.events.room_versions import V9

    assert power_level_value(V10, value) == strict
    assert power_level_value(V9, value) == lenient
