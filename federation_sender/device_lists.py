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

A change of a user's master or self-signing key is on the same stream (its row names the
key's public key), so it outlives backoff and restarts the same way: the store reads, per
user with such a change, the user's current master and self-signing keys, and each becomes
one ``m.signing_key_update`` with the keys as they are now. The two kinds share the
``limit`` and the position: whichever changes come first in the stream go first.
"""

# tests: tests/unit/federation_sender/test_device_lists.py

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from storage.stores.federation_sender import DeviceListRow, SigningKeysRow

SIGNING_KEY_FIELDS = {"master": "master_key", "self_signing": "self_signing_key"}


@attrs.frozen
class DeviceListBatch:
    contents: tuple[dict[str, Any], ...]
    # The position the destination has every change up to once ``contents`` are accepted.
    upto: int
    # Users with changes past ``upto`` were left for the next read.
    more: bool
    # ``m.signing_key_update`` contents.
    signing: tuple[dict[str, Any], ...] = ()


def _json_object(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _add_signatures(keys: dict[str, Any], user_id: str, signatures: Sequence[tuple[str, str]]) -> None:
    """The owner's signatures (signing key ID, signature) from /keys/signatures/upload, merged
    into ``keys``' own, as /keys/query gives them."""
    if not signatures:
        return
    existing = keys.setdefault("signatures", {})
    if isinstance(existing, dict):
        mine = existing.setdefault(user_id, {})
        if isinstance(mine, dict):
            mine.update(dict(signatures))


def _content(row: DeviceListRow, prev_ids: list[int]) -> dict[str, Any]:
    content: dict[str, Any] = {
        "user_id": row.user_id, "device_id": row.device_id, "stream_id": row.stream_id,
        "prev_id": prev_ids, "deleted": row.deleted,
    }
    if not row.deleted:
        keys = _json_object(row.key_json)
        if keys is not None:
            keys.pop("unsigned", None)
            _add_signatures(keys, row.user_id, row.signatures)
            content["keys"] = keys
        if row.display_name is not None:
            content["device_display_name"] = row.display_name
    return content


def signing_key_update(row: SigningKeysRow) -> dict[str, Any] | None:
    """The ``m.signing_key_update`` for a user's current master and self-signing keys (None:
    neither is readable)."""
    content: dict[str, Any] = {"user_id": row.user_id}
    for key_type, key_json in row.keys:
        field = SIGNING_KEY_FIELDS.get(key_type)
        key = _json_object(key_json)
        if field is None or key is None:
            continue
        keys = key.get("keys")
        # A signature's target is a key by its public part (the value of "ed25519:<public>").
        publics = {v for k, v in keys.items() if str(k).startswith("ed25519:")} if isinstance(keys, dict) else set()
        _add_signatures(key, row.user_id, [(signing_key_id, signature) for target, signing_key_id, signature
                                           in row.signatures if target in publics])
        content[field] = key
    return content if len(content) > 1 else None


def plan_updates(rows: Sequence[DeviceListRow], *, upto: int, limit: int,
                 signing: Sequence[SigningKeysRow] = ()) -> DeviceListBatch:
    """``rows``: per user (in ascending stream ID, a user's rows together) the devices of its newest
    change, read up to position ``upto``; ``signing``: per user (ascending stream ID) its newest
    cross-signing key change up to ``upto``. At most ``limit`` EDUs, one per user and kind."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    changes: list[list[DeviceListRow]] = []
    for row in rows:
        if changes and changes[-1][0].user_id == row.user_id and changes[-1][0].stream_id == row.stream_id:
            changes[-1].append(row)
        else:
            changes.append([row])
    # Both kinds in stream order (a device change before a key change at the same position).
    merged = sorted([(c[0].stream_id, 0, i) for i, c in enumerate(changes)]
                    + [(r.stream_id, 1, i) for i, r in enumerate(signing)])
    more = len(merged) > limit
    taken = merged[:limit]
    devices = tuple(_update(changes[i]) for _, kind, i in taken if kind == 0)
    keys = tuple(c for _, kind, i in taken if kind == 1 and (c := signing_key_update(signing[i])) is not None)
    return DeviceListBatch(devices, taken[-1][0] if more else upto, more=more, signing=keys)


def _update(change: list[DeviceListRow]) -> dict[str, Any]:
    first = min(change, key=lambda r: r.device_id)
    if len(change) > 1:
        return _content(first, [first.stream_id])  # several devices: the receiver refetches the list
    return _content(first, [] if first.prev_id is None else [first.prev_id])
