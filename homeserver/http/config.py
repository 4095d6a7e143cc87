"""The connection limits of an HTTP listener, as the config file gives them.

Owned by the HTTP package (``homeserver/http/limits.py`` enforces them); ``homeserver/config.py``
reads them from ``listeners[i].connection_limits``. No Twisted here, so loading the config does not
import the web stack.
"""

# tests: tests/unit/test_config.py

from __future__ import annotations

from datetime import timedelta
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network

import attrs


@attrs.frozen
class ConnectionLimitsConfig:
    """Bounds on what one HTTP connection, and one client address, may hold open.

    ``header_timeout``: a request's line and headers must be complete this long after the
    connection opened (its first request) or after the request's first byte (later ones).
    ``body_timeout``: the longest wait for more body bytes (an inactivity bound, so a large
    upload that keeps sending is never cut). ``idle_timeout``: how long a keep-alive connection
    may wait for its next request. None of them runs while a request is being answered.
    ``max_connections_per_ip``: open connections one address may hold (0: no cap), except
    addresses in ``exempt_ranges`` (by default loopback, where a reverse proxy on the same
    machine connects from; a proxy elsewhere must be listed).
    """

    header_timeout: timedelta = timedelta(seconds=30)
    body_timeout: timedelta = timedelta(seconds=60)
    idle_timeout: timedelta = timedelta(seconds=75)
    max_connections_per_ip: int = 100
    exempt_ranges: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    _networks: tuple[IPv4Network | IPv6Network, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_networks", tuple(ip_network(r, strict=False) for r in self.exempt_ranges))

    def is_capped(self, host: str) -> bool:
        """Whether connections from ``host`` count against ``max_connections_per_ip``."""
        if self.max_connections_per_ip == 0:
            return False
        try:
            address = ip_address(host)
        except ValueError:  # not an IP peer (a Unix socket): nothing to count by
            return False
        return not any(address in network for network in self._networks)
