"""Threaded read receipts' pure parts: which thread_id a receipt may carry, and how /sync
shapes a room's unread counts per thread."""

from __future__ import annotations

import pytest

from homeserver.handlers.ephemeral.receipts import check_receipt_thread
from homeserver.handlers.sync.sync import unread_sections
from storage.kernel.errors import MatrixError


def test_receipt_threads() -> None:
    for receipt_type, thread in (("m.read", None), ("m.read", "main"), ("m.read.private", "$root"),
                                 ("m.fully_read", None)):
        check_receipt_thread(receipt_type, thread)
    for receipt_type, thread in (("m.read", ""), ("m.read", "thread"), ("m.fully_read", "main")):
        with pytest.raises(MatrixError) as e:
            check_receipt_thread(receipt_type, thread)
        assert e.value.status == 400 and e.value.errcode == "M_INVALID_PARAM"


def test_unread_sections_sum_or_split() -> None:
    counts = {None: (2, 1), "$a": (3, 0), "$b": (1, 1)}
    assert unread_sections(counts, False) == {"unread_notifications": {"notification_count": 6, "highlight_count": 2}}
    assert unread_sections(counts, True) == {
        "unread_notifications": {"notification_count": 2, "highlight_count": 1},
        "unread_thread_notifications": {"$a": {"notification_count": 3, "highlight_count": 0},
                                        "$b": {"notification_count": 1, "highlight_count": 1}},
    }
    # Only threads unread: the main timeline's counts are 0; nothing at all: no thread section.
    assert unread_sections({"$a": (1, 0)}, True)["unread_notifications"] == {
        "notification_count": 0, "highlight_count": 0}
    assert unread_sections({}, True) == {"unread_notifications": {"notification_count": 0, "highlight_count": 0}}
