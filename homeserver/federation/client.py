"""The outbound federation client: resolve a server name, connect over TLS, sign, send.

Server-name resolution ("Resolving server names"): an IP literal or an explicit
port is used as is; otherwise ``/.well-known/matrix/server`` (delegation), then
SRV ``_matrix-fed._tcp`` and ``_matrix._tcp``, then port 8448. Every address we
connect to is checked against the IP blacklist (private, loopback and other
special ranges) unless ``federation.ip_range_whitelist`` allows it. Connections
are pooled per destination by Twisted's ``HTTPConnectionPool``; each request has
a timeout. The pure parts (name parsing, blacklist) are functions; the rest is a
thin layer on ``twisted.web.client.Agent``.
"""

# tests: tests/unit/federation/test_client.py, tests/integration/test_federation.py

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import quote, urlencode

import attrs
from signedjson.types import SigningKey
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator, IProtocolFactory, IStreamClientEndpoint
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer
from zope.interface import implementer

from homeserver.federation.auth import sign_request
from homeserver.federation.metrics import METHODS, FederationMetrics

logger = logging.getLogger(__name__)

DEFAULT_PORT: Final = 8448
REQUEST_TIMEOUT_SECONDS: Final = 60.0
WELL_KNOWN_TIMEOUT_SECONDS: Final = 10.0
CLOSE_TIMEOUT_SECONDS: Final = 2.0
MAX_RESPONSE_BYTES: Final = 50 * 1024 * 1024
SCHEME: Final = b"matrix-federation"

DEFAULT_IP_BLACKLIST: Final = (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24",
    "169.254.0.0/16", "192.88.99.0/24", "198.18.0.0/15", "192.0.2.0/24", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/4", "0.0.0.0/8", "255.255.255.255/32",
    "::1/128", "::/128", "fe80::/10", "fc00::/7", "2001:db8::/32", "ff00::/8", "fec0::/10", "::ffff:0:0/96",
)


class FederationClientError(Exception):
    """A request to another server failed before a response arrived (resolution, blacklist, network)."""


class HttpResponseError(FederationClientError):
    """The remote answered with a non-2xx status."""

    def __init__(self, destination: str, code: int, body: bytes) -> None:
        self.code = code
        self.body = body
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        self.json: Any = parsed
        errcode = parsed.get("errcode") if isinstance(parsed, dict) else None
        super().__init__(f"{destination} answered {code} {errcode or body[:200]!r}")


