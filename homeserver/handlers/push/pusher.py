"""Delivery of notifications to push gateways: the pusher process's work.

One ``PusherPool`` runs in one process of a deployment (the ``pusher`` worker when the
config has one, else the main process: ``workers/pusher.py``). It follows the events
stream: each time the stream's position moves it reads, for each pusher with any (one
query), the notification records (``event_push_actions``, written by the events writer
with each event) above the pusher's ``last_stream_ordering`` and up to the stream's
position, and POSTs them one at
a time, oldest first, to the pusher's gateway (``data.url``, the push gateway API's
``/_matrix/push/v1/notify``). After each accepted push the pusher's position is stored,
so a restarted pool neither repeats nor skips a notification. Each pusher is handled by
one coroutine at a time, and up to ``MAX_CONCURRENT_PUSHERS`` pushers side by side, so a
slow gateway holds up only its own pushers.

- A gateway that fails (connection error, timeout, non-200) is retried with the backoff
  policy; later notifications wait behind the failed one (nothing is dropped).
- A gateway that answers ``{"rejected": [pushkey]}`` names a pushkey that will never work
  again: the pusher is removed.
- A read receipt (receipts stream) sends each pusher of its user a badge-only update with
  the new unread count (``counts.unread``, over all the user's rooms), after dropping the
  user's read notifications in that room that do not highlight (nothing needs them: they
  are not unread, and ``GET /notifications`` lists read ones only when they highlight).
- ``email`` pushers are stored and listed but not sent (no mailer is configured).
- Gateways in private, loopback and other special IP ranges are refused (the pusher's URL
  is any URL a user gave) unless ``push.ip_range_whitelist`` allows them.

The payload is built by pure functions (``notification_payload``, ``badge_payload``).
"""

# tests: tests/unit/handlers/test_pusher.py, tests/integration/test_push.py

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from io import BytesIO
from typing import Any, Final, Protocol

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import IProtocolFactory, IStreamClientEndpoint
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from homeserver.remote.client import IpFilter

from storage.kernel.background import run_in_background
from storage.kernel.backoff import BackoffPolicy
from storage.kernel.written_events import WrittenEvents, is_push
from storage.stores.push import Notification, PusherRow, PushStore

logger = logging.getLogger(__name__)

# Retries of a failing gateway: 1 s doubling (with jitter) up to 10 minutes.
PUSH_BACKOFF: Final = BackoffPolicy(initial=1.0, multiplier=2.0, maximum=600.0, jitter=(0.8, 1.2))
PUSH_TIMEOUT_S: Final = 20.0
BATCH: Final = 50
# Pushers delivered to at once (each one push at a time): a slow gateway holds up only its own.
MAX_CONCURRENT_PUSHERS: Final = 50
MAX_RESPONSE_BYTES: Final = 64 * 1024


# --- the payload (pure) ---------------------------------------------------------------------


def tweaks_of(actions: Any) -> dict[str, Any]:
    """The ``set_tweak`` actions as a ``tweaks`` object (``highlight`` without a value is true)."""
    tweaks: dict[str, Any] = {}
    for action in actions if isinstance(actions, list) else ():
        if isinstance(action, Mapping) and isinstance(action.get("set_tweak"), str):
            tweaks[action["set_tweak"]] = action.get("value", True if action["set_tweak"] == "highlight" else None)
    return tweaks


def _device(pusher: PusherRow, tweaks: Mapping[str, Any] | None) -> dict[str, Any]:
    data = json.loads(pusher.data_json)
    device: dict[str, Any] = {
        "app_id": pusher.app_id,
        "pushkey": pusher.pushkey,
        "pushkey_ts": pusher.created_ts // 1000,
        "data": {k: v for k, v in data.items() if k != "url"} if isinstance(data, dict) else {},
    }
    if tweaks is not None:
        device["tweaks"] = dict(tweaks)
    return device


def notification_payload(pusher: PusherRow, notification: Notification, event: Mapping[str, Any] | None,
                         unread: int) -> dict[str, Any]:
    """The body of ``POST /_matrix/push/v1/notify`` for one notification: the full format, or
    with ``data.format: event_id_only`` just the IDs, counts and devices (the spec's two forms)."""
    tweaks = tweaks_of(json.loads(notification.actions_json))
    data = json.loads(pusher.data_json)
    body: dict[str, Any] = {
        "event_id": notification.event_id,
        "room_id": notification.room_id,
        "counts": {"unread": unread},
        "prio": "high" if tweaks.get("sound") or tweaks.get("highlight") else "low",
        "devices": [_device(pusher, tweaks)],
    }
    if not (isinstance(data, dict) and data.get("format") == "event_id_only") and event is not None:
        body["id"] = notification.event_id  # the pre-spec name, which older gateways read
        body["type"] = event.get("type")
        body["sender"] = event.get("sender")
        if isinstance(event.get("content"), Mapping):
            body["content"] = event["content"]
        if event.get("type") == "m.room.member":
            body["user_is_target"] = event.get("state_key") == pusher.user_id
            body["membership"] = event.get("content", {}).get("membership")
    return {"notification": body}


