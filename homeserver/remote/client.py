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
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeVar
from urllib.parse import quote, urlencode

import attrs
from signedjson.types import SigningKey
from twisted.internet import error as net_error
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IAddress,
    IHandshakeListener,
    IProtocol,
    IOpenSSLClientConnectionCreator,
    IProtocolFactory,
    IStreamClientEndpoint,
    ITransport,
)
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from homeserver.events.identifiers import ServerName as ServerName
from homeserver.events.identifiers import check_hostname as check_hostname
from homeserver.events.identifiers import parse_server_name as parse_server_name
from homeserver.events.canonical import encode_canonical
from homeserver.remote.request_auth import sign_encoded_request
from homeserver.remote.metrics import METHODS, FederationMetrics
from homeserver.remote.ttl_cache import TtlCache

logger = logging.getLogger(__name__)

DEFAULT_PORT: Final = 8448
REQUEST_TIMEOUT_SECONDS: Final = 60.0
CLOSE_TIMEOUT_SECONDS: Final = 2.0
MAX_RESPONSE_BYTES: Final = 50 * 1024 * 1024
MAX_WELL_KNOWN_BYTES: Final = 64 * 1024
# Resolved server names are remembered this long (a changed .well-known or SRV record is seen
# within the hour), and at most this many, so names from hostile requests cannot fill memory.
RESOLVE_CACHE_SECONDS: Final = 3600.0
RESOLVE_CACHE_ENTRIES: Final = 10_000
SCHEME: Final = b"matrix-federation"

DEFAULT_IP_BLACKLIST: Final = (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24",
    "169.254.0.0/16", "192.88.99.0/24", "198.18.0.0/15", "192.0.2.0/24", "198.51.100.0/24",
    "203.0.113.0/24", "224.0.0.0/4", "0.0.0.0/8", "255.255.255.255/32",
    "::1/128", "::/128", "fe80::/10", "fc00::/7", "2001:db8::/32", "ff00::/8", "fec0::/10", "::ffff:0:0/96",
)


@attrs.frozen
class RawResponse:
    """A non-JSON answer (media): status, ``Content-Type``, ``Content-Disposition`` and body."""

    code: int
    content_type: str
    content_disposition: str
    body: bytes


class FederationClientError(Exception):
    """A request to another server failed before a response arrived (resolution, blacklist, network)."""


class ResponseTooLarge(FederationClientError):
    """The answer's body was larger than the caller allows (the read stopped there)."""


class FederationTimeout(FederationClientError):
    """A step of a request (DNS, connect, TLS, response, body) took longer than its limit."""


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


@attrs.frozen
class OutboundTimeouts:
    """Seconds each step of an outbound request may take (``federation_limits``)."""

    dns: float = 10.0
    well_known: float = 10.0
    connect: float = 10.0
    tls: float = 10.0
    request: float = REQUEST_TIMEOUT_SECONDS
    body: float = 30.0


T = TypeVar("T")


async def within(d: Deferred[T], seconds: float, reactor: Any, what: str) -> T:
    """Await ``d`` for at most ``seconds``, then cancel it and raise ``FederationTimeout`` naming ``what``
    (whatever error the cancelled work reports: Twisted's agent, for one, wraps the cancellation).

    A cancellation from above passes through as ``CancelledError``."""
    timed_out = False

    def expire() -> None:
        nonlocal timed_out
        timed_out = True
        d.cancel()

    timer = reactor.callLater(seconds, expire)
    try:
        return await d
    except BaseException:
        if timed_out:
            raise FederationTimeout(f"{what} timed out after {seconds:g}s") from None
        raise
    finally:
        if timer.active():
            timer.cancel()


