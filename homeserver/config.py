"""Load homeserver.yaml into typed, immutable config objects.

This is the only place that reads configuration: the loaded ``HomeserverConfig``
is passed down to whatever needs it, and nothing reads the environment after
start-up. Every section is a frozen attrs class with a default for every key;
unknown keys are errors, and every error names the dotted key path, the bad
value and what was expected.
"""

# tests: tests/unit/test_config.py

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs
import yaml

from federation_sender.config import BackoffConfig, CatchUpConfig, FederationSenderConfig
from homeserver.appservice.config import DEFAULT_APP_SERVICE_BACKOFF, AppServiceSenderConfig
from homeserver.appservice.registration import AppService, Namespace
from homeserver.media.config import MediaConfig, RateLimitSpec, UrlPreviewConfig
from homeserver.media.rules import ThumbnailSpec
from replication.config import DEFAULT_REDIS_URL, RedisConfig, ReplicationConfig
from storage.config import EMBEDDED_BINARIES, DatabaseConfig, EmbeddedDatabaseConfig

T = TypeVar("T")

LISTENER_TYPES: Final = ("http", "metrics", "replication")
HTTP_RESOURCES: Final = ("client", "federation", "keys", "replication", "health", "admin")
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS: Final = ("text", "json")


class ConfigError(Exception):
    """A configuration value is missing, of the wrong type, or out of range."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


# --- value checkers: each takes the dotted path and the raw value ---------------


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _expect_mapping(path: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {_describe(key)}")
    return value


def _expect_str(path: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a non-empty string, got {_describe(value)}")
    return value


def _expect_bool(path: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {_describe(value)}")
    return value


def _expect_int(path: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(path, f"expected an integer {low}-{high}, got {_describe(value)}")
    return value


def _expect_positive_number(path: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(path, f"expected a positive number, got {_describe(value)}")
    return float(value)


def _expect_choice(path: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(path, f"expected one of {', '.join(choices)}, got {_describe(value)}")
    assert isinstance(value, str)
    return value


def _expect_list(path: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list, got {_describe(value)}")
    return value


_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(path: str, value: object) -> timedelta:
    """Parse "500ms", "30s", "10m", "1h", "7d" or "2w"; a unit is required."""
    if isinstance(value, str):
        match = _DURATION_RE.match(value.strip())
        if match:
            return timedelta(seconds=float(match.group(1)) * _DURATION_UNITS[match.group(2)])
    raise ConfigError(
        path, f"expected a duration with a unit (e.g. '30s', '10m', '1h'), got {_describe(value)}"
    )


def _positive_duration(p: str, v: object) -> timedelta:
    value = parse_duration(p, v)
    if value <= timedelta(0):
        raise ConfigError(p, f"expected a positive duration, got {_describe(v)}")
    return value


_SERVER_NAME_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+)(:\d{1,5})?$")


def _expect_server_name(path: str, value: object) -> str:
    name = _expect_str(path, value)
    match = _SERVER_NAME_RE.match(name)
    if not match or len(name) > 230:
        raise ConfigError(path, f"expected a server name such as 'example.org' or 'localhost:8448', got {_describe(value)}")
    if match.group(2) and not 1 <= int(match.group(2)[1:]) <= 65535:
        raise ConfigError(path, f"port in server name must be 1-65535, got {_describe(value)}")
    return name


def _expect_ip(path: str, value: object) -> str:
    text = _expect_str(path, value)
    try:
        ip_address(text)
    except ValueError:
        raise ConfigError(path, f"expected an IP address, got {_describe(value)}") from None
    return text


class _Section:
    """Reads the keys of one mapping, remembering which were used."""

    def __init__(self, path: str, raw: object) -> None:
        self.path = path
        self.raw = _expect_mapping(path or "(top level)", {} if raw is None else raw)
        self.used: set[str] = set()

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, check: Callable[[str, Any], T], default: T) -> T:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            return default
        return check(self.sub(key), self.raw[key])

    def require(self, key: str, check: Callable[[str, Any], T]) -> T:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(self.sub(key), "is required")
        return check(self.sub(key), self.raw[key])

    def finish(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            raise ConfigError(self.sub(unknown[0]), "unknown key")


# --- sections --------------------------------------------------------------------



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


@attrs.frozen
class ListenerConfig:
    type: str
    port: int
    bind_addresses: tuple[str, ...] = ("127.0.0.1",)
    tls: bool = False
    resources: tuple[str, ...] = ()
    connection_limits: ConnectionLimitsConfig = ConnectionLimitsConfig()


def _connection_limits(path: str, raw: object) -> ConnectionLimitsConfig:
    s = _Section(path, raw)
    d = ConnectionLimitsConfig()
    result = ConnectionLimitsConfig(
        header_timeout=s.get("header_timeout", _positive_duration, d.header_timeout),
        body_timeout=s.get("body_timeout", _positive_duration, d.body_timeout),
        idle_timeout=s.get("idle_timeout", _positive_duration, d.idle_timeout),
        max_connections_per_ip=s.get("max_connections_per_ip", lambda p, v: _expect_int(p, v, 0, 1_000_000),
                                     d.max_connections_per_ip),
        exempt_ranges=s.get("exempt_ranges", _cidrs, d.exempt_ranges),
    )
    s.finish()
    return result


def _listener(path: str, raw: object) -> ListenerConfig:
    s = _Section(path, raw)
    kind = s.require("type", lambda p, v: _expect_choice(p, v, LISTENER_TYPES))
    port = s.require("port", lambda p, v: _expect_int(p, v, 1, 65535))
    binds: tuple[str, ...] = s.get(
        "bind_addresses",
        lambda p, v: tuple(_expect_ip(f"{p}[{i}]", a) for i, a in enumerate(_expect_list(p, v))),
        ("127.0.0.1",),
    )
    if not binds:
        raise ConfigError(s.sub("bind_addresses"), "expected at least one address")
    tls = s.get("tls", _expect_bool, False)
    limits = s.get("connection_limits", _connection_limits, ConnectionLimitsConfig())
    if kind == "replication" and "connection_limits" in s.raw:
        raise ConfigError(s.sub("connection_limits"), "only http and metrics listeners have connection limits")
    default_resources: tuple[str, ...] = ("client", "health") if kind == "http" else ()
    resources: tuple[str, ...] = s.get(
        "resources",
        lambda p, v: tuple(
            _expect_choice(f"{p}[{i}]", r, HTTP_RESOURCES) for i, r in enumerate(_expect_list(p, v))
        ),
        default_resources,
    )
    if kind != "http" and "resources" in s.raw:
        raise ConfigError(s.sub("resources"), f"only http listeners have resources, this one is {kind}")
    if kind != "http" and tls:
        raise ConfigError(s.sub("tls"), f"only http listeners can use TLS, this one is {kind}")
    s.finish()
    return ListenerConfig(type=kind, port=port, bind_addresses=binds, tls=tls, resources=resources,
                          connection_limits=limits)


DEFAULT_LISTENERS: Final = (
    ListenerConfig(type="http", port=8008, resources=("client", "health")),
)


def _database(path: str, raw: object) -> DatabaseConfig:
    s = _Section(path, raw)

    def url(p: str, v: object) -> str:
        text = _expect_str(p, v)
        if not text.startswith(("postgresql://", "postgres://")):
            raise ConfigError(p, f"expected a postgresql:// URL, got {_describe(v)}")
        return text

    def embedded(p: str, v: object) -> EmbeddedDatabaseConfig:
        e = _Section(p, v)
        binaries = e.get("binaries", lambda q, b: _expect_choice(q, b, EMBEDDED_BINARIES), "wheel")
        e.finish()
        return EmbeddedDatabaseConfig(binaries=binaries)

    result = DatabaseConfig(
        url=s.get("url", url, None),
        min_connections=s.get("min_connections", lambda p, v: _expect_int(p, v, 1, 100), 1),
        max_connections=s.get("max_connections", lambda p, v: _expect_int(p, v, 1, 1000), 10),
        embedded=s.get("embedded", embedded, EmbeddedDatabaseConfig()),
    )
    if result.min_connections > result.max_connections:
        raise ConfigError(
            s.sub("min_connections"),
            f"must not exceed max_connections ({result.max_connections}), got {result.min_connections}",
        )
    s.finish()
    return result


def _redis(path: str, raw: object) -> RedisConfig:
    s = _Section(path, raw)

    def url(p: str, v: object) -> str:
        text = _expect_str(p, v)
        if not text.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(p, f"expected a redis://, rediss:// or unix:// URL, got {_describe(v)}")
        return text

    result = RedisConfig(enabled=s.get("enabled", _expect_bool, False), url=s.get("url", url, DEFAULT_REDIS_URL))
    s.finish()
    return result


@attrs.frozen
class ServerNoticesConfig:
    """``server_notices``: who sends admin notices (``/_synapse/admin/v1/send_server_notice``)."""

    system_mxid_localpart: str
    system_mxid_display_name: str | None = None
    room_name: str = "Server Notices"


def _server_notices(path: str, raw: object) -> ServerNoticesConfig:
    s = _Section(path, raw)

    def localpart(p: str, v: object) -> str:
        text = _expect_str(p, v)
        if not re.fullmatch(r"[a-z0-9._=/+-]+", text):
            raise ConfigError(p, f"expected a user ID localpart (a-z, 0-9, ._=-/+), got {_describe(v)}")
        return text

    result = ServerNoticesConfig(
        system_mxid_localpart=s.require("system_mxid_localpart", localpart),
        system_mxid_display_name=s.get("system_mxid_display_name", _expect_str, None),
        room_name=s.get("room_name", _expect_str, "Server Notices"),
    )
    s.finish()
    return result


@attrs.frozen
class FederationConfig:
    verify_certificates: bool = True
    ip_range_whitelist: tuple[str, ...] = ()
    # Notaries asked for a server's keys when the server itself does not answer.
    trusted_key_servers: tuple[str, ...] = ()
    # Joins of rooms over federation ask for partial state (send_join's ``omit_members``) and
    # fetch the members afterwards (docs/federation.md, "Partial-state joins").
    partial_state_joins: bool = True


def _cidrs(p: str, v: object) -> tuple[str, ...]:
    from ipaddress import ip_network

    out = []
    for i, item in enumerate(_expect_list(p, v)):
        text = _expect_str(f"{p}[{i}]", item)
        try:
            ip_network(text, strict=False)
        except ValueError:
            raise ConfigError(f"{p}[{i}]", f"expected an IP range such as '127.0.0.0/8', got {_describe(item)}") from None
        out.append(text)
    return tuple(out)


@attrs.frozen
class PushConfig:
    # Private and loopback ranges push gateways may be reached at anyway (refused by default:
    # a pusher's URL is any URL a user gives).
    ip_range_whitelist: tuple[str, ...] = ()


@attrs.frozen
class UserDirectoryConfig:
    # POST /user_directory/search finds every local user, not only those who share a room
    # with the searcher or are in a public room.
    search_all_users: bool = False


def _user_directory(path: str, raw: object) -> UserDirectoryConfig:
    s = _Section(path, raw)
    result = UserDirectoryConfig(search_all_users=s.get("search_all_users", _expect_bool, False))
    s.finish()
    return result


def _push(path: str, raw: object) -> PushConfig:
    s = _Section(path, raw)
    result = PushConfig(ip_range_whitelist=s.get("ip_range_whitelist", _cidrs, ()))
    s.finish()
    return result


def _federation(path: str, raw: object) -> FederationConfig:
    s = _Section(path, raw)
    cidrs = _cidrs

    def server_names(p: str, v: object) -> tuple[str, ...]:
        return tuple(_expect_server_name(f"{p}[{i}]", item) for i, item in enumerate(_expect_list(p, v)))

    result = FederationConfig(
        verify_certificates=s.get("verify_certificates", _expect_bool, True),
        ip_range_whitelist=s.get("ip_range_whitelist", cidrs, ()),
        trusted_key_servers=s.get("trusted_key_servers", server_names, ()),
        partial_state_joins=s.get("partial_state_joins", _expect_bool, True),
    )
    s.finish()
    return result


def _backoff(path: str, raw: object, defaults: BackoffConfig = BackoffConfig()) -> BackoffConfig:
    s = _Section(path, raw)

    def jitter(p: str, v: object) -> tuple[float, float]:
        items = _expect_list(p, v)
        if len(items) != 2:
            raise ConfigError(p, f"expected [low, high], got {_describe(v)}")
        low, high = (_expect_positive_number(f"{p}[{i}]", item) for i, item in enumerate(items))
        if low > high:
            raise ConfigError(p, f"low must not exceed high, got {_describe(v)}")
        return low, high

    result = BackoffConfig(
        initial=s.get("initial", parse_duration, defaults.initial),
        multiplier=s.get("multiplier", _expect_positive_number, defaults.multiplier),
        max=s.get("max", parse_duration, defaults.max),
        jitter=s.get("jitter", jitter, defaults.jitter),
    )
    if result.initial <= timedelta(0):
        raise ConfigError(s.sub("initial"), "expected a positive duration")
    if result.max < result.initial:
        raise ConfigError(s.sub("max"), f"must not be shorter than initial ({result.initial.total_seconds():g}s)")
    if result.multiplier < 1:
        raise ConfigError(s.sub("multiplier"), f"expected a number >= 1, got {result.multiplier:g}")
    s.finish()
    return result


def _catch_up(path: str, raw: object) -> CatchUpConfig:
    s = _Section(path, raw)
    d = CatchUpConfig()
    result = CatchUpConfig(
        threshold=s.get("threshold", parse_duration, d.threshold),
        rooms_per_batch=s.get("rooms_per_batch", lambda p, v: _expect_int(p, v, 1, 1000), d.rooms_per_batch),
        missed_events_per_room=s.get(
            "missed_events_per_room", lambda p, v: _expect_int(p, v, 0, 1000), d.missed_events_per_room
        ),
        wakes_per_second=s.get("wakes_per_second", _expect_positive_number, d.wakes_per_second),
        scan_interval=s.get("scan_interval", parse_duration, d.scan_interval),
    )
    if result.scan_interval <= timedelta(0):
        raise ConfigError(s.sub("scan_interval"), "expected a positive duration")
    s.finish()
    return result


def _federation_sender(path: str, raw: object) -> FederationSenderConfig:
    s = _Section(path, raw)
    d = FederationSenderConfig()
    result = FederationSenderConfig(
        max_pdus_per_transaction=s.get(
            "max_pdus_per_transaction", lambda p, v: _expect_int(p, v, 1, 50), d.max_pdus_per_transaction
        ),
        max_edus_per_transaction=s.get(
            "max_edus_per_transaction", lambda p, v: _expect_int(p, v, 1, 100), d.max_edus_per_transaction
        ),
        transaction_timeout=s.get("transaction_timeout", parse_duration, d.transaction_timeout),
        max_concurrent_transactions=s.get(
            "max_concurrent_transactions", lambda p, v: _expect_int(p, v, 1, 100_000), d.max_concurrent_transactions
        ),
        max_pending_pdus_per_destination=s.get(
            "max_pending_pdus_per_destination",
            lambda p, v: _expect_int(p, v, 1, 10_000_000),
            d.max_pending_pdus_per_destination,
        ),
        receipt_delay=s.get("receipt_delay", parse_duration, d.receipt_delay),
        backoff=s.get("backoff", _backoff, d.backoff),
        catch_up=s.get("catch_up", _catch_up, d.catch_up),
    )
    if result.transaction_timeout <= timedelta(0):
        raise ConfigError(s.sub("transaction_timeout"), "expected a positive duration")
    s.finish()
    return result


def _replication(path: str, raw: object, *, redis: RedisConfig, allow_unauthenticated: bool) -> ReplicationConfig:
    """The ``replication`` section, joined with the already parsed ``redis`` section and
    ``allow_unauthenticated_replication`` into replication's one settings object."""
    s = _Section(path, raw)
    defaults = ReplicationConfig()
    result = ReplicationConfig(
        keepalive_interval=s.get("keepalive_interval", parse_duration, defaults.keepalive_interval),
        timeout=s.get("timeout", parse_duration, defaults.timeout),
        max_outbound_buffer=s.get(
            "max_outbound_buffer", lambda p, v: _expect_int(p, v, 1, 10_000_000), defaults.max_outbound_buffer
        ),
        redis=redis,
        allow_unauthenticated=allow_unauthenticated,
    )
    if result.keepalive_interval <= timedelta(0):
        raise ConfigError(s.sub("keepalive_interval"), "expected a positive duration")
    if result.timeout <= result.keepalive_interval:
        raise ConfigError(
            s.sub("timeout"),
            f"must be longer than keepalive_interval ({result.keepalive_interval.total_seconds():g}s), "
            f"got {result.timeout.total_seconds():g}s",
        )
    s.finish()
    return result


