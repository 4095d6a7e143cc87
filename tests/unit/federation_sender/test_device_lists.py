"""Which device-list updates a destination gets from the rows the store read, and how far they cover it."""

from __future__ import annotations

import pytest

from federation_sender.device_lists import plan_updates
from storage.stores.federation_sender import DeviceListRow, SigningKeysRow


def row(user: str, stream_id: int, device: str = "D", *, prev: int | None = None, deleted: bool = False,
        name: str | None = None, keys: str | None = '{"device_id": "D", "unsigned": {"x": 1}}') -> DeviceListRow:
    return DeviceListRow(user, stream_id, device, deleted, prev, name, keys)


def test_each_user_s_newest_change_follows_its_previous_one() -> None:
    batch = plan_updates([row("@a:x", 3, prev=1, name="Phone"), row("@b:x", 4)], upto=9, limit=10)
    assert batch.upto == 9 and not batch.more
    assert batch.contents == (
        {"user_id": "@a:x", "device_id": "D", "stream_id": 3, "prev_id": [1], "deleted": False,
         "keys": {"device_id": "D"}, "device_display_name": "Phone"},
        {"user_id": "@b:x", "device_id": "D", "stream_id": 4, "prev_id": [], "deleted": False,
         "keys": {"device_id": "D"}},
    )


def test_a_deletion_carries_no_keys_and_broken_keys_are_left_out() -> None:
    batch = plan_updates([row("@a:x", 2, deleted=True, prev=1), row("@b:x", 3, keys="{not json")], upto=3, limit=10)
    assert "keys" not in batch.contents[0] and batch.contents[0]["deleted"] is True
    assert "keys" not in batch.contents[1]


def test_a_change_of_several_devices_is_one_update_that_makes_the_receiver_refetch() -> None:
    rows = [row("@a:x", 5, "B", prev=2), row("@a:x", 5, "A", prev=2), row("@b:x", 6, prev=4)]
    batch = plan_updates(rows, upto=6, limit=2)
    assert [(c["user_id"], c["device_id"], c["prev_id"]) for c in batch.contents] == [
        ("@a:x", "A", [5]), ("@b:x", "D", [4])]
    assert batch.upto == 6 and not batch.more


def test_more_users_than_fit_leave_the_rest_for_the_next_read() -> None:
    rows = [row("@a:x", 3), row("@b:x", 5, "X"), row("@b:x", 5, "Y"), row("@c:x", 8)]
    batch = plan_updates(rows, upto=9, limit=2)
    assert [c["user_id"] for c in batch.contents] == ["@a:x", "@b:x"]
    assert batch.upto == 5 and batch.more, "the next user waits for the next transaction"


def test_nothing_read_covers_the_read() -> None:
    assert plan_updates([], upto=7, limit=1).contents == ()
    with pytest.raises(ValueError):
        plan_updates([], upto=7, limit=0)


def test_the_owner_s_cross_signing_signatures_ride_with_the_keys() -> None:
    signed = DeviceListRow("@a:x", 2, "D", False, None, None,
                           '{"device_id": "D", "signatures": {"@a:x": {"ed25519:D": "self"}}}',
                           (("ed25519:SSK", "cross"),))
    keys = plan_updates([signed], upto=2, limit=1).contents[0]["keys"]
    assert keys["signatures"] == {"@a:x": {"ed25519:D": "self", "ed25519:SSK": "cross"}}


MASTER = '{"user_id": "@a:x", "usage": ["master"], "keys": {"ed25519:MPUB": "MPUB"}}'
SELF_SIGNING = ('{"user_id": "@a:x", "usage": ["self_signing"], "keys": {"ed25519:SPUB": "SPUB"}, '
                '"signatures": {"@a:x": {"ed25519:MPUB": "by-master"}}}')


def test_a_cross_signing_key_change_is_an_m_signing_key_update_with_the_current_keys() -> None:
    keys = SigningKeysRow("@a:x", 4, (("master", MASTER), ("self_signing", SELF_SIGNING)),
                          (("MPUB", "ed25519:DEV", "by-device"), ("OTHER", "ed25519:DEV", "elsewhere")))
    batch = plan_updates([row("@b:x", 3)], upto=9, limit=10, signing=[keys])
    assert [c["user_id"] for c in batch.contents] == ["@b:x"]
    assert batch.signing == ({
        "user_id": "@a:x",
        "master_key": {"user_id": "@a:x", "usage": ["master"], "keys": {"ed25519:MPUB": "MPUB"},
                       "signatures": {"@a:x": {"ed25519:DEV": "by-device"}}},
        "self_signing_key": {"user_id": "@a:x", "usage": ["self_signing"], "keys": {"ed25519:SPUB": "SPUB"},
                             "signatures": {"@a:x": {"ed25519:MPUB": "by-master"}}},
    },)
    assert batch.upto == 9 and not batch.more


def test_device_and_key_changes_share_the_limit_in_stream_order() -> None:
    keys = [SigningKeysRow("@k:x", 2, (("master", MASTER),)), SigningKeysRow("@l:x", 7, (("master", MASTER),))]
    batch = plan_updates([row("@a:x", 3), row("@b:x", 5)], upto=9, limit=2, signing=keys)
    assert [c["user_id"] for c in batch.signing] == ["@k:x"]
    assert [c["user_id"] for c in batch.contents] == ["@a:x"]
    assert batch.upto == 3 and batch.more, "the rest waits for the next read"


def test_unreadable_cross_signing_keys_send_nothing() -> None:
    batch = plan_updates([], upto=5, limit=3, signing=[SigningKeysRow("@k:x", 2, (("master", "{broken"),))])
    assert batch.signing == () and batch.upto == 5