def badge_payload(pusher: PusherRow, unread: int) -> dict[str, Any]:
    """A badge-only update (no event): the user's new unread count, after a read receipt."""
    return {"notification": {"id": "", "type": None, "sender": "", "counts": {"unread": unread},
                             "devices": [_device(pusher, None)]}}


def rejected_pushkeys(status: int, body: Any) -> list[str] | None:
    """The gateway's answer: the pushkeys it rejected, or None when it failed (retry)."""
    if status != 200:
        return None
    rejected = body.get("rejected", []) if isinstance(body, Mapping) else []
    return [k for k in rejected if isinstance(k, str)] if isinstance(rejected, list) else []


# --- metrics ---------------------------------------------------------------------------------


@attrs.frozen
class PusherMetrics:
    sent: Counter
    failed: Counter
    rejected: Counter
    badges: Counter
    latency: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> PusherMetrics:
        return cls(
            sent=Counter("tributary_push_notifications_sent_total",
                         "Notifications a push gateway accepted.", registry=registry),
            failed=Counter("tributary_push_notifications_failed_total",
                           "Attempts to push a notification that failed (each retry counts).", registry=registry),
            rejected=Counter("tributary_push_pushers_rejected_total",
                             "Pushers removed because their gateway rejected the pushkey.", registry=registry),
            badges=Counter("tributary_push_badge_updates_sent_total",
                           "Badge-only updates (after a read receipt) a push gateway accepted.", registry=registry),
            latency=Histogram("tributary_push_latency_seconds",
                              "From the event's notification record to its push being accepted.",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600), registry=registry),
        )


# --- the I/O ------------------------------------------------------------------------------------


class GatewayTransport(Protocol):
    """POSTs JSON; answers (status, parsed JSON or None). Raises on connection failure or timeout."""

    async def post(self, url: str, body: Mapping[str, Any]) -> tuple[int, Any]: ...


class GatewayBlocked(Exception):
    """The gateway's host is in the IP range blacklist (``push.ip_range_whitelist`` did not allow it)."""


@implementer(IStreamClientEndpoint)
class _FilteredEndpoint:
    """Connects to a gateway's host only at an address the IP filter allows: the name is
    resolved here and the connection made to that address, so DNS cannot point it elsewhere."""

    def __init__(self, reactor: Any, ip_filter: IpFilter, host: str, port: int, tls: bool, timeout: float) -> None:
        self._reactor = reactor
        self._filter = ip_filter
        self._host = host
        self._port = port
        self._tls = tls
        self._timeout = timeout

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._connect(protocolFactory))

    async def _connect(self, protocolFactory: IProtocolFactory) -> Any:
        host = self._host
        try:
            address = str(ipaddress.ip_address(host))
        except ValueError:
            address = str(await self._reactor.resolve(host))
        if not self._filter.allowed(address):
            raise GatewayBlocked(f"{host} resolves to {address}, which is in the IP range blacklist")
        endpoint_type = TCP6ClientEndpoint if ipaddress.ip_address(address).version == 6 else TCP4ClientEndpoint
        endpoint: IStreamClientEndpoint = endpoint_type(self._reactor, address, self._port, timeout=self._timeout)
        if self._tls:
            from twisted.internet import ssl  # pyOpenSSL costs start-up time; only https gateways need it

            endpoint = wrapClientTLS(ssl.optionsForClientTLS(host), endpoint)
        return await endpoint.connect(protocolFactory)


@implementer(IAgentEndpointFactory)
class _FilteredEndpoints:
    def __init__(self, reactor: Any, ip_filter: IpFilter, timeout: float) -> None:
        self._reactor = reactor
        self._filter = ip_filter
        self._timeout = timeout

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        host = uri.host.decode("idna").strip("[]")
        return _FilteredEndpoint(self._reactor, self._filter, host, uri.port, uri.scheme == b"https", self._timeout)