@attrs.frozen(slots=True)
class ServerName:
    host: str
    port: int | None

    @property
    def is_ip_literal(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
            return True
        except ValueError:
            return False


def parse_server_name(name: str) -> ServerName:
    """Split ``host[:port]`` (IPv6 literals in brackets); raises ValueError when malformed."""
    if name.startswith("["):
        end = name.find("]")
        if end < 0:
            raise ValueError(f"server name {name!r}: unterminated IPv6 literal")
        host, rest = name[1:end], name[end + 1:]
        ipaddress.IPv6Address(host)
    else:
        host, sep, port_text = name.rpartition(":")
        if not sep:
            host, rest = name, ""
        else:
            rest = ":" + port_text
    if not host:
        raise ValueError(f"server name {name!r} has no host")
    if rest:
        if not rest.startswith(":") or not rest[1:].isdigit() or not 0 < int(rest[1:]) < 65536:
            raise ValueError(f"server name {name!r}: bad port {rest[1:]!r}")
        return ServerName(host, int(rest[1:]))
    return ServerName(host, None)


class IpFilter:
    """Which IP addresses outbound federation may connect to."""

    def __init__(self, whitelist: Iterable[str], blacklist: Iterable[str] = DEFAULT_IP_BLACKLIST) -> None:
        self._black = [ipaddress.ip_network(n, strict=False) for n in blacklist]
        self._white = [ipaddress.ip_network(n, strict=False) for n in whitelist]

    def allowed(self, address: str) -> bool:
        ip = ipaddress.ip_address(address)
        if any(ip in net for net in self._white if net.version == ip.version):
            return True
        return not any(ip in net for net in self._black if net.version == ip.version)


@attrs.frozen(slots=True)
class Target:
    """Where to connect for a server name, and which name the certificate must carry."""

    host: str
    port: int
    tls_name: str


@implementer(IOpenSSLClientConnectionCreator)
class _NoVerifyTLS:
    """TLS without certificate checks (``federation.verify_certificates: false``); sends SNI."""

    def __init__(self, hostname: str) -> None:
        from twisted.internet import ssl

        self._hostname = hostname.encode("idna") if not _is_ip(hostname) else b""
        self._ctx = ssl.CertificateOptions(verify=False).getContext()

    def clientConnectionForTLS(self, tlsProtocol: object) -> Any:
        from OpenSSL import SSL

        connection = SSL.Connection(self._ctx, None)
        if self._hostname:
            connection.set_tlsext_host_name(self._hostname)
        return connection


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class ServerResolver:
    """Server name -> ``Target``, cached for the life of the process (well-known answers are rare to change)."""

    def __init__(self, reactor: Any, *, verify_certificates: bool, ip_filter: IpFilter) -> None:
        self._reactor = reactor
        self._verify = verify_certificates
        self._ip_filter = ip_filter
        self._cache: dict[str, Target] = {}

    async def resolve(self, server_name: str) -> Target:
        cached = self._cache.get(server_name)
        if cached is not None:
            return cached
        target = await self._resolve(server_name)
        self._cache[server_name] = target
        return target

    async def _resolve(self, server_name: str) -> Target:
        try:
            parsed = parse_server_name(server_name)
        except ValueError as e:
            raise FederationClientError(str(e)) from None
        if parsed.is_ip_literal or parsed.port is not None:
            return Target(parsed.host, parsed.port or DEFAULT_PORT, parsed.host)
        delegated = await self._well_known(parsed.host)
        if delegated is not None:
            try:
                d = parse_server_name(delegated)
            except ValueError:
                d = None
            if d is not None:
                if d.is_ip_literal or d.port is not None:
                    return Target(d.host, d.port or DEFAULT_PORT, d.host)
                srv = await self._srv(d.host)
                return srv or Target(d.host, DEFAULT_PORT, d.host)
        srv = await self._srv(parsed.host)
        return srv or Target(parsed.host, DEFAULT_PORT, parsed.host)

    async def _srv(self, host: str) -> Target | None:
        from twisted.names import client as dns_client
        from twisted.names import dns

        for prefix in ("_matrix-fed._tcp.", "_matrix._tcp."):
            try:
                answers, _, _ = await dns_client.lookupService(prefix + host)
            except Exception:  # NXDOMAIN and friends: try the next way
                continue
            records = [a.payload for a in answers if a.type == dns.SRV]
            if records:
                best = min(records, key=lambda r: (r.priority, -r.weight))
                return Target(str(best.target).rstrip("."), int(best.port), host)
        return None

    async def _well_known(self, host: str) -> str | None:
        try:
            address = await self.connect_address(host)
        except FederationClientError:
            return None
        creator = self.tls_creator(host)
        endpoint = wrapClientTLS(creator, _tcp_endpoint(self._reactor, address, 443))
        agent = Agent.usingEndpointFactory(self._reactor, _FixedEndpoint(endpoint))
        try:
            d = agent.request(b"GET", f"https://{host}/.well-known/matrix/server".encode("ascii"))
            d.addTimeout(WELL_KNOWN_TIMEOUT_SECONDS, self._reactor)
            response = await d
            if response.code != 200:
                return None
            body = await readBody(response)
            value = json.loads(body).get("m.server")
        except Exception as e:  # no delegation; fall through to SRV
            logger.debug("no .well-known/matrix/server for %s: %s", host, e)
            return None
        return value if isinstance(value, str) else None

    async def connect_address(self, host: str) -> str:
        """An IP address for ``host`` that the IP filter allows; FederationClientError otherwise."""
        if _is_ip(host):
            address = host
        else:
            try:
                address = await self._reactor.resolve(host)
            except Exception as e:
                raise FederationClientError(f"cannot resolve {host}: {e}") from None
        if not self._ip_filter.allowed(address):
            raise FederationClientError(f"{host} resolves to {address}, which is in the IP range blacklist")
        return str(address)

    def tls_creator(self, tls_name: str) -> IOpenSSLClientConnectionCreator:
        if self._verify:
            from twisted.internet import ssl

            return ssl.optionsForClientTLS(tls_name)
        return _NoVerifyTLS(tls_name)


def _tcp_endpoint(reactor: Any, address: str, port: int) -> IStreamClientEndpoint:
    if ipaddress.ip_address(address).version == 6:
        return TCP6ClientEndpoint(reactor, address, port, timeout=30)
    return TCP4ClientEndpoint(reactor, address, port, timeout=30)


@implementer(IAgentEndpointFactory)
class _FixedEndpoint:
    def __init__(self, endpoint: IStreamClientEndpoint) -> None:
        self._endpoint = endpoint

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return self._endpoint


@implementer(IStreamClientEndpoint)
class _FederationEndpoint:
    """Connects to a server name: resolution, blacklist and TLS happen at connect time."""

    def __init__(self, reactor: Any, resolver: ServerResolver, server_name: str) -> None:
        self._reactor = reactor
        self._resolver = resolver
        self._server_name = server_name

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._connect(protocolFactory))

    async def _connect(self, protocolFactory: IProtocolFactory) -> Any:
        target = await self._resolver.resolve(self._server_name)
        address = await self._resolver.connect_address(target.host)
        endpoint = wrapClientTLS(
            self._resolver.tls_creator(target.tls_name), _tcp_endpoint(self._reactor, address, target.port)
        )
        return await endpoint.connect(protocolFactory)


