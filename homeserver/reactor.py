"""Install Twisted's asyncio reactor on a uvloop event loop.

``install_reactor()`` must be called by an entry point before anything imports
``twisted.internet.reactor`` (``prometheus_client.twisted`` does, for one), so this
module imports nothing from Twisted at module level. It installs the reactor inside
``homeserver/lazy_tls.py``'s ``twisted_imported_without_tls()``, which keeps pyOpenSSL
out of the process until TLS is first used; what that patches of Twisted, and why,
is said there. This module knows nothing of TLS itself.
"""

# tests: tests/unit/test_reactor.py, tests/unit/test_lazy_tls.py

from __future__ import annotations

import asyncio
import sys
from typing import Any

from homeserver.lazy_tls import twisted_imported_without_tls


class ReactorAlreadyInstalled(RuntimeError):
    """Another reactor was installed before ours could be."""


def install_reactor() -> Any:
    """Install the asyncio reactor on uvloop and return it; idempotent.

    Returns the reactor object. Raises ReactorAlreadyInstalled when some import
    already installed a different reactor, which would silently cost the
    uvloop speed-up.
    """
    if "twisted.internet.reactor" in sys.modules:
        from twisted.internet import reactor
        from twisted.internet.asyncioreactor import AsyncioSelectorReactor

        if isinstance(reactor, AsyncioSelectorReactor):
            return reactor
        raise ReactorAlreadyInstalled(
            f"a {type(reactor).__name__} was installed before the asyncio reactor; "
            "install_reactor() must run before anything imports twisted.internet.reactor"
        )

    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    with twisted_imported_without_tls():
        from twisted.internet import asyncioreactor

        asyncioreactor.install(loop)
    from twisted.internet import reactor

    return reactor
