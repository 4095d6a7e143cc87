"""Full-text search over events (schema 0018's ``events.search_vector``, GIN-indexed and
filled on persist by the events writer): ``POST /search``'s ``room_events``.

PostgreSQL parses the user's term (``websearch_to_tsquery``, which accepts any text) and
ranks with ``ts_rank_cd``. Only live, unredacted events are found; which rooms may be
searched and which results a user may see is the handler's business.
"""

# tests: tests/integration/test_search.py

from __future__ import annotations

from collections.abc import Collection
from typing import Final

import attrs

from storage.database import Database, Transaction
from storage.stores.relations import LIVE_CHILD

# The text search configuration of the trigger that fills search_vector: the same here.
TS_CONFIG: Final = "english"
MAX_COUNT: Final = 10_000


@attrs.frozen
class SearchHit:
    event_id: str
    room_id: str
    stream_ordering: int
    rank: float


@attrs.frozen
class SearchQuery:
    term: str
    room_ids: tuple[str, ...]
    types: tuple[str, ...]
    senders: tuple[str, ...] | None = None
    not_senders: tuple[str, ...] = ()


def _where(query: SearchQuery) -> tuple[str, list[object]]:
    conditions = [
        "e.room_id = ANY(%s)", "e.type = ANY(%s)", "e.search_vector @@ q.query", LIVE_CHILD,
    ]
    params: list[object] = [list(query.room_ids), list(query.types)]
    if query.senders is not None:
        conditions.append("e.sender = ANY(%s)")
        params.append(list(query.senders))
    if query.not_senders:
        conditions.append("NOT (e.sender = ANY(%s))")
        params.append(list(query.not_senders))
    return " AND ".join(conditions), params


def _search_txn(
    txn: Transaction, query: SearchQuery, *, by_rank: bool, before: int | None, offset: int, limit: int
) -> tuple[list[SearchHit], int]:
    where, params = _where(query)
    source = f"events e, websearch_to_tsquery('{TS_CONFIG}', %s) AS q(query)"
    # The spec's count is "approximate": counted exactly up to MAX_COUNT, which bounds the
    # heap reads a very common word costs.
    txn.execute(f"SELECT count(*) FROM (SELECT 1 FROM {source} WHERE {where} LIMIT %s) AS capped",
                (query.term, *params, MAX_COUNT))
    row = txn.fetchone()
    count = int(row[0]) if row is not None else 0
    page_where, page_params = where, list(params)
    if before is not None:
        page_where += " AND e.stream_ordering < %s"
        page_params.append(before)
    order = "rank DESC, e.stream_ordering DESC" if by_rank else "e.stream_ordering DESC"
    txn.execute(
        f"SELECT e.event_id, e.room_id, e.stream_ordering, ts_rank_cd(e.search_vector, q.query) AS rank "
        f"FROM {source} WHERE {page_where} ORDER BY {order} LIMIT %s OFFSET %s",
        (query.term, *page_params, limit, offset),
    )
    hits = [SearchHit(str(r[0]), str(r[1]), int(r[2]), float(r[3])) for r in txn.fetchall()]
    return hits, count


def _lexemes_txn(txn: Transaction, term: str) -> list[str]:
    txn.execute(f"SELECT lower(token) FROM ts_debug('{TS_CONFIG}', %s) WHERE array_length(lexemes, 1) > 0", (term,))
    return [str(r[0]) for r in txn.fetchall()]


class SearchStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def search(
        self, query: SearchQuery, *, by_rank: bool, before: int | None, offset: int, limit: int
    ) -> tuple[list[SearchHit], int]:
        """A page of hits (best rank or newest first) and how many there are in all. ``before``
        keeps hits older than that stream ordering; ``offset`` skips the first hits."""
        if not query.room_ids or not query.types:
            return [], 0
        return await self._db.run_interaction(
            "search_events", _search_txn, query, by_rank=by_rank, before=before, offset=offset, limit=limit
        )

    async def highlight_words(self, term: str) -> list[str]:
        """The words of ``term`` that the search matches on (stop words left out)."""
        return await self._db.run_interaction("search_highlights", _lexemes_txn, term)

    async def searchable(self, room_ids: Collection[str]) -> int:
        """How many events of these rooms carry a search vector (for tests and operators)."""
        def query(txn: Transaction) -> int:
            txn.execute("SELECT count(*) FROM events WHERE room_id = ANY(%s) AND search_vector IS NOT NULL",
                        (list(room_ids),))
            row = txn.fetchone()
            return int(row[0]) if row is not None else 0

        return await self._db.run_interaction("count_searchable", query)
