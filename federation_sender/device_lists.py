"""Device-list updates for a destination, from the ``device_lists`` stream: which to send, and how far they go.

Pure. The store reads, for one destination, the newest change of each local
user sharing a room with it above its ``device_lists_position`` (oldest user's
change first, one row per device the change names, with the user's previous
change as ``prev_id``). This module turns those rows into
``m.device_list_update`` contents that fit a transaction and says up to which
stream position they cover the destination.

Only a user's newest change is sent: its ``prev_id`` is the user's previous
change, which a destination that missed it does not have, so it fetches the
user's whole list (``GET /user/devices``), which is what it needs. A change
naming several devices shares one stream ID, which the updates of a receiver's
cache cannot tell apart (it takes the first and ignores the rest as seen), so
it is sent as one update whose ``prev_id`` is its own stream ID, which no
destination has seen before having the change: the same fetch.
"""

# tests: tests/unit/federation_sender/test_device_lists.py

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from storage.stores.federation_sender import DeviceListRow


@attrs.frozen
class DeviceListBatch:
    contents: tuple[dict[str, Any], ...]
    # The position the destination has every change up to once ``contents`` are accepted.
    upto: int
    # Users with changes past ``upto`` were left for the next read.
    more: bool


def _content(row: DeviceListRow, prev_ids: list[int]) -> dict[str, Any]:
    content: dict[str, Any] = {
        "user_id": row.user_id, "device_id": row.device_id, "stream_id": row.stream_id,
        "prev_id": prev_ids, "deleted": row.deleted,
    }
    if not row.deleted:
        if row.key_json is not None:
            try:
                keys = json.loads(row.key_json)
            except ValueError:
                keys = None
            if isinstance(keys, dict):
                keys.pop("unsigned", None)
                if row.signatures:  # the owner's cross-signing signatures, as /keys/query gives them
                    signatures = keys.setdefault("signatures", {})
                    if isinstance(signatures, dict):
                        mine = signatures.setdefault(row.user_id, {})
                        if isinstance(mine, dict):
                            mine.update(dict(row.signatures))
                content["keys"] = keys
        if row.display_name is not None:
            content["device_display_name"] = row.display_name
    return content


def plan_updates(rows: Sequence[DeviceListRow], *, upto: int, limit: int) -> DeviceListBatch:
    """``rows``: per user (in ascending stream ID, a user's rows together) the devices of its newest
    change, read up to position ``upto``; at most ``limit`` EDUs, one per user."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    changes: list[list[DeviceListRow]] = []
    for row in rows:
        if changes and changes[-1][0].user_id == row.user_id and changes[-1][0].stream_id == row.stream_id:
            changes[-1].append(row)
        else:
            changes.append([row])
    if len(changes) > limit:
        return DeviceListBatch(tuple(_update(change) for change in changes[:limit]), changes[limit - 1][0].stream_id,
                               more=True)
    return DeviceListBatch(tuple(_update(change) for change in changes), upto, more=False)


def _update(change: list[DeviceListRow]) -> dict[str, Any]:
    first = min(change, key=lambda r: r.device_id)
    if len(change) > 1:
        return _content(first, [first.stream_id])  # several devices: the receiver refetches the list
    return _content(first, [] if first.prev_id is None else [first.prev_id])
