"""The pure parts of the resident's send_join answer: heroes, the partial state, servers in the room."""

from __future__ import annotations

from homeserver.federation.join_response import choose_heroes, joined_servers, partial_state

CREATE, PL, NAME = ("m.room.create", ""), ("m.room.power_levels", ""), ("m.room.name", "")


def _members(*rows: tuple[str, str, int]) -> dict[str, tuple[str, str, int]]:
    return {f"$m{order}": (user, membership, order) for user, membership, order in rows}


def test_heroes_are_the_first_joined_or_invited_by_stream_ordering_without_the_joiner() -> None:
    rows = [("@z:a", "join", 1), ("@y:b", "leave", 2), ("@joiner:c", "invite", 3), ("@x:a", "invite", 4),
            *((f"@u{i}:a", "join", 10 + i) for i in range(10))]
    assert choose_heroes(rows, "@joiner:c") == ["@z:a", "@x:a", "@u0:a", "@u1:a", "@u2:a"]
    # Nobody present but the joiner: the others who were there (left, banned).
    assert choose_heroes([("@y:b", "leave", 2), ("@b:b", "ban", 1), ("@joiner:c", "join", 0)],
                         "@joiner:c") == ["@b:b", "@y:b"]


def test_partial_state_keeps_non_member_events_and_the_heroes_only_when_the_room_has_no_name() -> None:
    members = _members(("@a:a", "join", 1), ("@b:b", "join", 2), ("@c:c", "leave", 3))
    state = {CREATE: "$create", PL: "$pl", **{("m.room.member", user): event_id
                                              for event_id, (user, _, _) in members.items()}}
    # @b:b's own (earlier) membership is kept too: the joining server checks the join with it.
    assert partial_state(state, members, "@b:b") == {CREATE: "$create", PL: "$pl", ("m.room.member", "@a:a"): "$m1",
                                                     ("m.room.member", "@b:b"): "$m2"}
    named = {**state, NAME: "$name"}
    assert partial_state(named, members, "@z:z") == {CREATE: "$create", PL: "$pl", NAME: "$name"}


def test_partial_state_keeps_the_joiners_own_membership_and_the_member_events_the_join_cites() -> None:
    """@b:b was invited by @a:a (an invite-only room with a name): the joining server needs the
    invite, and a restricted join's authoriser's membership (@c:c here), to check the join."""
    members = _members(("@a:a", "join", 1), ("@b:b", "invite", 2), ("@c:c", "join", 3), ("@d:d", "join", 4))
    state = {CREATE: "$create", PL: "$pl", NAME: "$name",
             **{("m.room.member", user): event_id for event_id, (user, _, _) in members.items()}}
    assert partial_state(state, members, "@b:b", ["$create", "$pl", "$m2", "$m3"]) == {
        CREATE: "$create", PL: "$pl", NAME: "$name", ("m.room.member", "@b:b"): "$m2",
        ("m.room.member", "@c:c"): "$m3"}


def test_servers_in_room_are_those_of_joined_members() -> None:
    assert joined_servers([("@a:a", "join", 1), ("@b:b", "leave", 2), ("@c:c.example:8448", "join", 3)]) == {
        "a", "c.example:8448"}
