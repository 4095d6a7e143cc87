"""homeserver/lazy_tls.py: pyOpenSSL stays out of a process until TLS is first used, and then
Twisted's TLS works as if it had always been there.

Each test runs in a fresh interpreter (this one has TLS loaded by the tests that use it):
it installs the reactor, imports what a process imports at start-up and checks that neither
pyOpenSSL nor h2 came with it, then makes a real TLS connection on loopback, with a
self-signed certificate made for the test, through one of the entry points the stand-ins
guard. The first use must load TLS (Twisted's own objects are back in place afterwards) and
the connection must carry data both ways.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol

ROOT = Path(__file__).resolve().parents[2]

# What the fresh interpreter runs: start-up as a process does it, then one first use.
CHILD = textwrap.dedent("""
    import sys
    from homeserver.reactor import install_reactor
    reactor = install_reactor()
    import homeserver.app, homeserver.cli
    assert "OpenSSL" not in sys.modules, "pyOpenSSL was imported at start-up"
    assert "h2" not in sys.modules, "h2 was imported at start-up"
    from tests.unit.test_lazy_tls import first_tls_use
    print(first_tls_use(reactor, sys.argv[1]))
""")


@pytest.mark.parametrize("entry_point", ["listenSSL and wrapClientTLS", "startTLS", "Agent over HTTPS"])
def test_tls_is_loaded_on_first_use_not_at_start_up(entry_point: str) -> None:
    result = subprocess.run([sys.executable, "-c", CHILD, entry_point], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.stdout.strip() == "PING", result.stdout + result.stderr


def first_tls_use(reactor: Any, entry_point: str) -> str:
    """In the fresh interpreter: what a TLS connection through ``entry_point`` carried back
    (a traceback if it failed), having checked that it, and nothing before it, loaded TLS."""
    outcome: list[str] = []

    async def main() -> None:
        try:
            exchange = Deferred.fromCoroutine(_exchange(reactor, entry_point))
            outcome.append(await exchange.addTimeout(10, reactor))
        except BaseException:
            import traceback

            outcome.append(traceback.format_exc())
        finally:
            reactor.stop()

    reactor.callWhenRunning(lambda: Deferred.fromCoroutine(main()))
    reactor.run(installSignalHandlers=False)
    return outcome[0]


def _twisted_tls_is_loaded() -> bool:
    """Whether Twisted's own TLS objects are where it would have put them with pyOpenSSL."""
    from twisted.internet import _newtls, posixbase, tcp
    from twisted.protocols import tls

    connection_mixin: Any = tcp._TLSConnectionMixin
    return posixbase.tls is tls and connection_mixin.startTLS is _newtls.ConnectionMixin.startTLS


async def _exchange(reactor: Any, entry_point: str) -> str:
    from twisted.internet.ssl import Certificate, optionsForClientTLS

    from homeserver.keys import ensure_self_signed_certificate, load_tls_options

    with tempfile.TemporaryDirectory() as directory:
        cert_path, key_path = Path(directory, "tls.crt"), Path(directory, "tls.key")
        ensure_self_signed_certificate(cert_path, key_path, "localhost")
        server_options = load_tls_options(cert_path, key_path)
        trust = Certificate.loadPEM(cert_path.read_bytes())
    client_options = optionsForClientTLS("localhost", trustRoot=trust)
    # Importing twisted.internet.ssl imported pyOpenSSL, but Twisted still runs on stand-ins.
    assert not _twisted_tls_is_loaded(), "TLS was loaded before its first use"

    if entry_point == "listenSSL and wrapClientTLS":  # a TLS listener, outbound federation
        from twisted.internet.endpoints import wrapClientTLS

        port = reactor.listenSSL(0, Factory.forProtocol(_Upper), server_options, interface="127.0.0.1")
        assert _twisted_tls_is_loaded(), "listenSSL did not load TLS"
        endpoint = wrapClientTLS(client_options, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port))
        client = await endpoint.connect(Factory.forProtocol(_Ping))
    elif entry_point == "startTLS":  # TLS begun on a connection that started in plain TCP
        port = reactor.listenTCP(0, Factory.forProtocol(lambda: _Upper(server_options)), interface="127.0.0.1")
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        client = await endpoint.connect(Factory.forProtocol(lambda: _Ping(client_options)))
        assert _twisted_tls_is_loaded(), "startTLS did not load TLS"
    elif entry_point == "Agent over HTTPS":  # Twisted's HTTP client, its default TLS policy
        from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, readBody
        from twisted.web.resource import Resource
        from twisted.web.server import Site

        policy = BrowserLikePolicyForHTTPS(trustRoot=trust)
        policy.creatorForNetloc(b"localhost", 443)
        assert _twisted_tls_is_loaded(), "BrowserLikePolicyForHTTPS did not load TLS"

        class Echo(Resource):
            isLeaf = True

            def render_GET(self, request: Any) -> bytes:
                return b"PING" if request.isSecure() else b"not over TLS"

        port = reactor.listenSSL(0, Site(Echo()), server_options, interface="127.0.0.1")
        response = await Agent(reactor, contextFactory=policy).request(
            b"GET", f"https://localhost:{port.getHost().port}/".encode())
        body: bytes = await readBody(response)
        await port.stopListening()
        return body.decode()
    else:
        raise ValueError(f"no such entry point: {entry_point!r}")
    try:
        return (await client.answer).decode()
    finally:
        client.transport.loseConnection()
        await port.stopListening()


class _Upper(Protocol):
    """The server: answers what it receives in capitals, after starting TLS if given options."""

    def __init__(self, tls_options: Any = None) -> None:
        self._tls_options = tls_options

    def connectionMade(self) -> None:
        if self._tls_options is not None:
            self.transport.startTLS(self._tls_options)  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        self.transport.write(data.upper())  # type: ignore[union-attr]


class _Ping(Protocol):
    """The client: sends "ping" (over TLS, started here if given options); ``answer`` fires
    with the reply."""

    def __init__(self, tls_options: Any = None) -> None:
        self._tls_options = tls_options
        self.answer: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        if self._tls_options is not None:
            self.transport.startTLS(self._tls_options)  # type: ignore[attr-defined]
        self.transport.write(b"ping")  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        if not self.answer.called:
            self.answer.callback(data)
