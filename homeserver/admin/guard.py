"""Who may call an admin endpoint, one mechanism for every area that has them.

The admin API (homeserver/admin/servlets.py), the operator console and the media admin
endpoints (served by whichever process serves media) declare their routes ``Caller.ADMIN``
(homeserver/http/routes.py), and the ``Gate`` of the router they are on checks them with an
``AdminGuard``: the gate checks the caller's access token, then the guard rate-limits the
caller (``rc_admin``, before the admin check, so that a non-admin probing the API is limited
too) and answers anyone but a server admin 403 ``M_FORBIDDEN``, and every call is written to
the ``homeserver.admin.audit`` log with who did what to which path and the status it got.
"""

# tests: tests/integration/test_admin_api.py, tests/integration/test_media.py

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import attrs
from twisted.web.server import Request

from homeserver.handlers.accounts.auth import Requester
from storage.kernel.errors import MatrixError
from storage.kernel.ratelimit import Ratelimiter, ratelimit
from storage.stores.admin import AdminStore

audit_logger = logging.getLogger("homeserver.admin.audit")


def not_admin() -> MatrixError:
    return MatrixError(403, "M_FORBIDDEN", "You are not a server admin")


def _described(request: Request) -> tuple[str, str]:
    return request.method.decode("ascii", "replace"), request.path.decode("utf-8", "replace")


@attrs.define
class AdminGuard:
    """The gate's ``AdminCheck``: rate-limited per admin, admins only, audited."""

    store: AdminStore
    limiter: Ratelimiter
    clock: Callable[[], float] = time.time

    async def check(self, request: Request, requester: Requester, params: Mapping[str, str], *,
                    allow_self: bool) -> None:
        """Refuse anyone but a server admin (and, with ``allow_self``, the user the path's
        ``user_id`` names), after counting the call against their ``rc_admin`` budget."""
        ratelimit(self.limiter, requester.user_id, self.clock())
        myself = allow_self and params.get("user_id") == requester.user_id
        if not myself and not await self.store.is_admin(requester.user_id):
            audit_logger.warning("[%s] refused (not an admin): %s %s", requester.user_id, *_described(request))
            raise not_admin()

    def audit(self, request: Request, requester: Requester, status: int) -> None:
        audit_logger.info("[%s] %s %s -> %d", requester.user_id, *_described(request), status)