class ServerResolver:
    """Server name -> ``Target``; answers are remembered for an hour, at most 10,000 of them."""

    def __init__(self, reactor: Any, *, verify_certificates: bool, ip_filter: IpFilter,
                 timeouts: OutboundTimeouts = OutboundTimeouts()) -> None:
        self._reactor = reactor
        self._verify = verify_certificates
        self._ip_filter = ip_filter
        self.timeouts = timeouts
        self._cache: TtlCache[str, Target] = TtlCache(ttl=RESOLVE_CACHE_SECONDS, max_entries=RESOLVE_CACHE_ENTRIES)

    def remember(self, server_name: str, target: Target) -> None:
        """Use ``target`` for ``server_name`` until the cache forgets it."""
        self._cache.set(server_name, target, self._reactor.seconds())

    async def resolve(self, server_name: str) -> Target:
        cached = self._cache.get(server_name, self._reactor.seconds())
        if cached is not None:
            return cached
        target = await self._resolve(server_name)
        self.remember(server_name, target)
        return target

    async def _resolve(self, server_name: str) -> Target:
        try:
            parsed = parse_server_name(server_name)
        except ValueError as e:
            raise FederationClientError(f"not a valid server name: {e}") from None
        if parsed.is_ip_literal or parsed.port is not None:
            return Target(parsed.host, parsed.port or DEFAULT_PORT, parsed.host)
        try:
            delegated = await within(Deferred.fromCoroutine(self._well_known(parsed.host)),
                                     self.timeouts.well_known, self._reactor, f"{parsed.host}/.well-known/matrix/server")
        except FederationTimeout as e:
            logger.info("no delegation for %s: %s", parsed.host, e)
            delegated = None
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
                answers, _, _ = await within(dns_client.lookupService(prefix + host), self.timeouts.dns,
                                             self._reactor, f"SRV lookup of {prefix}{host}")
            except CancelledError:
                raise
            except Exception as e:  # NXDOMAIN, a timeout and friends: try the next way
                logger.debug("SRV %s%s: %s", prefix, host, e)
                continue
            records = [a.payload for a in answers if a.type == dns.SRV]
            if records:
                best = min(records, key=lambda r: (r.priority, -r.weight))
                target = str(best.target).rstrip(".")
                try:
                    check_hostname(target)
                except ValueError:
                    continue
                return Target(target, int(best.port), host)
        return None

    async def _well_known(self, host: str) -> str | None:
        """``m.server`` of ``https://host/.well-known/matrix/server``; the caller bounds the time."""
        try:
            address = await self.connect_address(host)
        except FederationTimeout:
            raise
        except FederationClientError:
            return None
        creator = self.tls_creator(host)
        endpoint = wrapClientTLS(creator, _tcp_endpoint(self._reactor, address, 443, self.timeouts.connect))
        agent = Agent.usingEndpointFactory(self._reactor, _FixedEndpoint(endpoint))
        try:
            response = await agent.request(b"GET", f"https://{host}/.well-known/matrix/server".encode("ascii"))
            if response.code != 200:
                return None
            body = await read_body(response, MAX_WELL_KNOWN_BYTES, host)
            value = json.loads(body).get("m.server")
        except CancelledError:
            raise
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
                check_hostname(host)
                address = await within(self._reactor.resolve(host), self.timeouts.dns, self._reactor,
                                       f"DNS lookup of {host}")
            except (CancelledError, FederationClientError):
                raise
            except Exception as e:
                raise FederationClientError(f"cannot resolve {host[:300]}: {e}") from None
        if not self._ip_filter.allowed(address):
            raise FederationClientError(f"{host} resolves to {address}, which is in the IP range blacklist")
        return str(address)

    def tls_creator(self, tls_name: str) -> IOpenSSLClientConnectionCreator:
        if self._verify:
            from twisted.internet import ssl

            return ssl.optionsForClientTLS(tls_name)
        return _NoVerifyTLS(tls_name)


def _tcp_endpoint(reactor: Any, address: str, port: int, timeout: float) -> IStreamClientEndpoint:
    if ipaddress.ip_address(address).version == 6:
        return TCP6ClientEndpoint(reactor, address, port, timeout=timeout)
    return TCP4ClientEndpoint(reactor, address, port, timeout=timeout)


class _BodyReader(Protocol):
    """Collects a response body up to ``limit`` bytes; past it, drops the connection."""

    def __init__(self, done: Deferred[bytes], limit: int, destination: str) -> None:
        self._done = done
        self._limit = limit
        self._destination = destination
        self._chunks: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        if self._done.called:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._done.errback(ResponseTooLarge(f"{self._destination} sent a body over {self._limit} bytes"))
            if self.transport is not None:
                self.transport.stopProducing()  # type: ignore[attr-defined]
            return
        self._chunks.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:
        if self._done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self._done.callback(b"".join(self._chunks))
        else:
            self._done.errback(reason)


async def read_body(response: IResponse, limit: int, destination: str) -> bytes:
    """The body of ``response``, at most ``limit`` bytes (``FederationClientError`` past it)."""
    reader: _BodyReader | None = None

    def cancel(d: Deferred[bytes]) -> None:
        if reader is not None and reader.transport is not None:
            reader.transport.stopProducing()  # type: ignore[attr-defined]

    done: Deferred[bytes] = Deferred(cancel)
    reader = _BodyReader(done, limit, destination)
    response.deliverBody(reader)
    return await done


