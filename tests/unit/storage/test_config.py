# tests: storage/config.py
"""Storage's own config types: the ``database`` section's shape and defaults."""

from __future__ import annotations

import attrs
import pytest

from storage.config import EMBEDDED_BINARIES, DatabaseConfig, EmbeddedDatabaseConfig


def test_defaults_use_the_embedded_database_from_the_wheel() -> None:
    config = DatabaseConfig()
    assert config.url is None
    assert (config.min_connections, config.max_connections) == (1, 10)
    assert config.embedded == EmbeddedDatabaseConfig(binaries="wheel")


def test_embedded_binaries_must_be_a_known_source() -> None:
    for source in EMBEDDED_BINARIES:
        assert EmbeddedDatabaseConfig(binaries=source).binaries == source
    with pytest.raises(ValueError, match="binaries"):
        EmbeddedDatabaseConfig(binaries="docker")


def test_config_is_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        DatabaseConfig().url = "postgresql://x/y"  # type: ignore[misc]
