"""URL previews (``GET /_matrix/client/v1/media/preview_url``): off unless
``media.url_preview.enabled``.

The server fetches a URL a user names, so it must not become a way into the networks it can
reach: the host is resolved here, every address it resolves to is checked against
``ip_range_blacklist`` (loopback, private, link-local, ... by default) unless
``ip_range_whitelist`` allows it, and the connection goes to the checked address (so a DNS
answer that changes between check and connect changes nothing). Redirects are followed (at
most 5), each checked the same way. Bodies stop at ``max_spider_size``, the whole fetch at
``timeout``. HTML gives its OpenGraph (homeserver/media/opengraph.py); an image (the page's
``og:image``, or the URL itself) is stored as media of the user who asked and given as an
``mxc://`` URI. Answers are cached in memory for ``cache_duration``.
"""

# tests: tests/unit/media/test_opengraph.py, tests/integration/test_media.py

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any, Final
from urllib.parse import urljoin, urlsplit

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.internet.threads import deferToThreadPool
from twisted.web.client import Agent
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory, IResponse
from zope.interface import implementer

from homeserver.remote.client import FederationClientError, IpFilter, read_body, within
from homeserver.remote.ttl_cache import TtlCache
from homeserver.media.config import UrlPreviewConfig
from homeserver.media.metrics import MediaMetrics
from homeserver.media.opengraph import decode_html, parse_opengraph
from homeserver.media.rules import THUMBNAIL_SOURCE_TYPES, base_type, normalise_content_type
from storage.kernel.errors import MatrixError, forbidden, invalid_param, unrecognized

logger = logging.getLogger(__name__)

MAX_REDIRECTS: Final = 5
MAX_URL_LENGTH: Final = 2000


class PreviewRefused(Exception):
    """The URL may not be fetched (a bad scheme, credentials, too long)."""


class AddressDenied(PreviewRefused):
    """The URL's host resolves to an address of the deny list."""


def check_preview_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, or PreviewRefused."""
    if len(url) > MAX_URL_LENGTH:
        raise PreviewRefused(f"URL is longer than {MAX_URL_LENGTH} characters")
    if not url.isascii() or any(ch in url for ch in " \r\n\t"):
        raise PreviewRefused("URL must be ASCII without spaces (percent-encode it, punycode its host)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise PreviewRefused(f"not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PreviewRefused("only http and https URLs with a host can be previewed")
    if parts.username or parts.password:
        raise PreviewRefused("URLs with credentials are not previewed")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


@implementer(IAgentEndpointFactory)
class _PinnedEndpoints:
    """Connects to the one address that was checked, whatever the URL's host resolves to now."""

    def __init__(self, reactor: Any, address: str, host: str, timeout: float) -> None:
        self._reactor, self._address, self._host, self._timeout = reactor, address, host, timeout

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        if ipaddress.ip_address(self._address).version == 6:
            endpoint: IStreamClientEndpoint = TCP6ClientEndpoint(self._reactor, self._address, uri.port,
                                                                 timeout=self._timeout)
        else:
            endpoint = TCP4ClientEndpoint(self._reactor, self._address, uri.port, timeout=self._timeout)
        if uri.scheme == b"https":
            from twisted.internet.ssl import optionsForClientTLS

            endpoint = wrapClientTLS(optionsForClientTLS(self._host), endpoint)
        return endpoint