@attrs.frozen
class RateLimit:
    """One token bucket: ``burst_count`` actions at once, refilled at ``per_second``."""

    per_second: float
    burst_count: int


def _rate_limit(default: RateLimit) -> Callable[[str, object], RateLimit]:
    def parse(path: str, raw: object) -> RateLimit:
        s = _Section(path, raw)
        result = RateLimit(
            per_second=s.get("per_second", _expect_positive_number, default.per_second),
            burst_count=s.get("burst_count", lambda p, v: _expect_int(p, v, 1, 1_000_000), default.burst_count),
        )
        s.finish()
        return result

    return parse


@attrs.frozen
class LoginRateLimits:
    """``rc_login``: every attempt per client address and per account, and failed attempts per account."""

    address: RateLimit = RateLimit(0.003, 5)
    account: RateLimit = RateLimit(0.003, 5)
    failed_attempts: RateLimit = RateLimit(0.17, 3)


@attrs.frozen
class JoinRateLimits:
    """``rc_joins``: joins to rooms this server is in (local) and rooms it must join over federation (remote)."""

    local: RateLimit = RateLimit(0.1, 10)
    remote: RateLimit = RateLimit(0.01, 10)


@attrs.frozen
class InviteRateLimits:
    """``rc_invites``: invites into one room, to one user, and by one sender; ``per_origin``:
    invites arriving over federation from one server (``per_user`` applies to those too)."""

    per_room: RateLimit = RateLimit(0.3, 10)
    per_user: RateLimit = RateLimit(0.003, 5)
    per_issuer: RateLimit = RateLimit(0.3, 10)
    per_origin: RateLimit = RateLimit(0.3, 20)


