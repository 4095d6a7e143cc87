"""What the server tells clients about itself: capabilities and client discovery.

Pure functions of the config: ``capabilities`` for ``GET /capabilities`` and
``client_well_known`` for ``GET /.well-known/matrix/client`` and the
``well_known`` field of a login response (None when no ``public_baseurl`` is
configured, since then the server does not know its public address).
"""

# tests: tests/unit/handlers/test_push_rules.py

from __future__ import annotations

from typing import Any, Final

from homeserver.config import HomeserverConfig
from homeserver.events import ALL_ROOM_VERSIONS

STABLE_ROOM_VERSIONS: Final = tuple(v.identifier for v in ALL_ROOM_VERSIONS)
"""Every room version we implement; the spec marks all of 1-12 stable."""


def capabilities(config: HomeserverConfig) -> dict[str, Any]:
    return {
        "m.change_password": {"enabled": True},
        "m.room_versions": {
            "default": config.default_room_version,
            "available": {version: "stable" for version in STABLE_ROOM_VERSIONS},
        },
        "m.set_displayname": {"enabled": True},
        "m.set_avatar_url": {"enabled": True},
        "m.3pid_changes": {"enabled": False},
        "m.get_login_token": {"enabled": False},
    }


def client_well_known(config: HomeserverConfig) -> dict[str, Any] | None:
    if config.public_baseurl is None:
        return None
    return {"m.homeserver": {"base_url": config.public_baseurl.rstrip("/")}}
