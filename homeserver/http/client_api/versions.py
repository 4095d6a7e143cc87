"""GET /_matrix/client/versions: the client-server spec versions and unstable features this
server speaks. It needs no access token and no handler state."""

# tests: tests/integration/test_process.py, tests/integration/test_client_fuzz.py

from __future__ import annotations

from typing import Final

from homeserver.http.routes import Call, Caller, Response, route

CLIENT_PREFIX: Final = "/_matrix/client"

# The client-server spec versions this server speaks.
SUPPORTED_SPEC_VERSIONS: Final = (
    "r0.0.1", "r0.1.0", "r0.2.0", "r0.3.0", "r0.4.0", "r0.5.0", "r0.6.0", "r0.6.1",
    "v1.1", "v1.2", "v1.3", "v1.4", "v1.5", "v1.6", "v1.7", "v1.8", "v1.9", "v1.10", "v1.11",
)

# MSC flags clients look for: simplified sliding sync (MSC4186, docs/client-api.md "Sliding sync").
UNSTABLE_FEATURES: Final = {"org.matrix.simplified_msc3575": True}


class VersionsServlet:
    @route("GET", rf"{CLIENT_PREFIX}/versions/?", "client_versions", caller=Caller.NONE)
    async def get_versions(self, call: Call) -> Response:
        return 200, {"versions": list(SUPPORTED_SPEC_VERSIONS), "unstable_features": dict(UNSTABLE_FEATURES)}