class HttpGatewayTransport:
    """POSTs to push gateways with Twisted's Agent, refusing hosts in the IP range blacklist
    (private, loopback and other special ranges, as outbound federation) unless
    ``ip_range_whitelist`` allows them: a pusher's URL is whatever a user gave."""

    def __init__(self, reactor: Any, *, ip_range_whitelist: tuple[str, ...] = (),
                 timeout: float = PUSH_TIMEOUT_S) -> None:
        self._reactor = reactor
        self._timeout = timeout
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._agent = Agent.usingEndpointFactory(
            reactor, _FilteredEndpoints(reactor, IpFilter(ip_range_whitelist), timeout=10.0), pool=self._pool)

    async def post(self, url: str, body: Mapping[str, Any]) -> tuple[int, Any]:
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        request: Deferred[Any] = self._agent.request(
            b"POST", url.encode("utf-8"), Headers({b"Content-Type": [b"application/json"],
                                                   b"User-Agent": [b"Tributary"]}),
            FileBodyProducer(BytesIO(payload)))
        request.addTimeout(self._timeout, self._reactor)
        response = await request
        read: Deferred[bytes] = readBody(response)
        read.addTimeout(self._timeout, self._reactor)
        raw = await read
        try:
            answer = json.loads(raw[:MAX_RESPONSE_BYTES]) if raw else None
        except ValueError:
            answer = None
        return int(response.code), answer

    async def close(self) -> None:
        await self._pool.closeCachedConnections()


EventLoader = Callable[[list[str]], Awaitable[Mapping[str, Mapping[str, Any]]]]