def _grouped_rate_limits(cls: type[T]) -> Callable[[str, object], T]:
    """A parser for a section whose keys are each a ``{per_second, burst_count}`` mapping."""

    def parse(path: str, raw: object) -> T:
        s = _Section(path, raw)
        defaults = cls()
        values = {
            field.name: s.get(field.name, _rate_limit(getattr(defaults, field.name)), getattr(defaults, field.name))
            for field in attrs.fields(cls)  # type: ignore[arg-type]
        }
        s.finish()
        return cls(**values)

    return parse



@attrs.frozen
class FederationLimitsConfig:
    """``federation_limits``: how long each step of an outbound request may take, and the bounds
    on inbound key queries, remote profile/alias lookups and gap filling (docs/configuration.md)."""

    dns_timeout: timedelta = timedelta(seconds=10)
    well_known_timeout: timedelta = timedelta(seconds=10)
    connect_timeout: timedelta = timedelta(seconds=10)
    tls_timeout: timedelta = timedelta(seconds=10)
    request_timeout: timedelta = timedelta(seconds=60)
    body_timeout: timedelta = timedelta(seconds=30)
    key_fetch_timeout: timedelta = timedelta(seconds=15)
    key_query_timeout: timedelta = timedelta(seconds=30)
    key_query_max_servers: int = 100
    max_concurrent_fetches: int = 10
    rc_key_query: RateLimit = RateLimit(1.0, 20)
    query_cache_ttl: timedelta = timedelta(minutes=5)
    query_cache_size: int = 10_000
    missing_events_max: int = 100
    rc_missing_events: RateLimit = RateLimit(1.0, 50)