@implementer(IProtocol, IHandshakeListener)
class _HandshakeWatch:
    """Sits between TLS and the HTTP protocol to learn when the handshake is done."""

    def __init__(self, inner: IProtocol, handshake: Deferred[None]) -> None:
        self.inner = inner
        self.transport: Any = None
        self._handshake = handshake

    def makeConnection(self, transport: ITransport) -> None:
        self.transport = transport
        self.inner.makeConnection(transport)

    def connectionMade(self) -> None:
        pass  # the inner protocol's makeConnection called its own

    def dataReceived(self, data: bytes) -> None:
        self.inner.dataReceived(data)

    def connectionLost(self, reason: Failure) -> None:
        if not self._handshake.called:
            self._handshake.errback(reason)
        self.inner.connectionLost(reason)

    def handshakeCompleted(self) -> None:
        if not self._handshake.called:
            self._handshake.callback(None)
        if IHandshakeListener.providedBy(self.inner):
            self.inner.handshakeCompleted()


@implementer(IProtocolFactory)
class _HandshakeWatchFactory:
    def __init__(self, inner: IProtocolFactory) -> None:
        self._inner = inner
        self.handshake: Deferred[None] = Deferred()
        self.built: _HandshakeWatch | None = None

    def buildProtocol(self, addr: IAddress) -> IProtocol | None:
        protocol = self._inner.buildProtocol(addr)
        if protocol is not None:
            self.built = _HandshakeWatch(protocol, self.handshake)
        return self.built

    def doStart(self) -> None:
        self._inner.doStart()

    def doStop(self) -> None:
        self._inner.doStop()


@implementer(IAgentEndpointFactory)
class _FixedEndpoint:
    def __init__(self, endpoint: IStreamClientEndpoint) -> None:
        self._endpoint = endpoint

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return self._endpoint


@implementer(IStreamClientEndpoint)
class _FederationEndpoint:
    """Connects to a server name: resolution, blacklist, TCP and TLS happen at connect time, each bounded."""

    def __init__(self, reactor: Any, resolver: ServerResolver, server_name: str) -> None:
        self._reactor = reactor
        self._resolver = resolver
        self._server_name = server_name

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._connect(protocolFactory))

    async def _connect(self, protocolFactory: IProtocolFactory) -> Any:
        timeouts = self._resolver.timeouts
        target = await self._resolver.resolve(self._server_name)
        address = await self._resolver.connect_address(target.host)
        watch = _HandshakeWatchFactory(protocolFactory)
        endpoint = wrapClientTLS(
            self._resolver.tls_creator(target.tls_name),
            _tcp_endpoint(self._reactor, address, target.port, timeouts.connect),
        )
        where = f"{self._server_name} ({address}:{target.port})"
        try:
            await endpoint.connect(watch)
        except net_error.TimeoutError:
            raise FederationTimeout(f"connecting to {where} timed out after {timeouts.connect:g}s") from None
        except net_error.ConnectError as e:
            raise FederationClientError(f"cannot connect to {where}: {type(e).__name__}: {e}") from None
        protocol = watch.built
        if protocol is None:
            raise FederationClientError(f"connecting to {where}: no protocol was built")
        try:
            await within(watch.handshake, timeouts.tls, self._reactor, f"TLS handshake with {where}")
        except BaseException as e:
            transport = protocol.transport
            if transport is not None:
                transport.abortConnection()
            if isinstance(e, (CancelledError, FederationClientError)):
                raise
            raise FederationClientError(f"TLS handshake with {where} failed: {e}") from None
        return protocol.inner


@implementer(IAgentEndpointFactory)
class _FederationEndpointFactory:
    def __init__(self, reactor: Any, resolver: ServerResolver) -> None:
        self._reactor = reactor
        self._resolver = resolver

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return _FederationEndpoint(self._reactor, self._resolver, uri.netloc.decode("ascii"))


