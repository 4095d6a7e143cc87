"""Connection limits (homeserver/http/limits.py) on a fake clock and in-memory transports.

Each test opens connections to a site built by ``make_site``, feeds bytes in, moves a
``Clock`` on and looks at what the transport was told (closed, aborted, a 408 written) and
at the metrics: no sockets, no sleeps.
"""

from __future__ import annotations

from datetime import timedelta

from prometheus_client import CollectorRegistry
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from homeserver.config import ConnectionLimitsConfig
from homeserver.http.limits import LimitedSite
from homeserver.http.metrics import CONNECTION_LIMIT_REASONS, HttpMetrics
from homeserver.http.server import make_site

LIMITS = ConnectionLimitsConfig(header_timeout=timedelta(seconds=30), body_timeout=timedelta(seconds=60),
                                idle_timeout=timedelta(seconds=75), max_connections_per_ip=2, exempt_ranges=())


class Root(Resource):
    """``/held`` is answered only when the test says so (a long-poll); anything else at once."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Request] = []

    def render(self, request: Request) -> bytes | int:
        if request.path == b"/held":
            self.held.append(request)
            return NOT_DONE_YET
        return b"ok"


class Harness:
    def __init__(self, limits: ConnectionLimitsConfig = LIMITS) -> None:
        self.clock = Clock()
        self.registry = CollectorRegistry()
        self.root = Root()
        self.site = make_site(self.root, clock=self.clock, metrics=HttpMetrics.create(self.registry), limits=limits)
        assert isinstance(self.site, LimitedSite)

    def connect(self, host: str = "10.0.0.1") -> tuple[object, StringTransport]:
        address = IPv4Address("TCP", host, 40000)
        protocol = self.site.buildProtocol(address)
        transport = StringTransport(peerAddress=address)
        protocol.makeConnection(transport)
        return protocol, transport

    def closed(self, reason: str) -> float:
        value = self.registry.get_sample_value("tributary_http_connections_closed_total", {"reason": reason})
        assert value is not None
        return value

    def open_connections(self) -> float:
        value = self.registry.get_sample_value("tributary_http_connections_open")
        assert value is not None
        return value


def lose(protocol: object) -> None:
    protocol.connectionLost(Failure(ConnectionDone()))  # type: ignore[attr-defined]


def test_every_reason_starts_at_zero() -> None:
    h = Harness()
    assert [h.closed(reason) for reason in CONNECTION_LIMIT_REASONS] == [0, 0, 0, 0]


def test_slowloris_headers_are_closed_at_the_deadline_from_the_connections_start() -> None:
    """A client sends its request one byte a second. Twisted's idle timeout would restart with
    each byte; the header deadline does not, so at 30 s the connection gets a 408 and is closed."""
    h = Harness()
    protocol, transport = h.connect()
    for byte in b"GET / HTTP/1.1\r\nHost: example.org\r\nUser-Agent: slow\r\n"[:29]:
        protocol.dataReceived(bytes([byte]))  # type: ignore[attr-defined]
        h.clock.advance(1)
    assert not transport.disconnecting
    h.clock.advance(1)
    assert transport.disconnecting
    assert transport.value().startswith(b"HTTP/1.1 408 ")
    assert h.closed("header_timeout") == 1
    # It still does not read: Twisted's grace period later, it is aborted.
    h.clock.advance(15)
    assert transport.disconnected


def test_a_connection_that_never_sends_is_closed_by_the_header_deadline() -> None:
    h = Harness()
    _, transport = h.connect()
    h.clock.advance(29.9)
    assert not transport.disconnecting
    h.clock.advance(0.1)
    assert transport.disconnecting
    assert h.closed("header_timeout") == 1


def test_a_stalled_body_is_closed_but_a_body_that_keeps_coming_is_not() -> None:
    """The body limit is about the client sending: each chunk starts it again (a big upload is
    never cut while it progresses), and a minute without any closes the connection."""
    h = Harness()
    protocol, transport = h.connect()
    protocol.dataReceived(b"PUT /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")  # type: ignore[attr-defined]
    for _ in range(10):  # 10 minutes of a slow but steady upload
        h.clock.advance(59)
        protocol.dataReceived(b"x" * 10)  # type: ignore[attr-defined]
    assert not transport.disconnecting
    h.clock.advance(60)
    assert transport.disconnecting
    assert transport.value().startswith(b"HTTP/1.1 408 ")
    assert h.closed("body_timeout") == 1
    assert h.closed("header_timeout") == 0


def test_an_idle_keep_alive_connection_is_closed() -> None:
    h = Harness()
    protocol, transport = h.connect()
    protocol.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # type: ignore[attr-defined]
    assert b"200 OK" in transport.value()
    transport.clear()
    h.clock.advance(74)
    assert not transport.disconnecting
    h.clock.advance(1)
    assert transport.disconnecting
    assert transport.value() == b""  # no 408: there is no request to answer
    assert h.closed("idle_timeout") == 1


def test_the_next_requests_header_deadline_runs_from_its_first_byte() -> None:
    h = Harness()
    protocol, transport = h.connect()
    protocol.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # type: ignore[attr-defined]
    h.clock.advance(70)
    protocol.dataReceived(b"G")  # type: ignore[attr-defined]
    h.clock.advance(29)
    assert not transport.disconnecting  # neither idle (75 s) nor headers (30 s from the "G")
    h.clock.advance(1)
    assert transport.disconnecting
    assert h.closed("header_timeout") == 1
    assert h.closed("idle_timeout") == 0


def test_a_request_being_answered_is_not_cut_by_any_limit() -> None:
    """A long-poll held for ten minutes: no limit runs while the server answers. Once answered,
    the keep-alive limit starts."""
    h = Harness()
    protocol, transport = h.connect()
    protocol.dataReceived(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")  # type: ignore[attr-defined]
    h.clock.advance(600)
    assert not transport.disconnecting
    request = h.root.held.pop()
    request.write(b"late")
    request.finish()
    assert b"late" in transport.value()
    h.clock.advance(75)
    assert transport.disconnecting
    assert [h.closed(reason) for reason in CONNECTION_LIMIT_REASONS] == [0, 0, 1, 0]


def test_the_per_ip_cap_refuses_the_extra_connection_and_a_closed_one_frees_its_slot() -> None:
    h = Harness()
    first, first_transport = h.connect()
    _, second_transport = h.connect()
    _, third_transport = h.connect()
    assert third_transport.disconnected
    assert not first_transport.disconnecting and not second_transport.disconnecting
    assert h.closed("per_ip_cap") == 1
    _, other_address = h.connect("10.0.0.2")  # another address has its own slots
    assert not other_address.disconnecting
    assert h.open_connections() == 3
    lose(first)
    assert h.open_connections() == 2
    _, fourth_transport = h.connect()
    assert not fourth_transport.disconnecting
    assert h.closed("per_ip_cap") == 1


def test_a_connection_closed_by_a_timeout_frees_its_slot_once() -> None:
    h = Harness()
    protocol, _ = h.connect()
    h.connect()
    h.clock.advance(30)  # both time out; the first's loss is reported (twice, as Twisted may)
    lose(protocol)
    lose(protocol)
    _, transport = h.connect()
    assert not transport.disconnecting


def test_loopback_is_exempt_by_default_and_capped_when_the_list_leaves_it_out() -> None:
    capped = Harness(ConnectionLimitsConfig(max_connections_per_ip=1, exempt_ranges=()))
    capped.connect("127.0.0.1")
    assert capped.connect("127.0.0.1")[1].disconnected
    exempt = Harness(ConnectionLimitsConfig(max_connections_per_ip=1))
    exempt.connect("127.0.0.1")
    assert not exempt.connect("127.0.0.1")[1].disconnecting
    assert exempt.connect("10.0.0.1")[1].disconnecting is False
    assert exempt.connect("10.0.0.1")[1].disconnected


def test_a_cap_of_zero_counts_nothing() -> None:
    h = Harness(ConnectionLimitsConfig(max_connections_per_ip=0))
    transports = [h.connect()[1] for _ in range(50)]
    assert not any(t.disconnecting for t in transports)
    assert h.closed("per_ip_cap") == 0