def _federation_limits(path: str, raw: object) -> FederationLimitsConfig:
    s, d = _Section(path, raw), FederationLimitsConfig()
    values: dict[str, Any] = {}
    for field in attrs.fields(FederationLimitsConfig):
        default = getattr(d, field.name)
        if isinstance(default, timedelta):
            values[field.name] = s.get(field.name, parse_duration, default)
            if values[field.name] <= timedelta(0):
                raise ConfigError(s.sub(field.name), "expected a positive duration")
        elif isinstance(default, RateLimit):
            values[field.name] = s.get(field.name, _rate_limit(default), default)
        else:
            values[field.name] = s.get(field.name, lambda p, v: _expect_int(p, v, 1, 10_000_000), default)
    s.finish()
    return FederationLimitsConfig(**values)


_SIZE_RE = re.compile(r"^(\d+)\s*([KMG]?)B?$", re.I)
_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(path: str, value: object) -> int:
    """A byte count: an integer, or a string such as "512K", "50M", "1G" (powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value.strip())
        if match and int(match.group(1)) > 0:
            return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    raise ConfigError(path, f"expected a positive size in bytes (e.g. 1048576, '512K', '50M'), got {_describe(value)}")


def _optional_duration(p: str, v: object) -> timedelta | None:
    """A positive duration, or the string "never" (None)."""
    if v == "never":
        return None
    return _positive_duration(p, v)


def _media(path: str, raw: object, path_value: Callable[[str, object], Path]) -> MediaConfig:
    s, d = _Section(path, raw), MediaConfig()

    def sizes(p: str, v: object) -> tuple[ThumbnailSpec, ...]:
        out = []
        for i, item in enumerate(_expect_list(p, v)):
            t = _Section(f"{p}[{i}]", item)
            spec = ThumbnailSpec(
                width=t.require("width", lambda q, x: _expect_int(q, x, 1, 4096)),
                height=t.require("height", lambda q, x: _expect_int(q, x, 1, 4096)),
                method=t.get("method", lambda q, x: _expect_choice(q, x, ("crop", "scale")), "scale"),
            )
            t.finish()
            out.append(spec)
        if not out:
            raise ConfigError(p, "expected at least one thumbnail size")
        return tuple(out)

    def rate(p: str, v: object) -> RateLimitSpec:
        r = _Section(p, v)
        result = RateLimitSpec(
            per_second=r.get("per_second", _expect_positive_number, d.rc_upload.per_second),
            burst_count=r.get("burst_count", lambda q, x: _expect_int(q, x, 1, 1_000_000), d.rc_upload.burst_count),
        )
        r.finish()
        return result

    def preview(p: str, v: object) -> UrlPreviewConfig:
        u, ud = _Section(p, v), UrlPreviewConfig()
        result = UrlPreviewConfig(
            enabled=u.get("enabled", _expect_bool, ud.enabled),
            ip_range_blacklist=u.get("ip_range_blacklist", _cidrs, ud.ip_range_blacklist),
            ip_range_whitelist=u.get("ip_range_whitelist", _cidrs, ud.ip_range_whitelist),
            max_spider_size=u.get("max_spider_size", parse_size, ud.max_spider_size),
            timeout=u.get("timeout", _positive_duration, ud.timeout),
            cache_duration=u.get("cache_duration", _positive_duration, ud.cache_duration),
        )
        u.finish()
        return result

    result = MediaConfig(
        store_path=s.get("store_path", path_value, None),
        max_upload_size=s.get("max_upload_size", parse_size, d.max_upload_size),
        max_image_pixels=s.get("max_image_pixels", lambda p, v: _expect_int(p, v, 1, 1_000_000_000),
                               d.max_image_pixels),
        thumbnail_sizes=s.get("thumbnail_sizes", sizes, d.thumbnail_sizes),
        dynamic_thumbnails=s.get("dynamic_thumbnails", _expect_bool, d.dynamic_thumbnails),
        rc_upload=s.get("rc_upload", rate, d.rc_upload),
        max_pending_uploads=s.get("max_pending_uploads", lambda p, v: _expect_int(p, v, 1, 10_000),
                                  d.max_pending_uploads),
        unused_expiration_time=s.get("unused_expiration_time", _positive_duration, d.unused_expiration_time),
        max_remote_media_size=s.get("max_remote_media_size", parse_size, d.max_remote_media_size),
        remote_media_timeout=s.get("remote_media_timeout", _positive_duration, d.remote_media_timeout),
        remote_media_lifetime=s.get("remote_media_lifetime", _optional_duration, d.remote_media_lifetime),
        local_media_lifetime=s.get("local_media_lifetime", _optional_duration, d.local_media_lifetime),
        url_preview=s.get("url_preview", preview, d.url_preview),
        freeze_unauthenticated_media=s.get("freeze_unauthenticated_media", _expect_bool,
                                           d.freeze_unauthenticated_media),
    )
    s.finish()
    return result


# Worker roles the launcher knows (issue 9 makes them pluggable; the names are fixed here).
WORKER_APPS: Final = ("generic", "event_persister", "federation_sender", "background", "media_repository",
                      "pusher", "appservice")
# Streams whose writer is configurable in ``stream_writers``.
WRITABLE_STREAMS: Final = ("events", "typing", "receipts", "presence", "to_device", "account_data")
MAIN_INSTANCE: Final = "master"
_INSTANCE_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@attrs.frozen
class InstanceLocation:
    """``instance_map.NAME``: where a process's internal HTTP replication listener is."""

    host: str
    port: int


