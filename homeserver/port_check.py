"""Before anything else starts: can every listener of this process bind its address?

``tributary run`` and ``tributary worker`` call ``first_taken`` before they open the
database, start the embedded PostgreSQL or write a key, so a second instance on taken
ports fails in one line and changes nothing. The probe binds each address the way
Twisted's ``listenTCP`` will (``SO_REUSEADDR``, so a port in TIME_WAIT after a restart
is not "taken"), then closes the socket at once. It knows nothing of what the
listeners serve.
"""

# tests: tests/unit/test_port_check.py, tests/integration/test_ops_process.py

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from ipaddress import ip_address

import attrs

from homeserver.config import ListenerConfig


@attrs.frozen
class TakenAddress:
    address: str
    port: int
    # Where the config names it, e.g. "listeners[1] (metrics)".
    where: str
    reason: str

    def describe(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} ({self.where}) {self.reason}"


def probe(address: str, port: int) -> str | None:
    """None when ``address:port`` can be bound now; else why not, in a few words."""
    family = socket.AF_INET6 if ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
            sock.listen(1)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "is already in use"
            if e.errno == errno.EACCES:
                return "needs privileges this process does not have"
            if e.errno == errno.EADDRNOTAVAIL:
                return "is not an address of this machine"
            return f"cannot be bound: {e.strerror or e}"
    return None


def first_taken(listeners: Sequence[ListenerConfig], *, prefix: str = "listeners") -> TakenAddress | None:
    """The first address of ``listeners`` that cannot be bound, or None when all can."""
    for i, listener in enumerate(listeners):
        for address in listener.bind_addresses:
            reason = probe(address, listener.port)
            if reason is not None:
                return TakenAddress(address, listener.port, f"{prefix}[{i}], {listener.type}", reason)
    return None
