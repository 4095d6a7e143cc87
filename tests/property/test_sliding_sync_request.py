"""Sliding sync requests are hostile input: any JSON body parses to a request or raises a
400 ``MatrixError`` (never another exception), and a request's room configs combine into a
superset of each (what either matches, the combination matches), stored and read back whole."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from homeserver.handlers.sync.sliding_sync_request import RoomConfig, StateSpec, parse_request
from storage.kernel.errors import MatrixError

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**40), st.text(max_size=12),
                    st.sampled_from(["*", "$LAZY", "$ME", "m.room.member", "!r:x", "0", "12"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["ranges", "range", "timeline_limit", "required_state", "filters", "include",
                                     "exclude", "lazy_members", "type", "state_key", "is_dm", "spaces",
                                     "room_types", "enabled", "since", "x"]), inner, max_size=4)),
    max_leaves=12)
bodies = st.fixed_dictionaries({}, optional={
    "conn_id": json_values, "pos": json_values, "timeout": json_values, "set_presence": json_values,
    "lists": st.one_of(json_values, st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
    "room_subscriptions": st.one_of(json_values, st.dictionaries(st.sampled_from(["!a:x", "bad"]), json_values,
                                                                 max_size=2)),
    "extensions": st.one_of(json_values, st.dictionaries(
        st.sampled_from(["to_device", "e2ee", "typing", "receipts", "account_data"]), json_values, max_size=3)),
})


@settings(max_examples=400, deadline=None)
@given(bodies)
def test_any_body_is_a_request_or_a_400(body: dict[str, Any]) -> None:
    try:
        parse_request(body)
    except MatrixError as e:
        assert e.status == 400 and e.errcode in ("M_BAD_JSON", "M_INVALID_PARAM", "M_UNKNOWN_POS")


pairs = st.tuples(st.sampled_from(["*", "m.room.member", "m.room.name", "m.custom"]),
                  st.sampled_from(["*", "", "$ME", "$LAZY", "@me:x", "@other:x"]))
specs = st.builds(StateSpec, st.frozensets(pairs, max_size=4), st.frozensets(pairs, max_size=2))
configs = st.builds(RoomConfig, st.integers(0, 50), st.frozensets(specs, max_size=2))


@given(configs, configs, st.sampled_from(["m.room.member", "m.room.name", "m.custom", "m.other"]),
       st.sampled_from(["", "@me:x", "@other:x", "k"]))
def test_combined_configs_are_a_superset(a: RoomConfig, b: RoomConfig, event_type: str, state_key: str) -> None:
    combined = a.combine(b)
    assert combined.timeline_limit == max(a.timeline_limit, b.timeline_limit)
    if a.matches(event_type, state_key, "@me:x") or b.matches(event_type, state_key, "@me:x"):
        assert combined.matches(event_type, state_key, "@me:x")
    assert not combined.state_expanded_from(combined.to_json())
    assert combined.lazy == (a.lazy or b.lazy)
    assert RoomConfig.from_json(combined.to_json()) == combined  # a stored subscription reads back