@attrs.frozen
class WorkerConfig:
    """``workers.NAME``: one worker process's role and listeners."""

    app: str
    listeners: tuple[ListenerConfig, ...] = ()


def _instance_name(path: str, value: object) -> str:
    text = _expect_str(path, value)
    if not _INSTANCE_NAME_RE.match(text):
        raise ConfigError(path, f"expected an instance name of letters, digits, '_', '.' or '-', got {_describe(value)}")
    return text


def _instance_names(path: str, value: object) -> tuple[str, ...]:
    names = tuple(_instance_name(f"{path}[{i}]", item) for i, item in enumerate(_expect_list(path, value)))
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"{path}[{i}]", f"{name!r} is listed twice")
    return names


def _instance_map(path: str, raw: object) -> dict[str, InstanceLocation]:
    out = {}
    for name, item in _expect_mapping(path, raw).items():
        key = f"{path}.{name}"
        _instance_name(key, name)
        s = _Section(key, item)
        out[name] = InstanceLocation(
            host=s.require("host", _expect_str), port=s.require("port", lambda p, v: _expect_int(p, v, 1, 65535))
        )
        s.finish()
    return out


def _stream_writers(path: str, raw: object) -> dict[str, tuple[str, ...]]:
    out = {}
    for stream, writers in _expect_mapping(path, raw).items():
        if stream not in WRITABLE_STREAMS:
            raise ConfigError(f"{path}.{stream}", f"unknown stream; expected one of {', '.join(WRITABLE_STREAMS)}")
        names = _instance_names(f"{path}.{stream}", writers)
        if not names:
            raise ConfigError(f"{path}.{stream}", "expected at least one writer")
        if stream != "events" and len(names) > 1:
            raise ConfigError(f"{path}.{stream}", f"only the events stream can have several writers, got {len(names)}")
        out[stream] = names
    return out


def _workers(path: str, raw: object) -> dict[str, WorkerConfig]:
    out = {}
    for name, item in _expect_mapping(path, raw).items():
        key = f"{path}.{name}"
        _instance_name(key, name)
        if name == MAIN_INSTANCE:
            raise ConfigError(key, f"{MAIN_INSTANCE!r} is the main process's name; give the worker another")
        s = _Section(key, item)
        out[name] = WorkerConfig(
            app=s.require("app", _worker_app),
            listeners=s.get(
                "listeners", lambda p, v: tuple(_listener(f"{p}[{i}]", x) for i, x in enumerate(_expect_list(p, v))), ()
            ),
        )
        s.finish()
    return out

# Where worker roles are installed (workers/roles.py declares the shipped ones; homeserver/roles.py loads them).
ENTRY_POINT_GROUP: Final = "tributary.workers"


def known_roles() -> list[str]:
    """The names of the worker roles installed in the ``tributary.workers`` entry-point group."""
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def _worker_app(path: str, value: object) -> str:
    """A worker role installed in the ``tributary.workers`` entry-point group (workers/roles.py)."""
    name = _expect_str(path, value)
    known = known_roles() or list(WORKER_APPS)
    if name not in known:
        raise ConfigError(path, f"unknown worker app {name!r}; installed roles: {', '.join(known)}")
    return name


def _check_worker_layout(config: HomeserverConfig) -> None:
    """Refuse layouts that cannot work: a writer nobody can reach, a sender that is not a
    sender, several writers without Redis, two senders of the same traffic."""
    processes = {MAIN_INSTANCE, *config.workers}
    for stream, writers in config.stream_writers.items():
        for i, writer in enumerate(writers):
            key = f"stream_writers.{stream}[{i}]"
            if writer not in processes:
                raise ConfigError(key, f"{writer!r} is neither the main process nor a worker in 'workers'")
            if writer not in config.instance_map and (writer != MAIN_INSTANCE or len(processes) > 1):
                raise ConfigError(key, f"{writer!r} writes {stream} but is missing from instance_map")
    all_writers = {w for ws in config.stream_writers.values() for w in ws}
    if any(stream not in config.stream_writers for stream in WRITABLE_STREAMS):
        all_writers.add(MAIN_INSTANCE)  # it writes the streams nobody else was given
    if len(all_writers) > 1 and not config.redis.enabled:
        raise ConfigError(
            "redis.enabled",
            f"streams are written by {len(all_writers)} processes ({', '.join(sorted(all_writers))}); "
            "replication between several writers needs Redis: set redis.enabled: true",
        )
    for i, name in enumerate(config.federation_sender_instances):
        worker = config.workers.get(name)
        if worker is None or worker.app != "federation_sender":
            raise ConfigError(
                f"federation_sender_instances[{i}]", f"{name!r} is not a worker with app: federation_sender"
            )
    if config.federation_sender_instances and config.send_federation:
        raise ConfigError(
            "send_federation",
            "federation_sender_instances are configured, so the main process must not send too: set send_federation: false",
        )
    if config.workers and not config.worker_replication_secret:
        raise ConfigError("worker_replication_secret", "workers are configured: set a shared secret for the internal API")
    if config.workers and config.database.url is None:
        raise ConfigError("database.url", "workers share one PostgreSQL database: set database.url "
                                          "(the embedded database serves a single process only)")
    media_workers = [name for name, worker in config.workers.items() if worker.app == "media_repository"]
    if len(media_workers) > 1:
        raise ConfigError(f"workers.{media_workers[1]}.app",
                          f"only one media_repository worker is supported, got {', '.join(media_workers)}")
    for name, worker in config.workers.items():
        if worker.app == "event_persister" and name not in config.stream_writers.get("events", ()):
            raise ConfigError(f"workers.{name}.app", f"{name!r} is an event_persister but not in stream_writers.events")
        if worker.app == "federation_sender" and name not in config.federation_sender_instances:
            raise ConfigError(
                f"workers.{name}.app", f"{name!r} is a federation_sender but not in federation_sender_instances"
            )
    pushers = sorted(name for name, worker in config.workers.items() if worker.app == "pusher")
    if len(pushers) > 1:
        # Each would deliver every notification: users would get every push twice.
        raise ConfigError(f"workers.{pushers[1]}.app", f"only one pusher worker may run; {', '.join(pushers)} are")
    senders = sorted(name for name, worker in config.workers.items() if worker.app == "appservice")
    if len(senders) > 1:
        # Each would send every transaction: services would get every event twice.
        raise ConfigError(f"workers.{senders[1]}.app",
                          f"only one appservice worker may run; {', '.join(senders)} are")
    if config.workers and MAIN_INSTANCE not in config.instance_map:
        raise ConfigError(
            "instance_map",
            f"workers are configured: add {MAIN_INSTANCE!r} (the main process's replication listener); "
            "workers forward to it the writes it owns (device lists, and every stream not given to a worker)",
        )
    for name, location in config.instance_map.items():
        if name not in processes:
            raise ConfigError(f"instance_map.{name}", f"{name!r} is neither the main process nor a worker in 'workers'")
        listeners = config.listeners if name == MAIN_INSTANCE else config.workers[name].listeners
        if not any(listener.type == "http" and listener.port == location.port and "replication" in listener.resources
                   for listener in listeners):
            where = "listeners" if name == MAIN_INSTANCE else f"workers.{name}.listeners"
            raise ConfigError(
                f"instance_map.{name}.port",
                f"{name!r} has no http listener with the replication resource on port {location.port} in {where}",
            )



