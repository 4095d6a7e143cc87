"""The pure rules of end-to-end keys: device-key validation, device-list update ordering, answers of other servers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from signedjson.key import encode_verify_key_base64, generate_signing_key, get_verify_key
from signedjson.sign import sign_json

from homeserver.handlers.e2e.e2e_rules import (
    Step,
    check_cross_signing_key,
    check_device_keys,
    next_step,
    parse_prev_ids,
    parse_user_devices,
    public_key_of,
    signed_by,
    split_by_server,
)
from storage.kernel.errors import MatrixError

USER = "@alice:a.example"
DEVICE = "ALICEPHONE"


def signed_keys(user_id: str = USER, device_id: str = DEVICE) -> dict[str, Any]:
    key = generate_signing_key(device_id)
    keys = {
        "user_id": user_id,
        "device_id": device_id,
        "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
        "keys": {
            f"curve25519:{device_id}": "3C5BFWi2Y8MaVvjM8M22DBmh24PmgR0nPvJOIArzgyI",
            f"ed25519:{device_id}": encode_verify_key_base64(get_verify_key(key)),
        },
    }
    return sign_json(keys, user_id, key)


def test_signed_device_keys_are_accepted() -> None:
    keys = signed_keys()
    assert check_device_keys(keys, USER, DEVICE) == keys


@pytest.mark.parametrize(
    "change",
    [
        lambda k: k.update(user_id="@mallory:a.example"),
        lambda k: k.update(device_id="OTHER"),
        lambda k: k.update(algorithms=[]),
        lambda k: k.update(algorithms="m.megolm.v1.aes-sha2"),
        lambda k: k.update(keys={}),
        lambda k: k["keys"].pop(f"ed25519:{DEVICE}"),
        lambda k: k["keys"].update({"curve25519:OTHER": "x"}),
        lambda k: k.pop("signatures"),
        lambda k: k["keys"].update({f"curve25519:{DEVICE}": "tampered"}),  # the signature no longer matches
        lambda k: k["keys"].update({f"ed25519:{DEVICE}": "not base64!"}),
    ],
)
def test_invalid_device_keys_are_refused(change: Any) -> None:
    keys = copy.deepcopy(signed_keys())
    change(keys)
    with pytest.raises(MatrixError) as e:
        check_device_keys(keys, USER, DEVICE)
    assert e.value.status == 400


def test_keys_signed_by_another_device_are_refused() -> None:
    keys = signed_keys()
    keys["keys"][f"ed25519:{DEVICE}"] = signed_keys(device_id=DEVICE)["keys"][f"ed25519:{DEVICE}"]
    with pytest.raises(MatrixError):
        check_device_keys(keys, USER, DEVICE)


def test_an_update_that_follows_on_the_cache_is_applied() -> None:
    assert next_step(5, 9, [5]) is Step.APPLY
    # The cache went past the predecessor (a resync at 7): still the next change after 5.
    assert next_step(7, 9, [5]) is Step.APPLY


def test_an_update_seen_already_is_ignored() -> None:
    assert next_step(9, 9, [5]) is Step.IGNORE
    assert next_step(12, 9, [5]) is Step.IGNORE


def test_a_gap_or_an_unknown_user_needs_the_whole_list() -> None:
    assert next_step(None, 9, [5]) is Step.RESYNC
    assert next_step(5, 9, [7]) is Step.RESYNC  # 7 was missed
    assert next_step(5, 9, []) is Step.RESYNC  # the sender cannot say what came before


@given(st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=20, unique=True))
def test_a_chain_applied_in_any_order_ends_at_its_last_update(ids: list[int]) -> None:
    """Updates of one user, delivered in any order to a cache at 0: the cache applies each update
    that follows on it, ignores what it has seen, and resyncs (to the newest) on a gap; it always
    ends at the newest update."""
    chain = sorted(ids)
    prev_of = {s: ([0] if i == 0 else [chain[i - 1]]) for i, s in enumerate(chain)}
    cached: int | None = 0
    for stream_id in ids:
        step = next_step(cached, stream_id, prev_of[stream_id])
        if step is Step.APPLY:
            cached = stream_id
        elif step is Step.RESYNC:
            cached = max(chain[: chain.index(stream_id) + 1])  # the list as the sender has it now
        assert cached is not None and cached >= stream_id
    assert cached == max(chain)


def test_prev_ids_are_stream_ids() -> None:
    assert parse_prev_ids(None) == []
    assert parse_prev_ids([3, 4]) == [3, 4]
    for bad in ("3", [True], [-1], ["3"], list(range(101))):
        with pytest.raises(MatrixError):
            parse_prev_ids(bad)


def test_a_remote_device_list_is_checked() -> None:
    answer = {
        "user_id": "@bob:b.example",
        "stream_id": 12,
        "devices": [
            {"device_id": "P", "device_display_name": "phone",
             "keys": {"user_id": "@bob:b.example", "device_id": "P", "keys": {}}},
            {"device_id": "Q", "keys": {"user_id": "@eve:b.example", "device_id": "Q"}},
        ],
    }
    stream_id, devices = parse_user_devices("@bob:b.example", answer)
    assert stream_id == 12
    assert devices[0][:2] == ("P", "phone") and devices[0][2] is not None
    assert devices[1] == ("Q", None, None)  # keys of another user are dropped
    for bad in ({**answer, "user_id": "@eve:b.example"}, {**answer, "stream_id": "12"},
                {**answer, "devices": [{"no": "id"}]}, [answer]):
        with pytest.raises(MatrixError):
            parse_user_devices("@bob:b.example", bad)


def test_queries_split_by_server() -> None:
    local, remote = split_by_server({"@a:here": [], "@b:there": ["X"], "@c:there": []}, "here")
    assert local == {"@a:here": []}
    assert remote == {"there": {"@b:there": ["X"], "@c:there": []}}
    with pytest.raises(MatrixError):
        split_by_server({"not-a-user": []}, "here")


def cross_signing_key(usage: str, user_id: str = USER) -> tuple[dict[str, Any], Any, str]:
    key = generate_signing_key("x")
    public = encode_verify_key_base64(get_verify_key(key))
    key.version = public
    return {"user_id": user_id, "usage": [usage], "keys": {f"ed25519:{public}": public}}, key, public


def test_cross_signing_keys_are_checked() -> None:
    master, signing, public = cross_signing_key("master")
    assert check_cross_signing_key(master, USER, "master") == (master, public)
    assert public_key_of(master) == public
    for bad in ({**master, "user_id": "@other:a.example"}, {**master, "usage": ["self_signing"]},
                {**master, "keys": {}}, {**master, "keys": {f"ed25519:{public}": "other"}},
                {**master, "keys": {f"curve25519:{public}": public}}, "junk"):
        with pytest.raises(MatrixError):
            check_cross_signing_key(bad, USER, "master")


def test_a_self_signing_key_must_be_signed_by_the_master_key() -> None:
    _, master_signing, master_public = cross_signing_key("master")
    self_signing, _, _ = cross_signing_key("self_signing")
    signed = sign_json(dict(self_signing), USER, master_signing)
    assert signed_by(signed, USER, master_public, master_public)
    assert not signed_by(self_signing, USER, master_public, master_public)
    _, other_signing, other_public = cross_signing_key("master")
    assert not signed_by(signed, USER, other_public, other_public)
    tampered = {**signed, "usage": ["self_signing", "master"]}
    assert not signed_by(tampered, USER, master_public, master_public)
