"""The token-bucket rate limiter with a fake clock, and the rc_* config keys behind it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from homeserver.config import ConfigError, LoginRateLimits, RateLimit, parse_config
from homeserver.handlers.ratelimit import Ratelimiters
from storage.kernel.ratelimit import Ratelimiter, limit_exceeded, ratelimit
from storage.kernel.errors import MatrixError


def test_burst_then_refill_at_the_configured_rate() -> None:
    """Three actions fit at once; the fourth must wait for one to drain (0.5/s: 2 s)."""
    limiter = Ratelimiter(per_second=0.5, burst_count=3)
    for _ in range(3):
        assert limiter.check("ip", now=100.0).allowed
    denied = limiter.check("ip", now=100.0)
    assert not denied.allowed
    assert denied.retry_after == pytest.approx(2.0)
    assert not limiter.check("ip", now=101.9).allowed
    assert limiter.check("ip", now=102.0).allowed
    assert not limiter.check("ip", now=102.0).allowed


def test_keys_are_independent() -> None:
    limiter = Ratelimiter(per_second=1, burst_count=1)
    assert limiter.check("a", now=0).allowed
    assert not limiter.check("a", now=0).allowed
    assert limiter.check("b", now=0).allowed
    assert limiter.check(("register", None), now=0).allowed


def test_check_without_update_counts_nothing() -> None:
    limiter = Ratelimiter(per_second=1, burst_count=2)
    for _ in range(10):
        assert limiter.check("k", now=0, update=False).allowed
    assert limiter.check("k", now=0).allowed
    assert limiter.check("k", now=0).allowed
    assert not limiter.check("k", now=0, update=False).allowed


def test_denied_actions_are_not_counted() -> None:
    """Hammering while limited does not push the wait further out."""
    limiter = Ratelimiter(per_second=1, burst_count=1)
    assert limiter.check("k", now=0).allowed
    for _ in range(100):
        assert not limiter.check("k", now=0.5).allowed
    assert limiter.check("k", now=1.0).allowed


def test_record_counts_even_past_the_limit() -> None:
    """Failed logins are recorded after the fact, and each one lengthens the wait."""
    limiter = Ratelimiter(per_second=0.5, burst_count=2)
    for _ in range(4):
        limiter.record("@a:hs", now=10)
    result = limiter.check("@a:hs", now=10, update=False)
    assert not result.allowed
    assert result.retry_after == pytest.approx((4 + 1 - 2) / 0.5)


def test_clock_going_backwards_neither_refills_nor_breaks() -> None:
    limiter = Ratelimiter(per_second=1, burst_count=1)
    assert limiter.check("k", now=50).allowed
    assert not limiter.check("k", now=40).allowed
    assert limiter.check("k", now=51).allowed


def test_drained_buckets_are_forgotten() -> None:
    """Memory stays bounded by recently active keys, not every key ever seen."""
    limiter = Ratelimiter(per_second=10, burst_count=5)
    for i in range(5000):
        limiter.check(f"ip{i}", now=i)  # each bucket drains 0.1 s after its action
    assert len(limiter) < 2100


def test_invalid_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        Ratelimiter(per_second=0, burst_count=1)
    with pytest.raises(ValueError):
        Ratelimiter(per_second=1, burst_count=0)


def test_ratelimit_raises_429_with_retry_after_ms() -> None:
    limiter = Ratelimiter(per_second=0.17, burst_count=1)
    ratelimit(limiter, "k", 0)
    with pytest.raises(MatrixError) as caught:
        ratelimit(limiter, "k", 0)
    error = caught.value
    assert (error.status, error.errcode) == (429, "M_LIMIT_EXCEEDED")
    assert error.to_json()["retry_after_ms"] == 5883  # ceil(1 / 0.17 s)
    assert limit_exceeded(0.0001).to_json()["retry_after_ms"] == 1


def _parse(raw: dict[str, Any]) -> Any:
    return parse_config({"server_name": "example.org", **raw}, config_path=Path("/etc/tributary/homeserver.yaml"))


def test_rc_defaults_are_synapse_defaults() -> None:
    config = _parse({})
    assert config.rc_message == RateLimit(0.2, 10)
    assert config.rc_registration == RateLimit(0.17, 3)
    assert config.rc_login == LoginRateLimits(RateLimit(0.003, 5), RateLimit(0.003, 5), RateLimit(0.17, 3))
    assert config.rc_joins.local == RateLimit(0.1, 10) and config.rc_joins.remote == RateLimit(0.01, 10)
    assert config.rc_invites.per_room == RateLimit(0.3, 10)
    assert config.rc_invites.per_user == RateLimit(0.003, 5)
    assert config.rc_invites.per_issuer == RateLimit(0.3, 10)
    # Not a Synapse key: inbound federation invites per origin server (issue 18).
    assert config.rc_invites.per_origin == RateLimit(0.3, 20)
    assert _parse({"rc_invites": {"per_origin": {"burst_count": 3}}}).rc_invites.per_origin == RateLimit(0.3, 3)
    assert config.bcrypt_rounds == 12
    limiters = Ratelimiters.from_config(config)
    assert (limiters.login_failed_attempts.per_second, limiters.login_failed_attempts.burst_count) == (0.17, 3)


def test_rc_keys_override_one_value_at_a_time() -> None:
    config = _parse(
        {
            "rc_message": {"per_second": 5},
            "rc_login": {"address": {"burst_count": 50}},
            "rc_joins": {"remote": {"per_second": 1, "burst_count": 2}},
            "bcrypt_rounds": 4,
        }
    )
    assert config.rc_message == RateLimit(5.0, 10)
    assert config.rc_login.address == RateLimit(0.003, 50)
    assert config.rc_login.account == RateLimit(0.003, 5)
    assert config.rc_joins.remote == RateLimit(1.0, 2)
    assert config.bcrypt_rounds == 4


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"rc_message": {"per_second": 0}}, "rc_message.per_second: expected a positive number"),
        ({"rc_message": {"burst_count": 1.5}}, "rc_message.burst_count: expected an integer"),
        ({"rc_registration": {"burst": 3}}, "rc_registration.burst: unknown key"),
        ({"rc_registration": 3}, "rc_registration: expected a mapping"),
        ({"rc_login": {"per_second": 1}}, "rc_login.per_second: unknown key"),
        ({"rc_login": {"failed_attempts": {"burst_count": -1}}}, "rc_login.failed_attempts.burst_count"),
        ({"rc_joins": {"local": "fast"}}, "rc_joins.local: expected a mapping"),
        ({"rc_invites": {"per_room": {"per_second": "1"}}}, "rc_invites.per_room.per_second"),
        ({"bcrypt_rounds": 40}, "bcrypt_rounds: expected an integer 4-31"),
    ],
)
def test_rc_errors_name_the_key_path(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _parse(raw)
    assert message in str(caught.value)