@attrs.frozen
class HomeserverConfig:
    server_name: str
    data_dir: Path
    config_path: Path | None = None
    public_baseurl: str | None = None
    signing_key_path: Path | None = None
    tls_certificate_path: Path | None = None
    tls_private_key_path: Path | None = None
    listeners: tuple[ListenerConfig, ...] = DEFAULT_LISTENERS
    database: DatabaseConfig = DatabaseConfig()
    federation: FederationConfig = FederationConfig()
    federation_limits: FederationLimitsConfig = FederationLimitsConfig()
    push: PushConfig = PushConfig()
    user_directory: UserDirectoryConfig = UserDirectoryConfig()
    log_level: str = "INFO"
    log_format: str = "text"
    enable_registration: bool = False
    allow_guest_access: bool = False
    default_room_version: str = "12"
    shutdown_grace_period: timedelta = timedelta(seconds=10)
    bcrypt_rounds: int = 12
    rc_message: RateLimit = RateLimit(0.2, 10)
    rc_registration: RateLimit = RateLimit(0.17, 3)
    # Admin API requests per admin (docs/admin.md).
    rc_admin: RateLimit = RateLimit(10.0, 100)
    # Shared-secret registration (/_synapse/admin/v1/register): off unless set.
    registration_shared_secret: str | None = None
    # /register needs a registration token (m.login.registration_token) made with the admin API.
    registration_requires_token: bool = False
    # Server notices (docs/admin.md); None: off.
    server_notices: ServerNoticesConfig | None = None
    rc_login: LoginRateLimits = LoginRateLimits()
    rc_joins: JoinRateLimits = JoinRateLimits()
    rc_invites: InviteRateLimits = InviteRateLimits()
    # The ``replication`` and ``redis`` sections and ``allow_unauthenticated_replication``.
    replication: ReplicationConfig = ReplicationConfig()
    # Whether this process sends federation traffic (false when federation sender workers do).
    send_federation: bool = True
    federation_sender: FederationSenderConfig = FederationSenderConfig()
    # The worker layout (docs/workers.md): processes, where they listen, who writes what.
    worker_replication_secret: str | None = None
    instance_map: Mapping[str, InstanceLocation] = attrs.field(factory=dict)
    stream_writers: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    federation_sender_instances: tuple[str, ...] = ()
    workers: Mapping[str, WorkerConfig] = attrs.field(factory=dict)
    media: MediaConfig = MediaConfig()
    # ``app_service_config_files``: one registration per file (docs/appservices.md).
    app_services: tuple[AppService, ...] = ()
    app_service_sender: AppServiceSenderConfig = AppServiceSenderConfig()

    @property
    def media_store_path(self) -> Path:
        """Where the local media storage provider keeps its files."""
        return self.media.store_path or self.data_dir / "media"

    @property
    def media_worker(self) -> str | None:
        """The ``media_repository`` worker, if the layout has one (it then serves all media)."""
        for name, worker in self.workers.items():
            if worker.app == "media_repository":
                return name
        return None

    @property
    def redis(self) -> RedisConfig:
        """The ``redis`` section (held by ``replication``, which uses it)."""
        return self.replication.redis

    @property
    def allow_unauthenticated_replication(self) -> bool:
        return self.replication.allow_unauthenticated

    @property
    def effective_signing_key_path(self) -> Path:
        return self.signing_key_path or self.data_dir / f"{_safe_file_name(self.server_name)}.signing.key"

    @property
    def effective_tls_certificate_path(self) -> Path:
        return self.tls_certificate_path or self.data_dir / f"{_safe_file_name(self.server_name)}.tls.crt"

    @property
    def effective_tls_private_key_path(self) -> Path:
        return self.tls_private_key_path or self.data_dir / f"{_safe_file_name(self.server_name)}.tls.key"


# --- application service registrations (docs/appservices.md) ------------------------------------

_AS_LOCALPART_RE = re.compile(r"^[a-z0-9._=/+\-]+$")


def _as_url(path: str, value: object) -> str:
    text = _expect_str(path, value)
    if not text.startswith(("http://", "https://")):
        raise ConfigError(path, f"expected an http:// or https:// URL or null, got {_describe(value)}")
    return text.rstrip("/")


def _as_namespaces(path: str, raw: object) -> tuple[Namespace, ...]:
    out = []
    for i, item in enumerate(_expect_list(path, raw)):
        s = _Section(f"{path}[{i}]", item)
        regex = s.require("regex", _expect_str)
        exclusive = s.require("exclusive", _expect_bool)
        s.finish()
        try:
            out.append(Namespace.of(regex, exclusive))
        except re.error as e:
            raise ConfigError(f"{path}[{i}].regex", f"not a valid regular expression ({e}): {_describe(regex)}") from e
    return tuple(out)


def _as_protocols(path: str, raw: object) -> tuple[str, ...]:
    return tuple(_expect_str(f"{path}[{i}]", item) for i, item in enumerate(_expect_list(path, raw)))


