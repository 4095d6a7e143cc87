"""The decisions of end-to-end key handling, as pure functions: no store, no network, no clock.

- ``check_device_keys``: whether an uploaded ``device_keys`` object may be stored
  for (user, device): its IDs, its algorithms and keys, and its self-signature
  by the device's own ed25519 key (signedjson).
- ``next_step``: what to do with an ``m.device_list_update`` given the stream ID
  this server last applied for the user: apply it, ignore it (already seen), or
  resync the whole list because an update in between was missed.
- ``parse_user_devices``: a remote ``GET /user/devices/{userId}`` answer, checked.
- ``split_by_server``: a ``/keys/query`` or ``/keys/claim`` body split into this
  server's users and each other server's.

What it does not know: where keys are stored, or how other servers are asked.
"""

# tests: tests/unit/handlers/test_e2e_rules.py

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeVar

from signedjson.key import decode_verify_key_base64
from signedjson.sign import SignatureVerifyException, verify_signed_json

from homeserver.events.identifiers import is_valid_user_id, server_name_of
from homeserver.events.validation import is_storable_text
from storage.kernel.errors import bad_json, invalid_param

MAX_ID_LENGTH: Final = 255
MAX_ALGORITHMS: Final = 32
MAX_KEYS: Final = 64
MAX_DEVICES_PER_USER: Final = 1000

T = TypeVar("T")


