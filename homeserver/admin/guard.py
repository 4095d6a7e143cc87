"""Who may call an admin endpoint, one mechanism for every area that has them.

The admin API (homeserver/admin/servlets.py), the operator console and the media admin
endpoints (served by whichever process serves media) all wrap their handlers with an
``AdminGuard``: the caller's access token is checked, the caller is rate-limited (``rc_admin``,
before the admin check, so that a non-admin probing the API is limited too), anyone but a
server admin gets 403 ``M_FORBIDDEN``, and every call is written to the
``homeserver.admin.audit`` log with who did what to which path and the status it got.
"""

# tests: tests/integration/test_admin_api.py, tests/integration/test_media.py

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Auth, Requester
from storage.kernel.ratelimit import Ratelimiter, ratelimit
from homeserver.http.server import Handler
from storage.kernel.errors import MatrixError
from storage.stores.admin import AdminStore

audit_logger = logging.getLogger("homeserver.admin.audit")

AdminHandler = Callable[[Request, Mapping[str, str], Requester], Awaitable[tuple[int, Any]]]


def not_admin() -> MatrixError:
    return MatrixError(403, "M_FORBIDDEN", "You are not a server admin")


@attrs.define
class AdminGuard:
    """Wraps admin handlers: authenticated, rate-limited per admin, admins only, audited."""

    auth: Auth
    store: AdminStore
    limiter: Ratelimiter
    clock: Callable[[], float] = time.time

    def __call__(self, handler: AdminHandler, *, allow_self: bool = False) -> Handler:
        """``handler`` for server admins (and, with ``allow_self``, the user the path's
        ``user_id`` names)."""

        async def checked(request: Request, params: Mapping[str, str]) -> tuple[int, Any]:
            requester = await self.auth.get_user_by_req(request)
            method = request.method.decode("ascii", "replace")
            path = request.path.decode("utf-8", "replace")
            ratelimit(self.limiter, requester.user_id, self.clock())
            myself = allow_self and params.get("user_id") == requester.user_id
            if not myself and not await self.store.is_admin(requester.user_id):
                audit_logger.warning("[%s] refused (not an admin): %s %s", requester.user_id, method, path)
                raise not_admin()
            status = 500
            try:
                status, body = await handler(request, params, requester)
                return status, body
            except MatrixError as e:
                status = e.status
                raise
            finally:
                audit_logger.info("[%s] %s %s -> %d", requester.user_id, method, path, status)

        return checked