class UrlPreviewer:
    def __init__(self, config: UrlPreviewConfig, reactor: Any, metrics: MediaMetrics, store_image: Any) -> None:
        """``store_image(user_id, data, content_type) -> (mxc URI, width, height)``."""
        self._config = config
        self._reactor = reactor
        self._metrics = metrics
        self._store_image = store_image
        self._filter = IpFilter(config.ip_range_whitelist, config.ip_range_blacklist)
        self._cache: TtlCache[str, dict[str, Any]] = TtlCache(ttl=config.cache_duration.total_seconds(),
                                                              max_entries=10_000)

    async def preview(self, url: str, user_id: str = "") -> dict[str, Any]:
        if not self._config.enabled:
            self._metrics.previews.labels(outcome="refused").inc()
            raise unrecognized("URL previews are not enabled on this server")
        cached = self._cache.get(url, self._reactor.seconds())
        if cached is not None:
            self._metrics.previews.labels(outcome="cached").inc()
            return cached
        try:
            check_preview_url(url)
            final_url, content_type, body = await self._fetch(url)
            result = await self._describe(final_url, content_type, body, user_id)
        except AddressDenied as e:
            self._metrics.previews.labels(outcome="refused").inc()
            raise forbidden(f"Cannot preview this URL: {e}") from None
        except PreviewRefused as e:
            self._metrics.previews.labels(outcome="refused").inc()
            raise invalid_param(f"Cannot preview this URL: {e}") from None
        except CancelledError:
            raise
        except MatrixError:
            self._metrics.previews.labels(outcome="error").inc()
            raise
        except Exception as e:
            self._metrics.previews.labels(outcome="error").inc()
            logger.info("URL preview of %s failed: %s", url[:200], e)
            raise MatrixError(502, "M_UNKNOWN", "Could not fetch the URL to preview") from None
        self._metrics.previews.labels(outcome="ok").inc()
        self._cache.set(url, result, self._reactor.seconds())
        return result

    async def _describe(self, url: str, content_type: str, body: bytes, user_id: str) -> dict[str, Any]:
        kind = base_type(content_type)
        if kind in THUMBNAIL_SOURCE_TYPES:
            return await self._image(body, kind, user_id, url)
        if kind in ("text/html", "application/xhtml+xml"):
            og: dict[str, Any] = dict(parse_opengraph(decode_html(body, content_type), url))
            image_url = og.pop("og:image", None)
            if image_url is not None:
                try:
                    image_final, image_type, image_body = await self._fetch(image_url)
                    if base_type(image_type) in THUMBNAIL_SOURCE_TYPES:
                        og.update(await self._image(image_body, base_type(image_type), user_id, image_final))
                except Exception as e:
                    logger.info("URL preview: no og:image from %s: %s", image_url[:200], e)
            return og
        return {"og:url": url}

    async def _image(self, body: bytes, content_type: str, user_id: str, url: str) -> dict[str, Any]:
        uri, width, height = await self._store_image(user_id, body, content_type)
        return {"og:image": uri, "og:image:type": content_type, "og:image:width": width,
                "og:image:height": height, "matrix:image:size": len(body), "og:url": url}

    async def _fetch(self, url: str) -> tuple[str, str, bytes]:
        """Follow redirects; (final URL, Content-Type, body)."""
        timeout = self._config.timeout.total_seconds()
        for _ in range(MAX_REDIRECTS + 1):
            scheme, host, port = check_preview_url(url)
            address = await self._resolve(host, port, timeout)
            agent = Agent.usingEndpointFactory(self._reactor, _PinnedEndpoints(self._reactor, address, host, timeout))
            headers = Headers({b"User-Agent": [b"Tributary URL preview"], b"Accept": [b"text/html, image/*;q=0.9"]})
            response: IResponse = await within(agent.request(b"GET", url.encode("ascii", "strict"), headers), timeout,
                                               self._reactor, f"GET {url[:100]}")
            if response.code in (301, 302, 303, 307, 308):
                location = response.headers.getRawHeaders(b"Location")
                response.deliverBody(_Discard())
                if not location:
                    raise FederationClientError("redirect without Location")
                url = urljoin(url, location[0].decode("latin-1"))
                continue
            if not 200 <= response.code < 300:
                response.deliverBody(_Discard())
                raise FederationClientError(f"answered {response.code}")
            body = await within(Deferred.fromCoroutine(read_body(response, self._config.max_spider_size, host)),
                                timeout, self._reactor, f"reading {url[:100]}")
            types = response.headers.getRawHeaders(b"Content-Type") or [b""]
            return url, normalise_content_type(types[0].decode("latin-1")), body
        raise FederationClientError("too many redirects")

    async def _resolve(self, host: str, port: int, timeout: float) -> str:
        """The address to connect to, once every address of ``host`` passed the filter."""
        try:
            infos = await within(deferToThreadPool(self._reactor, self._reactor.getThreadPool(), socket.getaddrinfo,
                                                   host, port, 0, socket.SOCK_STREAM), timeout, self._reactor,
                                 f"resolving {host}")
        except socket.gaierror as e:
            raise FederationClientError(f"cannot resolve {host}: {e}") from None
        addresses = [str(info[4][0]) for info in infos]
        if not addresses:
            raise FederationClientError(f"{host} has no address")
        for address in addresses:
            if not self._filter.allowed(address.split("%")[0]):
                raise AddressDenied(f"{host} resolves to a denied address")
        return addresses[0]


class _Discard(Protocol):
    """A body consumer that drops everything (for redirects and errors)."""

    def connectionMade(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()  # type: ignore[attr-defined]
