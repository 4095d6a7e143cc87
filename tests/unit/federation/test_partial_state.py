"""The pure parts of partial-state joins: checking ``servers_in_room``, and what /sync hides."""

# tests of: homeserver/federation/partial_state.py, homeserver/handlers/rooms/partial_state.py

from __future__ import annotations

import pytest

from homeserver.federation.partial_state import MAX_SERVERS_IN_ROOM, BadPartialAnswer, parse_servers_in_room
from homeserver.handlers.rooms.partial_state import sync_view
from storage.stores.partial_state import PartialStateRow
from storage.stores.timeline import RoomPosition


def test_servers_in_room_puts_the_answering_server_first_once_and_drops_our_own() -> None:
    servers = parse_servers_in_room(["b.example", "a.example", "us.example", "b.example", "[::1]:8448"],
                                    answered_by="a.example", own="us.example")
    assert servers == ["a.example", "b.example", "[::1]:8448"]


def test_an_empty_servers_in_room_still_names_the_answering_server() -> None:
    assert parse_servers_in_room([], answered_by="a.example", own="us.example") == ["a.example"]


@pytest.mark.parametrize("raw", [
    None, "a.example", {"a.example": True}, 5,
    ["a.example", 5], ["a.example", ""], ["not a server"], ["a.example/path"], ["x" * 300],
    ["ok.example"] * (MAX_SERVERS_IN_ROOM + 1),
])
def test_servers_in_room_that_is_not_a_bounded_list_of_server_names_is_refused(raw: object) -> None:
    with pytest.raises(BadPartialAnswer):
        parse_servers_in_room(raw, answered_by="a.example", own="us.example")


def _row(room_id: str, completed: tuple[str, int] | None) -> PartialStateRow:
    return PartialStateRow(room_id, "$join", ("a.example",), 0, completed)


def test_a_partial_room_is_hidden_from_a_client_not_lazy_loading_members_until_it_is_whole() -> None:
    """!p is partial: hidden. !w was made whole at master position 15: hidden from a sync that
    ends before 15, sent as newly joined by one from before 15 to after, unchanged for one
    from after 15. A lazy-loading client sees every room as usual."""
    rows = {"!p": _row("!p", None), "!w": _row("!w", ("master", 15))}
    joined = {"!p", "!w", "!other"}
    before = sync_view(rows, joined, lazy_members=False, since=RoomPosition.at(5), upto=RoomPosition.at(10))
    assert before.hidden == {"!p", "!w"} and not before.newly_whole
    across = sync_view(rows, joined, lazy_members=False, since=RoomPosition.at(10), upto=RoomPosition.at(20))
    assert across.hidden == {"!p"} and across.newly_whole == {"!w"}
    after = sync_view(rows, joined, lazy_members=False, since=RoomPosition.at(15), upto=RoomPosition.at(20))
    assert after.hidden == {"!p"} and not after.newly_whole
    initial = sync_view(rows, joined, lazy_members=False, since=None, upto=RoomPosition.at(20))
    assert initial.hidden == {"!p"} and not initial.newly_whole
    lazy = sync_view(rows, joined, lazy_members=True, since=RoomPosition.at(10), upto=RoomPosition.at(20))
    assert not lazy.hidden and not lazy.newly_whole


def test_sync_view_reads_the_completing_writers_own_position() -> None:
    """Made whole by writer p2 at 30: covered only once p2's position reaches it, whatever
    the other writers' positions are."""
    rows = {"!w": _row("!w", ("p2", 30))}
    since = RoomPosition.of(10, {"p2": 25})
    upto = RoomPosition.of(10, {"p2": 31})
    assert sync_view(rows, {"!w"}, lazy_members=False, since=since, upto=upto).newly_whole == {"!w"}
    behind = RoomPosition.of(10, {"p1": 50, "p2": 29})
    assert sync_view(rows, {"!w"}, lazy_members=False, since=since, upto=behind).hidden == {"!w"}


class _Rows:
    """The partial-state rows as ``PartialStateStore`` would read them (in memory)."""

    def __init__(self, rows: dict[str, PartialStateRow]) -> None:
        self.rows = rows

    async def partial_rooms(self) -> dict[str, PartialStateRow]:
        return {r: row for r, row in self.rows.items() if row.partial}


