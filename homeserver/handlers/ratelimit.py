"""The configured rate limits: one ``Ratelimiter`` (storage/kernel/ratelimit.py) per ``rc_*`` key."""

# tests: tests/unit/handlers/test_ratelimit.py

from __future__ import annotations

import attrs

from homeserver.config import HomeserverConfig
from storage.kernel.ratelimit import Ratelimiter


@attrs.frozen
class Ratelimiters:
    """One limiter per configured rate limit; handlers take the ones they need."""

    registration: Ratelimiter
    login_address: Ratelimiter
    login_account: Ratelimiter
    login_failed_attempts: Ratelimiter
    message: Ratelimiter
    joins_local: Ratelimiter
    joins_remote: Ratelimiter
    invites_per_room: Ratelimiter
    invites_per_user: Ratelimiter
    invites_per_issuer: Ratelimiter

    @classmethod
    def from_config(cls, config: HomeserverConfig) -> Ratelimiters:
        make = Ratelimiter.from_config
        return cls(
            registration=make(config.rc_registration),
            login_address=make(config.rc_login.address),
            login_account=make(config.rc_login.account),
            login_failed_attempts=make(config.rc_login.failed_attempts),
            message=make(config.rc_message),
            joins_local=make(config.rc_joins.local),
            joins_remote=make(config.rc_joins.remote),
            invites_per_room=make(config.rc_invites.per_room),
            invites_per_user=make(config.rc_invites.per_user),
            invites_per_issuer=make(config.rc_invites.per_issuer),
        )
