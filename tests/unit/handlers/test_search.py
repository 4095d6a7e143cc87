"""Parsing ``POST /search`` bodies and ``next_batch`` tokens."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.handlers.directory.search import RoomEventsSearch, parse_batch, parse_search_request
from storage.kernel.errors import MatrixError


def _body(**criteria: Any) -> dict[str, Any]:
    return {"search_categories": {"room_events": criteria}}


def test_defaults_and_every_field() -> None:
    assert parse_search_request(_body(search_term="hi")) == RoomEventsSearch(
        term="hi", types=("m.room.message", "m.room.name", "m.room.topic"))
    parsed = parse_search_request(_body(
        search_term="hi", keys=["content.topic", "content.body"], order_by="recent",
        filter={"limit": 500, "rooms": ["!a:hs"], "not_senders": ["@x:hs"], "not_types": ["m.room.t*"]},
        event_context={"before_limit": 2}, include_state=True, groupings={"group_by": [{"key": "sender"}]},
    ))
    assert parsed == RoomEventsSearch(
        term="hi", types=("m.room.message",), rooms=("!a:hs",), not_senders=("@x:hs",), limit=100,
        by_rank=False, before_limit=2, after_limit=5, include_state=True, group_by=("sender",))


@pytest.mark.parametrize("body", [
    {}, {"search_categories": "x"}, {"search_categories": {"room_events": 1}}, _body(), _body(search_term=None),
    _body(search_term="x" * 1001), _body(search_term="x", keys="content.body"), _body(search_term="x", keys=["a"]),
    _body(search_term="x", order_by=1), _body(search_term="x", filter={"limit": True}),
    _body(search_term="x", filter={"rooms": [1]}), _body(search_term="x", event_context=[]),
    _body(search_term="x", event_context={"after_limit": "2"}), _body(search_term="x", include_state="yes"),
    _body(search_term="x", groupings={"group_by": {"key": "room_id"}}),
    _body(search_term="x", groupings={"group_by": ["room_id"]}),
])
def test_malformed_requests_are_matrix_errors(body: dict[str, Any]) -> None:
    with pytest.raises(MatrixError) as raised:
        parse_search_request(body)
    assert raised.value.status == 400


def test_batch_tokens_belong_to_their_ordering() -> None:
    assert parse_batch(None, True) == (None, 0)
    assert parse_batch("r20", True) == (None, 20)
    assert parse_batch("s55", False) == (55, 0)
    for token, by_rank in [("s5", True), ("r5", False), ("r", True), ("r-1", True), ("r" + "9" * 19, True)]:
        with pytest.raises(MatrixError):
            parse_batch(token, by_rank)