def parse_app_service(raw: object, *, server_name: str, source: str = "") -> AppService:
    """One registration file's YAML document; errors name the key (``namespaces.users[0].regex``)."""
    s = _Section("", raw)
    service_id = s.require("id", _expect_str)
    s.used.add("url")
    url = s.raw.get("url")
    if "url" not in s.raw:
        raise ConfigError("url", "is required (null when the service takes no transactions)")
    localpart = s.require("sender_localpart", _expect_str)
    if not _AS_LOCALPART_RE.match(localpart):
        raise ConfigError("sender_localpart", f"expected a user ID localpart (a-z, 0-9, ._=-/+), got {_describe(localpart)}")
    none: tuple[Namespace, ...] = ()
    ns = _Section("namespaces", s.get("namespaces", _expect_mapping, None))
    users = ns.get("users", _as_namespaces, none)
    aliases = ns.get("aliases", _as_namespaces, none)
    rooms = ns.get("rooms", _as_namespaces, none)
    ns.finish()
    ephemeral = s.get("receive_ephemeral", _expect_bool, False)
    ephemeral = s.get("de.sorunome.msc2409.push_ephemeral", _expect_bool, ephemeral)
    service = AppService(
        id=service_id,
        url=None if url is None else _as_url("url", url),
        as_token=s.require("as_token", _expect_str),
        hs_token=s.require("hs_token", _expect_str),
        sender=f"@{localpart}:{server_name}",
        users=users,
        aliases=aliases,
        rooms=rooms,
        rate_limited=s.get("rate_limited", _expect_bool, True),
        protocols=s.get("protocols", _as_protocols, ()),
        receive_ephemeral=ephemeral,
        receive_to_device=s.get("org.matrix.msc2409.receive_to_device", _expect_bool, False),
        device_masquerading=s.get("org.matrix.msc3202", _expect_bool, True),
        source=source,
    )
    # Other top-level keys are the bridge's own (heisenbridge's ``heisenbridge`` section, say):
    # left alone, as Synapse does, or the files bridges generate would not load. A namespace
    # entry, which is ours to read, refuses unknown keys.
    return service


def _app_service_sender(path: str, raw: object) -> AppServiceSenderConfig:
    s = _Section(path, raw)
    defaults = AppServiceSenderConfig()
    result = AppServiceSenderConfig(
        backoff=s.get("backoff", lambda p, v: _backoff(p, v, DEFAULT_APP_SERVICE_BACKOFF), defaults.backoff),
        max_events_per_transaction=s.get("max_events_per_transaction", lambda p, v: _expect_int(p, v, 1, 10_000),
                                         defaults.max_events_per_transaction),
        request_timeout=s.get("request_timeout", _positive_duration, defaults.request_timeout),
    )
    s.finish()
    return result


