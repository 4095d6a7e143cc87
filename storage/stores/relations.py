"""The relations index (schema 0018): which events relate to which, for ``/relations``,
``/threads`` and the aggregations bundled in ``unsigned.m.relations``.

Rows are written by a trigger on ``events`` (the events writer, in the event's own
transaction). Every read here counts only live relations: the child is in the timeline
(not an outlier, not rejected, not soft-failed), is not redacted, and is in the parent's
room. It knows nothing of visibility or of which edit applies; handlers decide those.
"""

# tests: tests/integration/test_relations.py

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Final

import attrs

from storage.database import Database, Prepared, Transaction, json_rows, one_statement
from storage.stores.timeline import RoomPosition

# A child is live: in the timeline and not redacted by a live redaction.
LIVE_CHILD: Final = (
    "NOT e.outlier AND e.rejection_reason IS NULL AND NOT e.soft_failed "
    "AND NOT EXISTS (SELECT 1 FROM event_redactions x JOIN events red ON red.event_id = x.redaction_id "
    "WHERE x.redacts = e.event_id AND x.room_id = e.room_id AND red.rejection_reason IS NULL "
    "AND NOT red.outlier AND NOT red.soft_failed)"
)

# How many recursion levels ``recurse=true`` follows (relations of relations), as Synapse.
MAX_RECURSION_DEPTH: Final = 3


@attrs.frozen
class RelationRow:
    event_id: str
    parent_id: str
    relation_type: str
    sender: str
    type: str
    stream_ordering: int


@attrs.frozen
class ThreadSummaryRow:
    root_id: str
    count: int
    latest_ids: tuple[str, ...]  # newest first, a few, so the newest visible one can be picked
    participated: bool


@attrs.frozen
class ThreadRow:
    root_id: str
    latest_ordering: int


def _relations_txn(
    txn: Transaction, room_id: str, parent_id: str, *, relation_type: str | None, event_type: str | None,
    start: RoomPosition | None, end: RoomPosition | None, limit: int, backwards: bool, recurse: bool,
) -> list[tuple[str, int]]:
    conditions = ["r.room_id = %s", LIVE_CHILD]
    params: list[object] = [room_id]
    if relation_type is not None:
        conditions.append("r.relation_type = %s")
        params.append(relation_type)
    if event_type is not None:
        conditions.append("e.type = %s")
        params.append(event_type)
    # A backwards page runs from ``start`` down to ``end``, a forwards one from ``start`` up to it.
    after, upto = (end, start) if backwards else (start, end)
    bounds = []
    if after is not None:
        bounds.append(after.sql_after("e."))
    if upto is not None:
        bounds.append(upto.sql_upto("e."))
    for sql, bound_params in bounds:
        conditions.append(sql)
        params += bound_params
    depth = MAX_RECURSION_DEPTH if recurse else 1
    order = "DESC" if backwards else "ASC"
    txn.execute(
        f"""
        WITH RECURSIVE tree (event_id, depth) AS (
            SELECT event_id, 1 FROM event_relations WHERE relates_to_id = %s AND room_id = %s
            UNION
            SELECT c.event_id, t.depth + 1 FROM event_relations c JOIN tree t ON c.relates_to_id = t.event_id
            WHERE t.depth < %s AND c.room_id = %s
        )
        SELECT DISTINCT e.event_id, e.stream_ordering
        FROM tree JOIN event_relations r ON r.event_id = tree.event_id JOIN events e ON e.event_id = r.event_id
        WHERE {" AND ".join(conditions)}
        ORDER BY e.stream_ordering {order} LIMIT %s
        """,
        (parent_id, room_id, depth, room_id, *params, limit),
    )
    return [(str(row[0]), int(row[1])) for row in txn.fetchall()]


# Every /sync serving events runs these two (get_aggregation_rows): Prepared.
_CHILDREN_COLUMNS: Final = "e.event_id, r.relates_to_id, r.relation_type, e.sender, e.type, e.stream_ordering"
_CHILDREN_FROM: Final = f"""
    FROM event_relations r JOIN events e ON e.event_id = r.event_id
    JOIN events p ON p.event_id = r.relates_to_id AND p.room_id = r.room_id
    WHERE r.relates_to_id = ANY(%s::text[]) AND r.relation_type = ANY(%s::text[]) AND {LIVE_CHILD}
    """
_CHILDREN: Final = Prepared(f"SELECT {_CHILDREN_COLUMNS} {_CHILDREN_FROM} ORDER BY e.stream_ordering")
_THREAD_SUMMARIES_SQL: Final = f"""
    SELECT r.relates_to_id, count(*) AS replies,
           (array_agg(e.event_id ORDER BY e.stream_ordering DESC))[1:%s::int] AS latest,
           bool_or(e.sender = %s::text) AS replied
    FROM event_relations r JOIN events e ON e.event_id = r.event_id
    JOIN events p ON p.event_id = r.relates_to_id AND p.room_id = r.room_id
    WHERE r.relates_to_id = ANY(%s::text[]) AND r.relation_type = 'm.thread' AND {LIVE_CHILD}
    GROUP BY r.relates_to_id
    """