def test_the_sweep_resumes_only_rooms_partial_for_longer_than_its_interval() -> None:
    """Every 600 s the sweep takes up rooms joined more than 600 s ago and still partial (their
    resync was lost with a worker); a room joined recently is left to its own resync, and a
    room made whole is not touched. (The resyncer is paused: the rooms it would start wait.)"""
    from typing import Any, cast

    from prometheus_client import CollectorRegistry
    from twisted.internet.task import Clock

    from homeserver.remote.metrics import FederationMetrics
    from homeserver.federation.partial_state import PartialStateResyncer

    clock = Clock()
    clock.advance(1000)
    rows = _Rows({"!old": PartialStateRow("!old", "$j", ("a",), 100_000, None),
                  "!new": PartialStateRow("!new", "$j", ("a",), 1_200_000, None),
                  "!done": PartialStateRow("!done", "$j", ("a",), 0, ("master", 5))})
    unused = cast(Any, None)
    resyncer = PartialStateResyncer(server_name="us", partial=cast(Any, rows), store=unused, loader=unused,
                                    persister=unused, keyring=unused, client=unused, clock=clock,
                                    metrics=FederationMetrics.create(CollectorRegistry()))
    resyncer.pause()
    resyncer.sweep(600)
    clock.advance(599)
    assert resyncer._waiting == set()
    clock.advance(1)  # t = 1600 s: joined before 1000 s
    assert resyncer._waiting == {"!old"}
    clock.advance(600)  # t = 2200 s: joined before 1600 s
    assert resyncer._waiting == {"!old", "!new"}
    resyncer.stop()
    clock.advance(600)
    assert not clock.getDelayedCalls()


def test_each_round_asks_the_answering_server_then_the_next_few_others() -> None:
    from homeserver.federation.partial_state import servers_for_round

    servers = ["a", "b", "c", "d", "e"]
    assert servers_for_round(servers, 0, per_round=3) == ["a", "b", "c"]
    assert servers_for_round(servers, 1, per_round=3) == ["a", "d", "e"]
    assert servers_for_round(servers, 2, per_round=3) == ["a", "b", "c"]
    assert servers_for_round(["a", "b"], 7, per_round=10) == ["a", "b"]
    assert servers_for_round(["a"], 3) == ["a"] and servers_for_round([], 0) == []
    many = [f"s{i}" for i in range(10_000)]
    assert len(servers_for_round(many, 123)) == 10


def test_a_members_read_waits_for_the_room_to_be_whole_and_seen_here_then_gives_up_with_503() -> None:
    """The read waits while the row is partial, and then until this process's events stream has
    reached the completing write (so the next /sync here shows the room); past its bound it is
    a 503, never an incomplete answer."""
    from typing import Any, cast

    from twisted.internet.defer import Deferred
    from twisted.internet.task import Clock

    from homeserver.handlers.rooms.partial_state import PartialStateWaiter
    from storage.kernel.errors import MatrixError

    class Rows:
        def __init__(self) -> None:
            self.row = _row("!r", None)

        async def get_rows(self, room_ids: Any = None) -> dict[str, PartialStateRow]:
            return {"!r": self.row}

    clock, rows, position = Clock(), Rows(), [0]
    waiter = PartialStateWaiter(cast(Any, rows), clock, seen=lambda instance, at: position[0] >= at,
                                timeout=10, interval=1)
    done = Deferred.fromCoroutine(waiter.wait_for_full_state("!r"))
    clock.advance(3)
    assert not done.called
    rows.row = _row("!r", ("p1", 7))  # whole, but this process has not seen position 7 yet
    clock.advance(1)
    assert not done.called
    position[0] = 7
    clock.advance(1)
    assert done.called and done.result is None

    rows.row = _row("!r", None)
    late = Deferred.fromCoroutine(waiter.wait_for_full_state("!r"))
    clock.advance(11)
    failures: list[Any] = []
    late.addErrback(failures.append)
    assert failures and isinstance(failures[0].value, MatrixError) and failures[0].value.status == 503
