"""Client-server API servlets that need no handler state yet: /versions."""

# tests: tests/integration/test_process.py

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from twisted.web.server import Request

from homeserver.http.server import Routes

CLIENT_PREFIX: Final = "/_matrix/client"

# The client-server spec versions this server speaks.
SUPPORTED_SPEC_VERSIONS: Final = (
    "r0.0.1", "r0.1.0", "r0.2.0", "r0.3.0", "r0.4.0", "r0.5.0", "r0.6.0", "r0.6.1",
    "v1.1", "v1.2", "v1.3", "v1.4", "v1.5", "v1.6", "v1.7", "v1.8", "v1.9", "v1.10", "v1.11",
)

# MSC flags clients look for: simplified sliding sync (MSC4186, docs/client-api.md "Sliding sync").
UNSTABLE_FEATURES: Final = {"org.matrix.simplified_msc3575": True}


async def _versions(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
    return 200, {"versions": list(SUPPORTED_SPEC_VERSIONS), "unstable_features": dict(UNSTABLE_FEATURES)}


def register_versions(router: Routes) -> None:
    router.register(["GET"], rf"{CLIENT_PREFIX}/versions/?", _versions, "client_versions")