@implementer(IAgentEndpointFactory)
class _FederationEndpointFactory:
    def __init__(self, reactor: Any, resolver: ServerResolver) -> None:
        self._reactor = reactor
        self._resolver = resolver

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return _FederationEndpoint(self._reactor, self._resolver, uri.netloc.decode("ascii"))


@implementer(IBodyProducer)
class _JsonBody:
    def __init__(self, body: bytes) -> None:
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(self._body)
        d: Deferred[None] = Deferred()
        d.callback(None)
        return d

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class FederationClient:
    """Signed JSON requests to other homeservers."""

    def __init__(
        self,
        reactor: Any,
        *,
        server_name: str,
        signing_key: SigningKey,
        verify_certificates: bool,
        ip_range_whitelist: Iterable[str],
        timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
        metrics: FederationMetrics | None = None,
    ) -> None:
        self._metrics = metrics
        self._reactor = reactor
        self._server_name = server_name
        self._signing_key = signing_key
        self._timeout = timeout_seconds
        self.resolver = ServerResolver(
            reactor, verify_certificates=verify_certificates, ip_filter=IpFilter(ip_range_whitelist)
        )
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = 5
        self._pool.cachedConnectionTimeout = 120
        self._agent = Agent.usingEndpointFactory(
            reactor, _FederationEndpointFactory(reactor, self.resolver), pool=self._pool
        )

    def _count(self, method: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.requests.labels(method=method if method in METHODS else "other", outcome=outcome).inc()

    async def close(self) -> None:
        """Close pooled connections; a peer that does not answer the TLS close is not waited for."""
        d = self._pool.closeCachedConnections()
        d.addTimeout(CLOSE_TIMEOUT_SECONDS, self._reactor)
        try:
            await d
        except Exception:  # timed out: the process goes on stopping regardless
            logger.info("pooled federation connections did not close within %.0fs", CLOSE_TIMEOUT_SECONDS)

    async def get_json(self, destination: str, path: str, query: Mapping[str, Any] | None = None,
                       *, signed: bool = True, timeout: float | None = None) -> Any:
        return await self.request("GET", destination, path, query=query, signed=signed, timeout=timeout)

    async def put_json(self, destination: str, path: str, content: Any, *, timeout: float | None = None) -> Any:
        return await self.request("PUT", destination, path, content=content, timeout=timeout)

    async def post_json(self, destination: str, path: str, content: Any, *, signed: bool = True,
                        timeout: float | None = None) -> Any:
        return await self.request("POST", destination, path, content=content, signed=signed, timeout=timeout)

    async def request(
        self,
        method: str,
        destination: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        content: Any | None = None,
        signed: bool = True,
        timeout: float | None = None,
    ) -> Any:
        """Send one request; return the parsed JSON body of a 2xx response.

        Raises ``HttpResponseError`` for other statuses and ``FederationClientError``
        for everything that stops a response arriving.
        """
        uri = path
        if query:
            uri += "?" + urlencode(query, doseq=True, quote_via=quote)
        headers = Headers({b"User-Agent": [b"Tributary"]})
        body: _JsonBody | None = None
        if content is not None:
            headers.addRawHeader(b"Content-Type", b"application/json")
            body = _JsonBody(json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
        if signed:
            auth = sign_request(method, uri, self._server_name, destination, content, self._signing_key)
            headers.addRawHeader(b"Authorization", auth.encode("utf-8"))
        url = SCHEME + b"://" + destination.encode("idna" if not destination.isascii() else "ascii") + uri.encode("ascii")
        logger.debug("[%s] %s %s", destination, method, path)
        try:
            d = self._agent.request(method.encode("ascii"), url, headers, body)
            d.addTimeout(timeout or self._timeout, self._reactor)
            response = await d
            d2 = readBody(response)
            d2.addTimeout(timeout or self._timeout, self._reactor)
            raw = await d2
        except FederationClientError:
            self._count(method, "network_error")
            raise
        except Exception as e:
            self._count(method, "network_error")
            raise FederationClientError(f"{method} {path} to {destination} failed: {type(e).__name__}: {e}") from e
        if len(raw) > MAX_RESPONSE_BYTES:
            raise FederationClientError(f"{destination} sent {len(raw)} bytes, over {MAX_RESPONSE_BYTES}")
        if not 200 <= response.code < 300:
            self._count(method, "http_error")
            raise HttpResponseError(destination, response.code, raw)
        self._count(method, "ok")
        try:
            return json.loads(raw)
        except ValueError:
            raise FederationClientError(f"{method} {path} to {destination}: response is not JSON") from None