_THREAD_SUMMARIES: Final = Prepared(_THREAD_SUMMARIES_SQL)
# Both in one round trip (get_aggregation_rows: every /sync that serves events).
_AGGREGATIONS: Final = one_statement(
    json_rows(_CHILDREN_COLUMNS, _CHILDREN_FROM, "e.stream_ordering"),
    json_rows("relates_to_id, replies, latest, replied", f"FROM ({_THREAD_SUMMARIES_SQL}) AS summaries"),
)


def _children_txn(txn: Transaction, parent_ids: list[str], relation_types: list[str]) -> list[RelationRow]:
    txn.execute(_CHILDREN, (parent_ids, relation_types))
    return _children(txn.fetchall())


def _children(rows: Iterable[Sequence[Any]]) -> list[RelationRow]:
    return [RelationRow(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), int(r[5])) for r in rows]


def _thread_summaries_txn(
    txn: Transaction, root_ids: list[str], user_id: str, latest: int
) -> dict[str, ThreadSummaryRow]:
    txn.execute(_THREAD_SUMMARIES, (latest, user_id, root_ids))
    return _thread_summaries(txn.fetchall())


def _thread_summaries(rows: Iterable[Sequence[Any]]) -> dict[str, ThreadSummaryRow]:
    return {str(r[0]): ThreadSummaryRow(str(r[0]), int(r[1]), tuple(str(x) for x in r[2]), bool(r[3])) for r in rows}


def _threads_txn(
    txn: Transaction, room_id: str, *, participant: str | None, before: int | None, limit: int
) -> list[ThreadRow]:
    having = "" if before is None else "HAVING max(e.stream_ordering) < %s"
    participated = "" if participant is None else (
        "AND (root.sender = %s OR EXISTS (SELECT 1 FROM event_relations pr JOIN events pe ON pe.event_id = pr.event_id "
        "WHERE pr.relates_to_id = r.relates_to_id AND pr.relation_type = 'm.thread' AND pe.sender = %s))"
    )
    params: list[object] = [room_id]
    if participant is not None:
        params += [participant, participant]
    if before is not None:
        params.append(before)
    params.append(limit)
    txn.execute(
        f"""
        SELECT r.relates_to_id, max(e.stream_ordering) AS latest
        FROM event_relations r JOIN events e ON e.event_id = r.event_id
        JOIN events root ON root.event_id = r.relates_to_id AND root.room_id = r.room_id
        WHERE r.room_id = %s AND r.relation_type = 'm.thread' AND {LIVE_CHILD}
          AND NOT root.outlier AND root.rejection_reason IS NULL AND NOT root.soft_failed {participated}
        GROUP BY r.relates_to_id {having}
        ORDER BY latest DESC LIMIT %s
        """,
        params,
    )
    return [ThreadRow(str(r[0]), int(r[1])) for r in txn.fetchall()]


class RelationsStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_relations(
        self, room_id: str, parent_id: str, *, relation_type: str | None, event_type: str | None,
        start: RoomPosition | None, end: RoomPosition | None, limit: int, backwards: bool, recurse: bool,
    ) -> list[tuple[str, int]]:
        """Children of ``parent_id`` (and, with ``recurse``, theirs) with their stream orderings.
        Backwards: ``end < so <= start``, newest first; forwards: ``start < so <= end``."""
        return await self._db.run_interaction(
            "get_relations", _relations_txn, room_id, parent_id, relation_type=relation_type,
            event_type=event_type, start=start, end=end, limit=limit, backwards=backwards, recurse=recurse,
        )

    async def get_children(self, parent_ids: Collection[str], relation_types: Collection[str]) -> list[RelationRow]:
        """Live children of the parents by the given relation types, oldest first."""
        if not parent_ids:
            return []
        return await self._db.run_interaction(
            "get_relation_children", _children_txn, sorted(parent_ids), sorted(relation_types)
        )

    async def get_aggregation_rows(
        self, parent_ids: Collection[str], relation_types: Collection[str], user_id: str, *, latest: int = 5
    ) -> tuple[list[RelationRow], dict[str, ThreadSummaryRow]]:
        """``get_children`` and ``get_thread_summaries`` in one statement (one pool checkout and
        one round trip per served batch of events, as ``/sync`` serialises room by room)."""
        if not parent_ids:
            return [], {}
        parents = sorted(parent_ids)

        def read(txn: Transaction) -> tuple[list[RelationRow], dict[str, ThreadSummaryRow]]:
            txn.execute(_AGGREGATIONS, (parents, sorted(relation_types), latest, user_id, parents))
            row = txn.fetchone()
            assert row is not None
            return _children(row[0] or ()), _thread_summaries(row[1] or ())

        return await self._db.run_reads("get_aggregations", read)

    async def get_thread_summaries(
        self, root_ids: Collection[str], user_id: str, *, latest: int = 5
    ) -> dict[str, ThreadSummaryRow]:
        """Per thread root with live replies: their count, the newest few and whether ``user_id`` replied."""
        if not root_ids:
            return {}
        return await self._db.run_interaction(
            "get_thread_summaries", _thread_summaries_txn, sorted(root_ids), user_id, latest
        )

    async def get_threads(
        self, room_id: str, *, participant: str | None, before: int | None, limit: int
    ) -> list[ThreadRow]:
        """The room's thread roots by latest reply, newest first, older than ``before``; with
        ``participant`` only threads they started or replied in."""
        return await self._db.run_interaction(
            "get_threads", _threads_txn, room_id, participant=participant, before=before, limit=limit
        )
