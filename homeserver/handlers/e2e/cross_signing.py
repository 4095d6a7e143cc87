"""Cross-signing: a user's master, self-signing and user-signing keys, and the signatures they make.

``POST /keys/device_signing/upload`` (behind user-interactive auth, the
servlet's business) stores a user's keys: the self-signing and user-signing keys
must be signed by the master key (uploaded with them or stored already). ``POST
/keys/signatures/upload`` stores signatures: of the user's own devices by their
self-signing key, of the user's master key by one of their devices, of another
user's master key by the user's user-signing key; each is checked with
signedjson, and the ones that fail are reported per key in ``failures``.

``/keys/query`` shows each user's master and self-signing keys and, to the user
alone, the user-signing key; signatures join the keys they sign (a user-signing
signature of another's master key only for its signer, as the spec asks). A
change of a local user's keys is a device-list change (``E2eHandler``) and an
``m.signing_key_update`` EDU; other servers' keys come with their answers to
key queries, their device lists, and their ``m.signing_key_update`` EDUs.
"""

# tests: tests/integration/test_client_e2e.py, tests/unit/handlers/test_e2e_rules.py

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.e2e.e2e_rules import check_cross_signing_key, public_key_of, signed_by
from storage.kernel.errors import MatrixError, bad_json, invalid_param
from storage.stores.e2e import CrossSigningStore, E2eStore, SignatureRow

MAX_SIGNATURE_UPLOADS = 100

KEY_FIELDS = {"master": "master_key", "self_signing": "self_signing_key", "user_signing": "user_signing_key"}
QUERY_FIELDS = {"master": "master_keys", "self_signing": "self_signing_keys", "user_signing": "user_signing_keys"}


def invalid_signature(error: str) -> MatrixError:
    return MatrixError(400, "M_INVALID_SIGNATURE", error)


# (user_id, devices whose keys gained signatures, public keys that changed or gained signatures,
#  the m.signing_key_update content for other servers or None)
KeysChanged = Callable[[str, list[str], list[str], Mapping[str, Any] | None], Awaitable[None]]