def _app_services(base: Path, server_name: str) -> Callable[[str, object], tuple[AppService, ...]]:
    def parse(path: str, value: object) -> tuple[AppService, ...]:
        services: list[AppService] = []
        for i, item in enumerate(_expect_list(path, value)):
            where = f"{path}[{i}]"
            name = Path(_expect_str(where, item)).expanduser()
            file = name if name.is_absolute() else base / name
            try:
                raw = yaml.load(file.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(where, f"cannot read application service registration {file}: {e}") from e
            except yaml.YAMLError as e:
                raise ConfigError(where, f"{file} is not valid YAML: {e}") from e
            try:
                service = parse_app_service(raw, server_name=server_name, source=str(file))
            except ConfigError as e:
                raise ConfigError(f"{where} ({file}): {e.path or '(top level)'}", e.message) from e
            for key in ("id", "as_token", "hs_token"):
                for other in services:
                    if getattr(other, key) == getattr(service, key):
                        raise ConfigError(f"{where} ({file}): {key}", f"the same {key} as {other.source}: each "
                                          "service needs its own")
            services.append(service)
        return tuple(services)

    return parse


def _safe_file_name(server_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.\-]", "_", server_name)


def _secret(path: str, value: object) -> str:
    text = _expect_str(path, value)
    if len(text) < 16:
        raise ConfigError(path, "expected a secret of at least 16 characters (e.g. from `openssl rand -hex 32`)")
    return text


def parse_config(raw: object, *, config_path: Path | None = None, data_dir_override: Path | None = None) -> HomeserverConfig:
    """Build a HomeserverConfig from the parsed YAML document; raises ConfigError."""
    s = _Section("", raw)
    base = config_path.parent if config_path else Path.cwd()

    def path_value(p: str, v: object) -> Path:
        candidate = Path(_expect_str(p, v)).expanduser()
        return candidate if candidate.is_absolute() else (base / candidate)

    def existing_file(p: str, v: object) -> Path:
        candidate = path_value(p, v)
        if not candidate.is_file():
            raise ConfigError(p, f"file not found: {candidate}")
        return candidate

    def listeners(p: str, v: object) -> tuple[ListenerConfig, ...]:
        items = tuple(_listener(f"{p}[{i}]", item) for i, item in enumerate(_expect_list(p, v)))
        seen: dict[tuple[str, int], int] = {}
        for i, listener in enumerate(items):
            for address in listener.bind_addresses:
                if (address, listener.port) in seen:
                    raise ConfigError(
                        f"{p}[{i}].port",
                        f"{address}:{listener.port} is already used by listeners[{seen[(address, listener.port)]}]",
                    )
                seen[(address, listener.port)] = i
        return items

    def baseurl(p: str, v: object) -> str:
        text = _expect_str(p, v)
        if not text.startswith(("http://", "https://")):
            raise ConfigError(p, f"expected an http:// or https:// URL, got {_describe(v)}")
        return text if text.endswith("/") else text + "/"

    def room_version(p: str, v: object) -> str:
        text = str(v) if isinstance(v, (int, str)) and not isinstance(v, bool) else None
        return _expect_choice(p, text, tuple(str(n) for n in range(1, 13)))

    server_name = s.require("server_name", _expect_server_name)
    data_dir = s.get("data_dir", path_value, base / "data")
    if data_dir_override is not None:
        data_dir = data_dir_override.resolve()

    redis = s.get("redis", _redis, RedisConfig())
    allow_unauthenticated = s.get("allow_unauthenticated_replication", _expect_bool, False)
    config = HomeserverConfig(
        server_name=server_name,
        data_dir=data_dir,
        config_path=config_path,
        public_baseurl=s.get("public_baseurl", baseurl, None),
        signing_key_path=s.get("signing_key_path", path_value, None),
        tls_certificate_path=s.get("tls_certificate_path", existing_file, None),
        tls_private_key_path=s.get("tls_private_key_path", existing_file, None),
        listeners=s.get("listeners", listeners, DEFAULT_LISTENERS),
        database=s.get("database", _database, DatabaseConfig()),
        federation=s.get("federation", _federation, FederationConfig()),
        federation_limits=s.get("federation_limits", _federation_limits, FederationLimitsConfig()),
        push=s.get("push", _push, PushConfig()),
        user_directory=s.get("user_directory", _user_directory, UserDirectoryConfig()),
        log_level=s.get("log_level", lambda p, v: _expect_choice(p, str(v).upper(), LOG_LEVELS), "INFO"),
        log_format=s.get("log_format", lambda p, v: _expect_choice(p, v, LOG_FORMATS), "text"),
        enable_registration=s.get("enable_registration", _expect_bool, False),
        allow_guest_access=s.get("allow_guest_access", _expect_bool, False),
        default_room_version=s.get("default_room_version", room_version, "12"),
        shutdown_grace_period=s.get("shutdown_grace_period", parse_duration, timedelta(seconds=10)),
        bcrypt_rounds=s.get("bcrypt_rounds", lambda p, v: _expect_int(p, v, 4, 31), 12),
        rc_message=s.get("rc_message", _rate_limit(RateLimit(0.2, 10)), RateLimit(0.2, 10)),
        rc_registration=s.get("rc_registration", _rate_limit(RateLimit(0.17, 3)), RateLimit(0.17, 3)),
        rc_admin=s.get("rc_admin", _rate_limit(RateLimit(10.0, 100)), RateLimit(10.0, 100)),
        registration_shared_secret=s.get("registration_shared_secret", _secret, None),
        registration_requires_token=s.get("registration_requires_token", _expect_bool, False),
        server_notices=s.get("server_notices", _server_notices, None),
        rc_login=s.get("rc_login", _grouped_rate_limits(LoginRateLimits), LoginRateLimits()),
        rc_joins=s.get("rc_joins", _grouped_rate_limits(JoinRateLimits), JoinRateLimits()),
        rc_invites=s.get("rc_invites", _grouped_rate_limits(InviteRateLimits), InviteRateLimits()),
        replication=s.get(
            "replication",
            lambda p, v: _replication(p, v, redis=redis, allow_unauthenticated=allow_unauthenticated),
            ReplicationConfig(redis=redis, allow_unauthenticated=allow_unauthenticated),
        ),
        send_federation=s.get("send_federation", _expect_bool, True),
        federation_sender=s.get("federation_sender", _federation_sender, FederationSenderConfig()),
        worker_replication_secret=s.get("worker_replication_secret", _expect_str, None),
        instance_map=s.get("instance_map", _instance_map, {}),
        stream_writers=s.get("stream_writers", _stream_writers, {}),
        federation_sender_instances=s.get("federation_sender_instances", _instance_names, ()),
        workers=s.get("workers", _workers, {}),
        media=s.get("media", lambda p, v: _media(p, v, path_value), MediaConfig()),
        app_services=s.get("app_service_config_files", _app_services(base, server_name), ()),
        app_service_sender=s.get("app_service_sender", _app_service_sender, AppServiceSenderConfig()),
    )
    _check_worker_layout(config)
    if not config.allow_unauthenticated_replication:
        for i, listener in enumerate(config.listeners):
            for address in listener.bind_addresses if listener.type == "replication" else ():
                if not ip_address(address).is_loopback:
                    raise ConfigError(
                        f"listeners[{i}].bind_addresses",
                        f"a replication listener on {address} would be reachable from other machines, and the "
                        "replication protocol has no authentication; bind it to 127.0.0.1, use Redis between "
                        "machines, or set allow_unauthenticated_replication: true",
                    )
    if (config.tls_certificate_path is None) != (config.tls_private_key_path is None):
        raise ConfigError("tls_certificate_path", "tls_certificate_path and tls_private_key_path must be set together")
    s.finish()
    return config


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping (two workers with one
    name, a listener option set twice): plain YAML would silently keep the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in the same mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: Path, *, data_dir_override: Path | None = None) -> HomeserverConfig:
    """Read and parse a YAML config file; raises ConfigError with a clear message."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("", f"cannot read config file {path}: {e}") from e
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError("", f"{path} is not valid YAML{where}: {problem}") from e
    if raw is None:
        raw = {}
    return parse_config(raw, config_path=path.resolve(), data_dir_override=data_dir_override)


def generate_config_text(server_name: str, data_dir: str, *, enable_registration: bool = True) -> str:
    """The commented homeserver.yaml that `tributary generate-config` writes."""
    _expect_server_name("server_name", server_name)
    return f"""\
# Tributary homeserver configuration. Every key is described in docs/configuration.md;
# anything left out takes its default.

# The name of this server: the part after the colon in user IDs (@alice:{server_name}).
# It cannot be changed once users and rooms exist.
server_name: "{server_name}"

# Where the signing key, the embedded database and other state live. Relative
# paths are relative to this file.
data_dir: "{data_dir}"

# The URL clients use to reach this server (advertised in /.well-known/matrix/client).
# public_baseurl: "https://matrix.example.org/"

# Database. With no url, Tributary runs a private PostgreSQL in data_dir, listening
# only on a Unix socket there. Point it at your own PostgreSQL for production:
# database:
#   url: "postgresql://tributary:secret@127.0.0.1:5432/tributary"
#   max_connections: 10

listeners:
  # The client-server API (and /health).
  - type: http
    port: 8008
    bind_addresses: ["127.0.0.1"]
    resources: [client, health]
  # Prometheus metrics.
  - type: metrics
    port: 9008
    bind_addresses: ["127.0.0.1"]

# Redis is needed only when worker processes are used.
redis:
  enabled: false
  # url: "redis://127.0.0.1:6379/0"

log_level: INFO

# Uploaded files and thumbnails live under data_dir/media (docs/media.md).
# media:
#   max_upload_size: 50M

# Anyone who can reach the client listener may create an account.
enable_registration: {"true" if enable_registration else "false"}
"""