def _short_text(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH and is_storable_text(value)


def check_device_keys(keys: object, user_id: str, device_id: str) -> dict[str, Any]:
    """``keys`` when it is a valid ``DeviceKeys`` object of (user_id, device_id), signed by the
    device's ed25519 key; else a 400 naming what is wrong."""
    if not isinstance(keys, dict):
        raise bad_json("'device_keys' must be an object")
    if keys.get("user_id") != user_id or keys.get("device_id") != device_id:
        raise invalid_param("device_keys must be for the requesting user and device")
    algorithms = keys.get("algorithms")
    if (not isinstance(algorithms, list) or not algorithms or len(algorithms) > MAX_ALGORITHMS
            or not all(_short_text(a) for a in algorithms)):
        raise bad_json("'device_keys.algorithms' must be a non-empty list of algorithm names")
    public = keys.get("keys")
    if not isinstance(public, dict) or not public or len(public) > MAX_KEYS:
        raise bad_json("'device_keys.keys' must be an object of '<algorithm>:<device_id>' -> key")
    for key_id, key in public.items():
        algorithm, sep, key_device = key_id.partition(":")
        if not sep or not algorithm or key_device != device_id or not _short_text(key):
            raise bad_json(f"'device_keys.keys' entry {key_id[:100]!r} must be '<algorithm>:{device_id}' -> key")
    ed25519 = public.get(f"ed25519:{device_id}")
    if ed25519 is None:
        raise bad_json(f"'device_keys.keys' must hold the device's signing key 'ed25519:{device_id}'")
    signatures = keys.get("signatures")
    if not isinstance(signatures, dict) or not isinstance(signatures.get(user_id), dict):
        raise bad_json("'device_keys.signatures' must hold the user's signatures")
    try:
        verify_key = decode_verify_key_base64("ed25519", device_id, ed25519)
        verify_signed_json(keys, user_id, verify_key)
    except (SignatureVerifyException, ValueError, TypeError, KeyError) as e:
        raise invalid_param(f"device_keys are not signed by the device's ed25519 key: {str(e)[:200]}") from None
    return keys


class Step(enum.Enum):
    APPLY = "apply"
    IGNORE = "ignore"
    RESYNC = "resync"


def next_step(cached: int | None, stream_id: int, prev_ids: Iterable[int]) -> Step:
    """What an ``m.device_list_update`` at ``stream_id`` after ``prev_ids`` does to a cache at
    ``cached`` (None: this server holds no list for the user).

    The cache holds the list as of ``cached``; an update is the user's next change after each of
    its ``prev_ids``, so it follows on the cache when none of them is newer than ``cached``. An
    update at or before ``cached`` was seen (or was in a resync). A user never cached, or an update
    whose predecessor was never seen, needs the whole list."""
    if cached is None:
        return Step.RESYNC
    if stream_id <= cached:
        return Step.IGNORE
    prev = list(prev_ids)
    if not prev or any(p > cached for p in prev):
        return Step.RESYNC
    return Step.APPLY


def parse_prev_ids(value: object) -> list[int]:
    """``prev_id`` of an ``m.device_list_update``: a list of stream IDs (at most 100)."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > 100 or not all(_stream_id(v) for v in value):
        raise bad_json("'prev_id' must be a list of stream IDs")
    return [int(v) for v in value]


def _stream_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def parse_stream_id(value: object, what: str = "stream_id") -> int:
    if not _stream_id(value):
        raise bad_json(f"'{what}' must be a non-negative integer")
    assert isinstance(value, int)
    return value


def parse_user_devices(user_id: str, answer: object) -> tuple[int, list[tuple[str, str | None, dict[str, Any] | None]]]:
    """A ``/user/devices/{userId}`` answer: (stream_id, [(device_id, display name, keys)]).
    Devices with a malformed ID are refused; keys for another user or device are dropped."""
    if not isinstance(answer, dict) or answer.get("user_id") != user_id:
        raise bad_json(f"the answer is not {user_id}'s device list")
    stream_id = parse_stream_id(answer.get("stream_id"))
    devices = answer.get("devices")
    if not isinstance(devices, list) or len(devices) > MAX_DEVICES_PER_USER:
        raise bad_json("'devices' must be a list")
    out: list[tuple[str, str | None, dict[str, Any] | None]] = []
    for device in devices:
        if not isinstance(device, dict) or not _short_text(device.get("device_id")):
            raise bad_json("each device needs a 'device_id'")
        device_id = str(device["device_id"])
        name = device.get("device_display_name")
        keys = device.get("keys")
        if not isinstance(keys, dict) or keys.get("user_id") != user_id or keys.get("device_id") != device_id:
            keys = None
        out.append((device_id, name if isinstance(name, str) and len(name) <= 1000 else None, keys))
    return stream_id, out


def split_by_server(wanted: Mapping[str, T], local_server: str) -> tuple[dict[str, T], dict[str, dict[str, T]]]:
    """``wanted`` (user ID -> anything) as (this server's users, server -> that server's users).
    A key that is not a user ID is a 400."""
    local: dict[str, T] = {}
    remote: dict[str, dict[str, T]] = {}
    for user_id, value in wanted.items():
        if not is_valid_user_id(user_id):
            raise invalid_param(f"not a user ID: {user_id[:100]!r}")
        server = server_name_of(user_id)
        if server == local_server:
            local[user_id] = value
        else:
            remote.setdefault(server, {})[user_id] = value
    return local, remote


CROSS_SIGNING_USAGES: Final = ("master", "self_signing", "user_signing")


def check_cross_signing_key(key: object, user_id: str, usage: str) -> tuple[dict[str, Any], str]:
    """A ``CrossSigningKey`` of ``user_id`` for ``usage``: (the key, its ed25519 public key)."""
    what = f"{usage}_key"
    if not isinstance(key, dict):
        raise bad_json(f"'{what}' must be an object")
    if key.get("user_id") != user_id:
        raise invalid_param(f"'{what}' must be for {user_id}")
    usages = key.get("usage")
    if not isinstance(usages, list) or usage not in usages or not all(_short_text(u) for u in usages):
        raise invalid_param(f"'{what}.usage' must list {usage!r}")
    public = key.get("keys")
    if not isinstance(public, dict) or len(public) != 1:
        raise bad_json(f"'{what}.keys' must hold exactly one key")
    ((key_id, value),) = public.items()
    algorithm, _, name = key_id.partition(":")
    if algorithm != "ed25519" or not _short_text(value) or name != value:
        raise invalid_param(f"'{what}.keys' must be 'ed25519:<public key>' -> the same public key")
    if "signatures" in key and not isinstance(key["signatures"], dict):
        raise bad_json(f"'{what}.signatures' must be an object")
    return key, str(value)


def signed_by(obj: Mapping[str, Any], signer: str, key_name: str, public_key: str) -> bool:
    """Whether ``obj`` carries a valid signature of ``signer`` by ed25519 key ``key_name`` (a device
    ID or a public key) with public key ``public_key``."""
    try:
        verify_signed_json(dict(obj), signer, decode_verify_key_base64("ed25519", key_name, public_key))
    except (SignatureVerifyException, ValueError, TypeError, KeyError):
        return False
    return True


def public_key_of(key_json: Mapping[str, Any]) -> str | None:
    """The ed25519 public key of a stored cross-signing key."""
    keys = key_json.get("keys")
    if isinstance(keys, dict):
        for key_id, value in keys.items():
            if isinstance(key_id, str) and key_id.startswith("ed25519:") and isinstance(value, str):
                return value
    return None