class CrossSigningHandler:
    def __init__(self, *, store: CrossSigningStore, e2e_store: E2eStore, keys_changed: KeysChanged) -> None:
        self._store = store
        self._e2e_store = e2e_store
        self._keys_changed = keys_changed

    async def has_master_key(self, user_id: str) -> bool:
        return "master" in (await self._store.get_keys([user_id])).get(user_id, {})

    async def upload_signing_keys(self, requester: Requester, body: Mapping[str, Any]) -> dict[str, Any]:
        user_id = requester.user_id
        existing = (await self._store.get_keys([user_id])).get(user_id, {})
        new: dict[str, dict[str, Any]] = {}
        master_public = None
        if body.get("master_key") is not None:
            new["master"], master_public = check_cross_signing_key(body["master_key"], user_id, "master")
        elif "master" in existing:
            master_public = public_key_of(json.loads(existing["master"]))
        for usage in ("self_signing", "user_signing"):
            key = body.get(KEY_FIELDS[usage])
            if key is None:
                continue
            if master_public is None:
                raise MatrixError(400, "M_MISSING_PARAM", "A master key is needed first")
            checked, _ = check_cross_signing_key(key, user_id, usage)
            if not signed_by(checked, user_id, master_public, master_public):
                raise invalid_signature(f"'{KEY_FIELDS[usage]}' is not signed by the master key")
            new[usage] = checked
        if not new:
            return {}
        await self._store.set_keys(user_id, {usage: json.dumps(key) for usage, key in new.items()})
        publics = [p for key in new.values() if (p := public_key_of(key)) is not None]
        # Other servers learn of the keys they may see: master and self-signing.
        update = {KEY_FIELDS[u]: new[u] for u in ("master", "self_signing") if u in new}
        await self._keys_changed(user_id, [], publics, {"user_id": user_id, **update} if update else None)
        return {}

    async def upload_signatures(self, requester: Requester, body: Mapping[str, Any]) -> dict[str, Any]:
        if len(body) > MAX_SIGNATURE_UPLOADS:
            raise bad_json(f"at most {MAX_SIGNATURE_UPLOADS} users per upload")
        signer = requester.user_id
        own = (await self._store.get_keys([signer])).get(signer, {})
        own_public = {usage: public_key_of(json.loads(key)) for usage, key in own.items()}
        failures: dict[str, dict[str, Any]] = {}
        rows: list[SignatureRow] = []
        changed_devices: list[str] = []
        changed_keys: list[str] = []
        for target_user, objects in body.items():
            if not isinstance(objects, dict) or len(objects) > MAX_SIGNATURE_UPLOADS:
                raise bad_json("each user's entry must be an object of key ID -> signed object")
            target_keys = (await self._store.get_keys([target_user])).get(target_user, {})
            target_master = public_key_of(json.loads(target_keys["master"])) if "master" in target_keys else None
            for key_id, signed in objects.items():
                try:
                    if not isinstance(signed, dict) or not isinstance(signed.get("signatures"), dict):
                        raise bad_json("a signed object must carry 'signatures'")
                    sigs = signed["signatures"].get(signer)
                    if not isinstance(sigs, dict):
                        raise invalid_signature(f"no signature of {signer}")
                    if target_user == signer and key_id == own_public.get("master"):
                        row = await self._master_by_device(signer, key_id, signed, sigs)
                        changed_keys.append(key_id)
                    elif target_user == signer:
                        row = await self._device_by_self_signing(signer, key_id, signed, sigs, own_public)
                        changed_devices.append(key_id)
                    elif key_id == target_master and own_public.get("user_signing"):
                        row = _signature(signed, sigs, signer, str(own_public["user_signing"]), target_user, key_id)
                        changed_keys.append(key_id)
                    else:
                        raise invalid_param(f"{key_id[:100]!r} is not a key of {target_user[:255]} that can be signed")
                    rows.append(row)
                except MatrixError as e:
                    failures.setdefault(target_user, {})[key_id] = e.to_json()
        await self._store.add_signatures(rows)
        if changed_devices or changed_keys:
            await self._keys_changed(signer, changed_devices, changed_keys, None)
        return {"failures": failures}

    async def _master_by_device(self, user_id: str, master: str, signed: Mapping[str, Any],
                                sigs: Mapping[str, Any]) -> SignatureRow:
        for signing_key_id in sigs:
            device_id = signing_key_id.partition(":")[2]
            key_json = await self._e2e_store.get_device_key_json(user_id, device_id) if device_id else None
            device_public = json.loads(key_json).get("keys", {}).get(f"ed25519:{device_id}") if key_json else None
            if isinstance(device_public, str) and signed_by(signed, user_id, device_id, device_public):
                return SignatureRow(user_id, signing_key_id, user_id, master, str(sigs[signing_key_id]))
        raise invalid_signature("the master key is not signed by one of the user's devices")

    async def _device_by_self_signing(self, user_id: str, device_id: str, signed: Mapping[str, Any],
                                      sigs: Mapping[str, Any], own_public: Mapping[str, str | None]) -> SignatureRow:
        self_signing = own_public.get("self_signing")
        if self_signing is None:
            raise invalid_signature("upload a self-signing key first")
        stored = await self._e2e_store.get_device_key_json(user_id, device_id)
        if stored is None:
            raise MatrixError(404, "M_NOT_FOUND", f"no keys for device {device_id[:255]}")
        if json.loads(stored).get("keys") != signed.get("keys"):
            raise invalid_signature("the signed keys are not the device's keys")
        return _signature(signed, sigs, user_id, self_signing, user_id, device_id)

    async def keys_for_query(self, requester_id: str, users: Collection[str]) -> dict[str, dict[str, Any]]:
        """``master_keys``, ``self_signing_keys`` and (the requester's own) ``user_signing_keys`` of
        ``users``, with the signatures the requester may see."""
        keys = await self._store.get_keys(users)
        signatures = await self._store.get_signatures(list(keys))
        out: dict[str, dict[str, Any]] = {field: {} for field in QUERY_FIELDS.values()}
        for user_id, by_type in keys.items():
            for usage, key_json in by_type.items():
                if usage == "user_signing" and user_id != requester_id:
                    continue
                key = json.loads(key_json)
                public = public_key_of(key)
                add_signatures(key, [s for s in signatures if s.target_user_id == user_id and s.target_key_id == public
                                     and s.signer_user_id in (user_id, requester_id)])
                out[QUERY_FIELDS[usage]][user_id] = key
        return out

    async def device_signatures(self, device_keys: Mapping[str, dict[str, Any]]) -> None:
        """Add each user's self-signing signatures to its devices' keys (``/keys/query`` answers)."""
        for row in await self._store.get_signatures(list(device_keys)):
            device = device_keys.get(row.target_user_id, {}).get(row.target_key_id)
            if isinstance(device, dict) and row.signer_user_id == row.target_user_id:
                add_signatures(device, [row])

    async def cache_remote(self, user_id: str, master: object, self_signing: object) -> None:
        """A remote user's master and self-signing keys, from its server (kept when valid)."""
        keys: dict[str, str] = {}
        for usage, key in (("master", master), ("self_signing", self_signing)):
            if key is None:
                continue
            try:
                checked, _ = check_cross_signing_key(key, user_id, usage)
            except MatrixError:
                continue
            keys[usage] = json.dumps(checked)
        if keys:
            await self._store.set_keys(user_id, keys)


def _signature(signed: Mapping[str, Any], sigs: Mapping[str, Any], signer: str, public: str, target_user: str,
               target_key: str) -> SignatureRow:
    key_id = f"ed25519:{public}"
    if key_id not in sigs or not signed_by(signed, signer, public, public):
        raise invalid_signature(f"not signed by {key_id}")
    return SignatureRow(signer, key_id, target_user, target_key, str(sigs[key_id]))


def add_signatures(obj: dict[str, Any], rows: Collection[SignatureRow]) -> None:
    if not rows:
        return
    signatures = obj.setdefault("signatures", {})
    for row in rows:
        signatures.setdefault(row.signer_user_id, {})[row.signing_key_id] = row.signature