def _encode_body(content: Any, *, canonical: bool) -> bytes:
    """A request body: canonical JSON when the request is signed (the signature covers exactly
    these bytes, so they are encoded once for both), compact JSON otherwise."""
    if canonical:
        return encode_canonical(content)
    return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


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
        timeout_seconds: float | None = None,
        timeouts: OutboundTimeouts = OutboundTimeouts(),
        metrics: FederationMetrics | None = None,
    ) -> None:
        """``timeouts`` bound each step; ``timeout_seconds``, when given, replaces ``timeouts.request``."""
        if timeout_seconds is not None:
            timeouts = attrs.evolve(timeouts, request=timeout_seconds)
        self._metrics = metrics
        self._reactor = reactor
        self._server_name = server_name
        self._signing_key = signing_key
        self._timeouts = timeouts
        self.resolver = ServerResolver(
            reactor, verify_certificates=verify_certificates, ip_filter=IpFilter(ip_range_whitelist), timeouts=timeouts,
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

    async def put_json(self, destination: str, path: str, content: Any, *, timeout: float | None = None,
                       max_bytes: int = MAX_RESPONSE_BYTES) -> Any:
        return await self.request("PUT", destination, path, content=content, timeout=timeout, max_bytes=max_bytes)

    async def put_encoded(self, destination: str, path: str, body: bytes, *, timeout: float | None = None) -> Any:
        """``put_json`` of a body already encoded as canonical JSON (the federation sender's
        transactions, joined from pre-encoded PDUs): sent as it is and signed over as it is."""
        return await self.request("PUT", destination, path, encoded=body, timeout=timeout)

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
        encoded: bytes | None = None,
        signed: bool = True,
        timeout: float | None = None,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> Any:
        """Send one request; return the parsed JSON body of a 2xx response (at most ``max_bytes``).
        The body is ``content`` (encoded here), or ``encoded``: content already in canonical JSON.

        Raises ``HttpResponseError`` for other statuses and ``FederationClientError``
        for everything that stops a response arriving.
        """
        if content is not None:
            encoded = _encode_body(content, canonical=signed)
        response, raw = await self._exchange(method, destination, path, query=query, encoded=encoded, signed=signed,
                                             timeout=timeout, max_bytes=max_bytes)
        if not 200 <= response.code < 300:
            self._count(method, "http_error")
            raise HttpResponseError(destination, response.code, raw)
        self._count(method, "ok")
        try:
            return json.loads(raw)
        except ValueError:
            raise FederationClientError(f"{method} {path} to {destination}: response is not JSON") from None

    async def get_bytes(self, destination: str, path: str, *, query: Mapping[str, Any] | None = None,
                        signed: bool = True, timeout: float | None = None, max_bytes: int) -> RawResponse:
        """GET ``path`` and return the answer whatever its type (media): its status, Content-Type and
        body. A body above ``max_bytes`` is a ``FederationClientError`` (the read stops there);
        a status other than 2xx is an ``HttpResponseError``."""
        response, raw = await self._exchange("GET", destination, path, query=query, encoded=None, signed=signed,
                                             timeout=timeout, max_bytes=max_bytes)
        if not 200 <= response.code < 300:
            self._count("GET", "http_error")
            raise HttpResponseError(destination, response.code, raw)
        self._count("GET", "ok")
        types = response.headers.getRawHeaders(b"Content-Type") or [b""]
        dispositions = response.headers.getRawHeaders(b"Content-Disposition") or [b""]
        return RawResponse(response.code, types[0].decode("latin-1"), dispositions[0].decode("latin-1"), raw)

    async def _exchange(self, method: str, destination: str, path: str, *, query: Mapping[str, Any] | None,
                        encoded: bytes | None, signed: bool, timeout: float | None,
                        max_bytes: int) -> tuple[IResponse, bytes]:
        """``encoded``: the body, canonical JSON when ``signed`` (the signature is made over it)."""
        uri = path
        if query:
            uri += "?" + urlencode(query, doseq=True, quote_via=quote)
        headers = Headers({b"User-Agent": [b"Tributary"]})
        body: _JsonBody | None = None
        if encoded is not None:
            headers.addRawHeader(b"Content-Type", b"application/json")
            body = _JsonBody(encoded)
        if signed:
            auth = sign_encoded_request(method, uri, self._server_name, destination, encoded, self._signing_key)
            headers.addRawHeader(b"Authorization", auth.encode("utf-8"))
        try:
            parse_server_name(destination)
        except ValueError as e:
            self._count(method, "network_error")
            raise FederationClientError(f"not a valid server name: {e}") from None
        url = SCHEME + b"://" + destination.encode("ascii") + uri.encode("ascii")
        logger.debug("[%s] %s %s", destination, method, path)
        limit = timeout or self._timeouts.request
        what = f"{method} {path} to {destination}"
        try:
            response = await within(self._agent.request(method.encode("ascii"), url, headers, body), limit,
                                    self._reactor, what)
            raw = await within(Deferred.fromCoroutine(read_body(response, max_bytes, destination)),
                               min(limit, self._timeouts.body), self._reactor, f"reading the answer to {what}")
        except CancelledError:
            raise
        except FederationTimeout:
            self._count(method, "timeout")
            raise
        except FederationClientError:
            self._count(method, "network_error")
            raise
        except Exception as e:
            self._count(method, "network_error")
            raise FederationClientError(f"{what} failed: {type(e).__name__}: {e}") from e
        return response, raw
