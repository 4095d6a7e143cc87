"""The ``m.presence`` event a user's stored presence is shown as, to clients and application services.

Pure: the row and the time are arguments.
"""

# tests: tests/integration/test_appservice.py, tests/integration/test_client_legacy.py

from __future__ import annotations

from typing import Any

from storage.stores.presence import PresenceRow


def presence_content(row: PresenceRow, now_ms: int) -> dict[str, Any]:
    content: dict[str, Any] = {
        "presence": row.state,
        "last_active_ago": max(0, now_ms - row.last_active_ts),
        "currently_active": row.currently_active,
    }
    if row.status_msg is not None:
        content["status_msg"] = row.status_msg
    return content


def presence_event(row: PresenceRow, now_ms: int) -> dict[str, Any]:
    return {"type": "m.presence", "sender": row.user_id, "content": presence_content(row, now_ms)}
