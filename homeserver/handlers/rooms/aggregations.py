"""Server-side aggregation of relations, bundled in ``unsigned.m.relations`` (spec:
"Aggregations of child events").

``Aggregator.bundle`` works out, for events about to be served to one user, the three
aggregations the spec defines: ``m.replace`` (the most recent valid edit), ``m.thread``
(latest reply, count, whether the user took part) and ``m.reference`` (the referencing
event IDs). The rules deciding which edit applies are pure functions below; the
aggregator reads the relations index and leaves the client format to ``ClientEvents``.
Children the user may not see (``visible``) are left out, so an aggregation never
reveals an event its history visibility hides.
"""

# tests: tests/unit/handlers/test_aggregations.py, tests/integration/test_relations.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Final

import attrs

from homeserver.events import FrozenEvent
from homeserver.handlers.rooms.event_loader import EventLoader
from storage.stores.relations import RelationsStore

REPLACE: Final = "m.replace"
THREAD: Final = "m.thread"
REFERENCE: Final = "m.reference"
# At most this many references are bundled per event.
MAX_BUNDLED_REFERENCES: Final = 50

Visible = Callable[[Collection[FrozenEvent]], Awaitable[list[FrozenEvent]]]


def relation_of(event: FrozenEvent) -> tuple[str, str] | None:
    """``(rel_type, parent event ID)`` of the event's ``m.relates_to``, or None."""
    relates = event.content.get("m.relates_to")
    if not isinstance(relates, Mapping):
        return None
    rel_type, parent = relates.get("rel_type"), relates.get("event_id")
    if isinstance(rel_type, str) and isinstance(parent, str):
        return rel_type, parent
    return None


def is_valid_edit(original: FrozenEvent, edit: FrozenEvent) -> bool:
    """The spec's "Validity of replacement events": same room, sender and type, neither a state
    event, the original not itself an edit, and (unencrypted) an object ``m.new_content``."""
    if original.room_id != edit.room_id or original.sender != edit.sender or original.type != edit.type:
        return False
    if original.state_key is not None or edit.state_key is not None:
        return False
    rel = relation_of(original)
    if rel is not None and rel[0] == REPLACE:
        return False
    if edit.type == "m.room.encrypted":
        return True
    new_content = edit.content.get("m.new_content")
    return isinstance(new_content, Mapping)


def pick_edit(original: FrozenEvent, edits: Sequence[FrozenEvent]) -> FrozenEvent | None:
    """The edit to bundle: the valid one with the greatest ``origin_server_ts``, ties broken by
    the greatest event ID (the spec's order)."""
    valid = [e for e in edits if is_valid_edit(original, e)]
    if not valid:
        return None
    return max(valid, key=lambda e: (e.origin_server_ts, e.event_id))


@attrs.frozen
class ThreadSummary:
    latest: FrozenEvent
    count: int
    participated: bool


@attrs.frozen
class Bundle:
    edit: FrozenEvent | None = None
    thread: ThreadSummary | None = None
    references: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return self.edit is None and self.thread is None and not self.references


class Aggregator:
    def __init__(self, *, store: RelationsStore, loader: EventLoader) -> None:
        self._store = store
        self._loader = loader

    async def bundle(
        self, events: Sequence[FrozenEvent], user_id: str, visible: Visible, *, redacted: Collection[str] = ()
    ) -> dict[str, Bundle]:
        """The aggregations of each of ``events`` (non-empty ones only). State events and
        ``redacted`` ones get none (a redacted event's edits must not show)."""
        parents = {e.event_id: e for e in events if e.state_key is None and e.event_id not in redacted}
        if not parents:
            return {}
        rows, summaries = await self._store.get_aggregation_rows(parents, (REPLACE, REFERENCE), user_id)
        wanted = {r.event_id for r in rows}
        for row_summary in summaries.values():
            wanted.update(row_summary.latest_ids)
        loaded = await self._loader.load_events(wanted)
        seen = {e.event_id for e in await visible(list(loaded.values()))}
        edits: dict[str, list[FrozenEvent]] = {}
        references: dict[str, list[str]] = {}
        for row in rows:
            if row.event_id not in seen:
                continue
            if row.relation_type == REPLACE:
                edits.setdefault(row.parent_id, []).append(loaded[row.event_id])
            elif row.relation_type == REFERENCE:
                references.setdefault(row.parent_id, []).append(row.event_id)
        out: dict[str, Bundle] = {}
        for event_id, parent in parents.items():
            thread = None
            summary = summaries.get(event_id)
            if summary is not None:
                latest = next((loaded[i] for i in summary.latest_ids if i in seen), None)
                if latest is not None:
                    thread = ThreadSummary(latest, summary.count,
                                           summary.participated or parent.sender == user_id)
            bundle = Bundle(
                edit=pick_edit(parent, edits.get(event_id, ())),
                thread=thread,
                references=tuple(references.get(event_id, ())[:MAX_BUNDLED_REFERENCES]),
            )
            if not bundle.empty:
                out[event_id] = bundle
        return out
