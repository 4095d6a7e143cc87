# tests: replication/config.py
"""Replication's own config types: defaults are the protocol's constants, and
what start_replication hands the sans-I/O core."""

from __future__ import annotations

from datetime import timedelta

import attrs
import pytest

from replication.config import DEFAULT_REDIS_URL, RedisConfig, ReplicationConfig, connection_config
from replication.connection import (
    KEEPALIVE_INTERVAL_SECONDS,
    MAX_OUTBOUND_BUFFER,
    PING_TIMEOUT_SECONDS,
    ConnectionConfig,
)


def test_defaults_are_the_protocol_constants() -> None:
    config = ReplicationConfig()
    assert config.keepalive_interval == timedelta(seconds=KEEPALIVE_INTERVAL_SECONDS)
    assert config.timeout == timedelta(seconds=PING_TIMEOUT_SECONDS)
    assert config.max_outbound_buffer == MAX_OUTBOUND_BUFFER
    assert config.redis == RedisConfig(enabled=False, url=DEFAULT_REDIS_URL)
    assert config.allow_unauthenticated is False


def test_connection_config_converts_durations_to_seconds() -> None:
    config = ReplicationConfig(
        keepalive_interval=timedelta(milliseconds=1500), timeout=timedelta(minutes=1), max_outbound_buffer=7
    )
    assert connection_config(config, expected_server_name="hs.example") == ConnectionConfig(
        keepalive_interval=1.5, timeout=60.0, max_outbound_buffer=7, expected_server_name="hs.example"
    )
    assert connection_config(ReplicationConfig()) == ConnectionConfig()


def test_config_is_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ReplicationConfig().redis = RedisConfig(enabled=True)  # type: ignore[misc]
