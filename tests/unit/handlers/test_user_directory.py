"""The user directory's updater against an in-memory store: what it rewrites, and when the
stored position moves."""

from __future__ import annotations

from collections.abc import Collection

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from homeserver.handlers.directory.user_directory import POSITION_WRITE_LAG, UserDirectoryUpdater, batches
from storage.kernel.written_events import WrittenEvent, WrittenEvents
from storage.stores.user_directory import UserDirectoryStore


class FakeStore(UserDirectoryStore):
    def __init__(self, changes: dict[int, str]) -> None:
        self.changes = changes  # stream ordering -> room with a state event there
        self.position = 0
        self.rebuilt: list[tuple[list[str], int | None]] = []
        self.queries = 0

    async def get_position(self) -> int:
        return self.position

    async def changed_rooms(self, after: int, upto: int) -> list[str]:
        self.queries += 1
        rooms: list[str] = []
        for ordering in sorted(self.changes):
            if after < ordering <= upto and self.changes[ordering] not in rooms:
                rooms.append(self.changes[ordering])
        return rooms

    async def rebuild_rooms(self, room_ids: Collection[str], position: int | None) -> None:
        self.rebuilt.append((sorted(room_ids), position))
        if position is not None:
            self.position = max(self.position, position)


def run(updater: UserDirectoryUpdater) -> int:
    d = Deferred.fromCoroutine(updater.update_once())
    results: list[int] = []
    d.addCallback(results.append)
    assert results, "the fake store never waits"
    return results[0]


def test_batches_keep_order_and_size() -> None:
    assert batches([], 2) == []
    assert batches(["a", "b", "c"], 2) == [["a", "b"], ["c"]]


def test_rewrites_changed_rooms_once_and_stores_the_position_with_the_last_batch() -> None:
    store = FakeStore({1: "!a", 2: "!b", 3: "!a"})
    position = [3]
    updater = UserDirectoryUpdater(store, Clock(), lambda: position[0])
    assert run(updater) == 2
    assert store.rebuilt == [(["!a", "!b"], 3)] and store.position == 3
    # Nothing new: nothing rewritten, the position stays.
    assert run(updater) == 0 and store.rebuilt == [(["!a", "!b"], 3)]
    # The stream moved past events that changed no state: nothing is written, the position
    # moves in memory only (no query for it either) ...
    position[0] = 7
    store.position = -1  # a stored position read again would show
    assert run(updater) == 0 and store.rebuilt == [(["!a", "!b"], 3)] and store.position == -1
    # ... and a later change is looked for after it, not after the stored one.
    store.changes[5] = "!c"
    store.changes[9] = "!d"
    position[0] = 9
    assert run(updater) == 1 and store.rebuilt[-1] == (["!d"], 9) and store.position == 9


def test_the_stored_position_catches_up_once_it_lags_far_enough() -> None:
    store = FakeStore({})
    position = [POSITION_WRITE_LAG - 1]
    updater = UserDirectoryUpdater(store, Clock(), lambda: position[0])
    assert run(updater) == 0 and store.rebuilt == [] and store.position == 0
    position[0] = POSITION_WRITE_LAG
    assert run(updater) == 0 and store.rebuilt == [([], POSITION_WRITE_LAG)] and store.position == POSITION_WRITE_LAG


def test_many_rooms_go_in_batches_with_the_position_last() -> None:
    store = FakeStore({i: f"!r{i:03}" for i in range(1, 251)})
    updater = UserDirectoryUpdater(store, Clock(), lambda: 250)
    assert run(updater) == 250
    assert [position for _, position in store.rebuilt] == [None, None, 250]
    assert sum(len(rooms) for rooms, _ in store.rebuilt) == 250


def test_messages_this_process_wrote_need_no_query() -> None:
    """Positions 1 and 2 are messages persisted here: nothing to look for. Position 3 is a
    member event persisted here: its room is looked for and rewritten."""
    store = FakeStore({3: "!a"})
    written = WrittenEvents()
    written.note(1, WrittenEvent(state=False, fanout=True))
    written.note(2, WrittenEvent(state=False, fanout=False))
    position = [2]
    updater = UserDirectoryUpdater(store, Clock(), lambda: position[0], written=written)
    assert run(updater) == 0 and store.queries == 0
    written.note(3, WrittenEvent(state=True, fanout=False))
    position[0] = 3
    assert run(updater) == 1 and store.queries == 1 and store.rebuilt == [(["!a"], 3)]


class CountingStore(FakeStore):
    """Counts the reads and writes a pass makes, to show when no pass ran at all."""

    def __init__(self, changes: dict[int, str]) -> None:
        super().__init__(changes)
        self.position_reads = 0

    async def get_position(self) -> int:
        self.position_reads += 1
        return await super().get_position()


def test_new_messages_noted_here_touch_no_table_until_the_position_must_be_stored() -> None:
    """Woken by the stream (``on_new_events``, which skips the pass when the notes allow): once
    the position is known, messages noted by this process cost no read and no write; a position
    lagging ``POSITION_WRITE_LAG`` behind is stored, and a member event noted here, or a position
    with no note, is looked for."""
    store = CountingStore({POSITION_WRITE_LAG + 2: "!a"})
    written = WrittenEvents()
    position = [1]
    written.note(1, WrittenEvent(state=False, fanout=False))
    updater = UserDirectoryUpdater(store, Clock(), lambda: position[0], written=written)
    updater.on_new_events()  # the first pass reads the stored position
    assert store.position_reads == 1 and store.rebuilt == []
    for ordering in range(2, POSITION_WRITE_LAG):
        written.note(ordering, WrittenEvent(state=False, fanout=True))
        position[0] = ordering
        updater.on_new_events()
    assert store.position_reads == 1 and store.queries == 0 and store.rebuilt == [] and store.position == 0
    written.note(POSITION_WRITE_LAG, WrittenEvent(state=False, fanout=False))
    position[0] = POSITION_WRITE_LAG
    updater.on_new_events()  # far enough behind: a pass stores the position, still with no query
    assert store.queries == 0 and store.rebuilt == [([], POSITION_WRITE_LAG)]
    position[0] = POSITION_WRITE_LAG + 1  # written by another process: no note
    updater.on_new_events()
    assert store.queries == 1
    written.note(POSITION_WRITE_LAG + 2, WrittenEvent(state=True, fanout=False))
    position[0] = POSITION_WRITE_LAG + 2
    updater.on_new_events()
    assert store.queries == 2 and store.rebuilt[-1] == (["!a"], POSITION_WRITE_LAG + 2)
