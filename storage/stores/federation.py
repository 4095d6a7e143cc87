"""SQL for federation: answered inbound transactions and other servers' key responses."""

# tests: tests/integration/test_federation.py

from __future__ import annotations

import json
from typing import Any

import attrs

from storage.database import Database, Transaction


@attrs.frozen
class StoredKeyResponse:
    server_name: str
    response: dict[str, Any]
    fetched_ts: int


class FederationStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def get_transaction_response(self, origin: str, transaction_id: str) -> dict[str, Any] | None:
        def query(txn: Transaction) -> dict[str, Any] | None:
            txn.execute(
                "SELECT response_json FROM received_transactions WHERE origin = %s AND transaction_id = %s",
                (origin, transaction_id),
            )
            row = txn.fetchone()
            if row is None:
                return None
            value: dict[str, Any] = json.loads(row[0])
            return value

        return await self._db.run_interaction("get_transaction_response", query)

    async def store_transaction_response(
        self, origin: str, transaction_id: str, response: dict[str, Any], now_ms: int
    ) -> None:
        def write(txn: Transaction) -> None:
            txn.execute(
                """
                INSERT INTO received_transactions (origin, transaction_id, response_json, received_ts)
                VALUES (%s, %s, %s, %s) ON CONFLICT (origin, transaction_id) DO NOTHING
                """,
                (origin, transaction_id, json.dumps(response, separators=(",", ":")), now_ms),
            )

        await self._db.run_interaction("store_transaction_response", write)

    async def get_key_response(self, server_name: str) -> StoredKeyResponse | None:
        def query(txn: Transaction) -> StoredKeyResponse | None:
            txn.execute(
                "SELECT response_json, fetched_ts FROM server_keys_json WHERE server_name = %s", (server_name,)
            )
            row = txn.fetchone()
            return None if row is None else StoredKeyResponse(server_name, json.loads(row[0]), int(row[1]))

        return await self._db.run_interaction("get_key_response", query)

    async def store_key_response(self, server_name: str, response: dict[str, Any], fetched_ts: int) -> None:
        def write(txn: Transaction) -> None:
            txn.execute(
                """
                INSERT INTO server_keys_json (server_name, response_json, fetched_ts) VALUES (%s, %s, %s)
                ON CONFLICT (server_name) DO UPDATE
                SET response_json = EXCLUDED.response_json, fetched_ts = EXCLUDED.fetched_ts
                """,
                (server_name, json.dumps(response, separators=(",", ":")), fetched_ts),
            )

        await self._db.run_interaction("store_key_response", write)