class PusherPool:
    """Delivers every pusher's notifications (see the module docstring)."""

    def __init__(self, *, store: PushStore, load_events: EventLoader, transport: GatewayTransport, clock: Any,
                 metrics: PusherMetrics, events_position: Callable[[], int],
                 receipts_position: Callable[[], int], backoff: BackoffPolicy = PUSH_BACKOFF,
                 written: WrittenEvents | None = None) -> None:
        self._store = store
        # What this process persisted: a range of events that notified no one with a pusher
        # needs no scan (``on_events_moved``); the position the last scan looked up to.
        self._written = written
        self._scanned_upto: int | None = None
        self._load_events = load_events
        self._transport = transport
        self._clock = clock
        self._metrics = metrics
        self._events_position = events_position
        self._receipts_position = receipts_position
        self._backoff = backoff
        # Pusher ID -> (failures in a row, clock time before which it is not tried).
        self._failing: dict[int, tuple[int, float]] = {}
        self._receipts_at = receipts_position()
        # The scan for pushers with something to send (one at a time; asked again while it
        # runs, it runs once more), and each pusher's delivery in progress (one per pusher).
        self._scanning: Deferred[None] | None = None
        self._again = False
        self._active: dict[int, Deferred[None]] = {}
        # Pusher ID -> the position this process delivered it up to: a scan may read a pusher's
        # row before a delivery that just ended stored its position; this is never older.
        self._delivered: dict[int, int] = {}
        self._badges_running: Deferred[None] | None = None
        self._badges_again = False
        self._stopping = False
        self._timers: list[Any] = []

    def start(self) -> None:
        self.on_new_events()

    def on_events_moved(self) -> None:
        """The events stream moved: scan, unless every new position was persisted by this process
        and notified no one with a pusher (then there is nothing new to deliver; a pusher created
        meanwhile by another process has its first notification delivered with its next one)."""
        upto = self._events_position()
        scanned = self._scanned_upto
        if (self._written is not None and scanned is not None and self._scanning is None
                and self._written.nothing_for(scanned, upto, is_push)):
            self._scanned_upto = max(scanned, upto)
            return
        self.on_new_events()

    def on_new_events(self) -> None:
        """The events stream moved (or a delivery ended): start delivering to every pusher with
        something new that is not already being delivered to nor backing off."""
        if self._stopping:
            return
        if self._scanning is not None:
            self._again = True
            return
        scan = run_in_background("pusher_scan", self._scan())
        self._scanning = None if scan.called else scan  # (a scan may end before it returns)

    def on_new_receipts(self) -> None:
        if self._stopping:
            return
        if self._badges_running is not None:
            self._badges_again = True
            return
        badges = run_in_background("pusher_badges", self._badges())
        self._badges_running = None if badges.called else badges

    def stop(self) -> Deferred[None]:
        """Start nothing more; the Deferred fires once the push in flight (if any) is recorded."""
        self._stopping = True
        for timer in self._timers:
            if timer.active():
                timer.cancel()
        self._timers.clear()
        waits = [d for d in (self._scanning, self._badges_running, *self._active.values()) if d is not None]

        async def drained() -> None:
            for d in waits:
                await d
            close = getattr(self._transport, "close", None)
            if close is not None:
                await close()

        return Deferred.fromCoroutine(drained())

    async def _scan(self) -> None:
        try:
            while not self._stopping:
                self._again = False
                upto = self._events_position()
                self._scanned_upto = upto
                now = self._clock.seconds()
                for pusher in await self._store.get_pushers_with_pending(upto):
                    if self._stopping or len(self._active) >= MAX_CONCURRENT_PUSHERS:
                        break
                    if pusher.id in self._active or self._failing.get(pusher.id, (0, 0.0))[1] > now:
                        continue
                    delivery = run_in_background("pusher_deliver", self._deliver_one(pusher, upto))
                    if not delivery.called:  # (one with nothing left to do ends at once)
                        self._active[pusher.id] = delivery
                if not self._again:
                    break
        finally:
            self._scanning = None

    async def _deliver_one(self, pusher: PusherRow, upto: int) -> None:
        try:
            await self._deliver(pusher, upto)
        finally:
            self._active.pop(pusher.id, None)
            # More may have come meanwhile, for this pusher or for one left out at the cap.
            self.on_new_events()

    async def _deliver(self, pusher: PusherRow, upto: int) -> None:
        after = max(pusher.last_stream_ordering, self._delivered.get(pusher.id, pusher.last_stream_ordering))
        while after < upto and not self._stopping:
            batch = await self._store.get_notifications_between(pusher.user_id, after, upto, BATCH)
            if not batch:
                return
            events = await self._load_events([n.event_id for n in batch])
            for notification in batch:
                if self._stopping:
                    return
                unread = await self._store.get_badge_count(pusher.user_id)
                body = notification_payload(pusher, notification, events.get(notification.event_id), unread)
                outcome = await self._post(pusher, body)
                if outcome == "rejected":
                    return
                if outcome == "failed":
                    return
                self._metrics.sent.inc()
                self._metrics.latency.observe(max(0.0, self._clock.seconds() - notification.received_ts / 1000))
                await self._store.advance_pusher(pusher.id, notification.stream_ordering, failing_since=None)
                self._delivered[pusher.id] = after = notification.stream_ordering
            if len(batch) < BATCH:
                return

    async def _post(self, pusher: PusherRow, body: Mapping[str, Any]) -> str:
        """"sent", "rejected" (the pusher is removed) or "failed" (retried after a backoff)."""
        url = json.loads(pusher.data_json).get("url", "")
        try:
            status, answer = await self._transport.post(url, body)
            rejected = rejected_pushkeys(status, answer)
            error = None if rejected is not None else f"HTTP {status}"
        except Exception as e:  # the adapter's edge: any transport failure is a failed attempt
            rejected, error = None, f"{type(e).__name__}: {e}"
        if rejected is None:
            self._metrics.failed.inc()
            failures = self._failing.get(pusher.id, (0, 0.0))[0] + 1
            delay = self._backoff.delay(failures)
            self._failing[pusher.id] = (failures, self._clock.seconds() + delay)
            logger.warning("[pusher %d] push to %s failed (%s); retry %d in %.1fs",
                           pusher.id, _host(url), error, failures, delay)
            if failures == 1:
                await self._store.set_pusher_failing(pusher.id, int(self._clock.seconds() * 1000))
            self._timers = [t for t in self._timers if t.active()]
            self._timers.append(self._clock.callLater(delay, self.on_new_events))
            return "failed"
        self._failing.pop(pusher.id, None)
        if pusher.pushkey in rejected:
            logger.info("[pusher %d] gateway %s rejected the pushkey of %s: pusher removed",
                        pusher.id, _host(url), pusher.user_id)
            self._metrics.rejected.inc()
            await self._store.delete_pusher_by_id(pusher.id)
            self._delivered.pop(pusher.id, None)
            return "rejected"
        return "sent"

    async def _badges(self) -> None:
        try:
            while not self._stopping:
                self._badges_again = False
                upto = self._receipts_position()
                if upto > self._receipts_at:
                    read = await self._store.get_read_receipts_after(self._receipts_at, upto)
                    self._receipts_at = upto
                    for user_id, room_id in read:
                        await self._store.prune_read(user_id, room_id)
                    readers = {user for user, _ in read}
                    if readers:
                        for pusher in await self._store.get_pushers_of(readers):
                            if not self._stopping:
                                unread = await self._store.get_badge_count(pusher.user_id)
                                if await self._post(pusher, badge_payload(pusher, unread)) == "sent":
                                    self._metrics.badges.inc()
                if not self._badges_again:
                    break
        finally:
            self._badges_running = None


def _host(url: str) -> str:
    """The gateway's host, for logs (a URL's path may carry secrets)."""
    return url.split("/")[2] if url.count("/") >= 2 else "?"
