"""Config parsing: defaults, every validation error naming its key path."""

from __future__ import annotations

import re

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from homeserver.config import (
    ConfigError,
    ListenerConfig,
    generate_config_text,
    load_config,
    parse_config,
    parse_duration,
)


def _parse(raw: dict[str, Any]) -> Any:
    return parse_config(raw, config_path=Path("/etc/tributary/homeserver.yaml"))


def test_minimal_config_takes_defaults() -> None:
    config = _parse({"server_name": "example.org"})
    assert config.server_name == "example.org"
    assert config.data_dir == Path("/etc/tributary/data")
    assert config.listeners == (ListenerConfig(type="http", port=8008, resources=("client", "health")),)
    assert config.database.url is None
    assert config.redis.enabled is False
    assert config.enable_registration is False
    assert config.allow_guest_access is False
    assert config.default_room_version == "12"
    assert config.effective_signing_key_path == Path("/etc/tributary/data/example.org.signing.key")


def test_full_config() -> None:
    config = _parse(
        {
            "server_name": "localhost:8448",
            "public_baseurl": "https://matrix.example.org",
            "database": {"url": "postgresql://u@h/db", "max_connections": 20},
            "listeners": [
                {"type": "http", "port": 8008, "resources": ["client"], "bind_addresses": ["0.0.0.0", "::"]},
                {"type": "metrics", "port": 9000},
                {"type": "replication", "port": 9093},
            ],
            "redis": {"enabled": True, "url": "rediss://:pw@redis:6380/1"},
            "federation": {"verify_certificates": False, "ip_range_whitelist": ["127.0.0.0/8"]},
            "log_level": "debug",
            "default_room_version": 11,
            "shutdown_grace_period": "30s",
        }
    )
    assert config.public_baseurl == "https://matrix.example.org/"
    assert config.database.max_connections == 20
    assert config.listeners[0].bind_addresses == ("0.0.0.0", "::")
    assert config.redis.url.startswith("rediss://")
    assert config.federation.ip_range_whitelist == ("127.0.0.0/8",)
    assert config.log_level == "DEBUG"
    assert config.default_room_version == "11"
    assert config.shutdown_grace_period == timedelta(seconds=30)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "server_name: is required"),
        ({"server_name": 5}, "server_name: expected a non-empty string, got 5"),
        ({"server_name": "bad name"}, "server_name: expected a server name"),
        ({"server_name": "h:99999"}, "server_name: port in server name must be 1-65535"),
        ({"server_name": "h", "surprise": 1}, "surprise: unknown key"),
        ({"server_name": "h", "listeners": {}}, "listeners: expected a list"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": "abc"}]},
         "listeners[0].port: expected an integer 1-65535, got 'abc'"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1}, {"type": "ftp", "port": 2}]},
         "listeners[1].type: expected one of http, metrics, replication, got 'ftp'"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1, "resources": ["client", "media"]}]},
         "listeners[0].resources[1]: expected one of"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1, "bind_addresses": ["nope"]}]},
         "listeners[0].bind_addresses[0]: expected an IP address, got 'nope'"),
        ({"server_name": "h", "listeners": [{"type": "metrics", "port": 1, "tls": True}]},
         "listeners[0].tls: only http listeners can use TLS"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1}, {"type": "metrics", "port": 1}]},
         "listeners[1].port: 127.0.0.1:1 is already used by listeners[0]"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1, "colour": "red"}]},
         "listeners[0].colour: unknown key"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1, "connection_limits": {"header_timeout": "30"}}]},
         "listeners[0].connection_limits.header_timeout: expected a duration with a unit"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1, "connection_limits": {"body_timeout": "0s"}}]},
         "listeners[0].connection_limits.body_timeout: expected a positive duration, got '0s'"),
        ({"server_name": "h", "listeners": [{"type": "metrics", "port": 1,
                                              "connection_limits": {"max_connections_per_ip": -1}}]},
         "listeners[0].connection_limits.max_connections_per_ip: expected an integer 0-1000000, got -1"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1,
                                              "connection_limits": {"exempt_ranges": ["127.0.0.1/99"]}}]},
         "listeners[0].connection_limits.exempt_ranges[0]: expected an IP range"),
        ({"server_name": "h", "listeners": [{"type": "http", "port": 1, "connection_limits": {"idle": "5s"}}]},
         "listeners[0].connection_limits.idle: unknown key"),
        ({"server_name": "h", "listeners": [{"type": "replication", "port": 1,
                                              "connection_limits": {"idle_timeout": "5s"}}]},
         "listeners[0].connection_limits: only http and metrics listeners have connection limits"),
        ({"server_name": "h", "database": {"url": "mysql://x"}}, "database.url: expected a postgresql:// URL"),
        ({"server_name": "h", "database": {"min_connections": 5, "max_connections": 2}},
         "database.min_connections: must not exceed max_connections (2), got 5"),
        ({"server_name": "h", "database": {"embedded": {"binaries": "docker"}}},
         "database.embedded.binaries: expected one of wheel, system"),
        ({"server_name": "h", "redis": {"enabled": "yes"}}, "redis.enabled: expected true or false, got 'yes'"),
        ({"server_name": "h", "federation": {"ip_range_whitelist": ["10.0.0.0/33"]}},
         "federation.ip_range_whitelist[0]: expected an IP range"),
        ({"server_name": "h", "push": {"ip_range_whitelist": ["nope"]}},
         "push.ip_range_whitelist[0]: expected an IP range"),
        ({"server_name": "h", "push": {"gateways": []}}, "push.gateways: unknown key"),
        ({"server_name": "h", "user_directory": {"search_all_users": "yes"}},
         "user_directory.search_all_users: expected"),
        ({"server_name": "h", "user_directory": {"prefer_local_users": True}},
         "user_directory.prefer_local_users: unknown key"),
        ({"server_name": "h", "log_level": "LOUD"}, "log_level: expected one of DEBUG"),
        ({"server_name": "h", "default_room_version": "13"}, "default_room_version: expected one of 1, 2, 3"),
        ({"server_name": "h", "shutdown_grace_period": 10}, "shutdown_grace_period: expected a duration with a unit"),
        ({"server_name": "h", "public_baseurl": "matrix.org"}, "public_baseurl: expected an http:// or https:// URL"),
        ({"server_name": "h", "enable_registration": 1}, "enable_registration: expected true or false, got 1"),
        ({"server_name": "h", "allow_guest_access": "yes"}, "allow_guest_access: expected true or false"),
        ({"server_name": "h", "federation_sender": {"max_pdus_per_transaction": 51}},
         "federation_sender.max_pdus_per_transaction: expected an integer 1-50, got 51"),
        ({"server_name": "h", "federation_sender": {"backoff": {"initial": "1h", "max": "10m"}}},
         "federation_sender.backoff.max: must not be shorter than initial (3600s)"),
        ({"server_name": "h", "federation_sender": {"backoff": {"jitter": [1.4, 0.8]}}},
         "federation_sender.backoff.jitter: low must not exceed high"),
        ({"server_name": "h", "federation_sender": {"catch_up": {"threshold": 60}}},
         "federation_sender.catch_up.threshold: expected a duration with a unit"),
        ({"server_name": "h", "federation_sender": {"catch_up": {"missed": 5}}},
         "federation_sender.catch_up.missed: unknown key"),
        ({"server_name": "h", "send_federation": "no"}, "send_federation: expected true or false, got 'no'"),
        ({"server_name": "h", "workers": {"w1": {"app": "sync"}}}, "workers.w1.app: unknown worker app 'sync'; installed roles: appservice, background"),
        ({"server_name": "h", "worker_replication_secret": "s", "workers": {"g": {"app": "generic"}}},
         "database.url: workers share one PostgreSQL database"),
        ({"server_name": "h", "worker_replication_secret": "s", "database": {"url": "postgresql://x/y"},
          "workers": {"p9": {"app": "event_persister"}}},
         "workers.p9.app: 'p9' is an event_persister but not in stream_writers.events"),
        ({"server_name": "h", "worker_replication_secret": "s", "database": {"url": "postgresql://x/y"},
          "workers": {"fs": {"app": "federation_sender"}}},
         "workers.fs.app: 'fs' is a federation_sender but not in federation_sender_instances"),
        ({"server_name": "h", "worker_replication_secret": "s", "database": {"url": "postgresql://x/y"},
          "workers": {"g": {"app": "generic", "listeners": [{"type": "http", "port": 9001}]}},
          "listeners": [{"type": "http", "port": 9000, "resources": ["replication"]}],
          "instance_map": {"master": {"host": "127.0.0.1", "port": 9000}, "g": {"host": "127.0.0.1", "port": 9001}}},
         "instance_map.g.port: 'g' has no http listener with the replication resource on port 9001"),
        ({"server_name": "h", "worker_replication_secret": "s", "database": {"url": "postgresql://x/y"},
          "workers": {"g": {"app": "generic"}}},
         "instance_map: workers are configured: add 'master'"),
        ({"server_name": "h", "worker_replication_secret": "s", "database": {"url": "postgresql://x/y"},
          "workers": {"push1": {"app": "pusher"}, "push2": {"app": "pusher"}}},
         "workers.push2.app: only one pusher worker may run; push1, push2 are"),
        ({"server_name": "h", "instance_map": {"ghost": {"host": "127.0.0.1", "port": 9001}}},
         "instance_map.ghost: 'ghost' is neither the main process nor a worker"),
        ({"server_name": "h", "workers": {"master": {"app": "generic"}}},
         "workers.master: 'master' is the main process's name"),
        ({"server_name": "h", "stream_writers": {"events": ["p1"]}},
         "stream_writers.events[0]: 'p1' is neither the main process nor a worker"),
        ({"server_name": "h", "worker_replication_secret": "s", "workers": {"p1": {"app": "event_persister"}},
          "stream_writers": {"events": ["p1"]}},
         "stream_writers.events[0]: 'p1' writes events but is missing from instance_map"),
        ({"server_name": "h", "worker_replication_secret": "s", "workers": {"p1": {"app": "event_persister"}},
          "instance_map": {"p1": {"host": "p1", "port": 9093}}, "stream_writers": {"events": ["p1"]}},
         "redis.enabled: streams are written by 2 processes (master, p1)"),
        ({"server_name": "h", "stream_writers": {"typing": ["master", "master"]}},
         "stream_writers.typing[1]: 'master' is listed twice"),
        ({"server_name": "h", "stream_writers": {"typing": ["a", "b"]}},
         "stream_writers.typing: only the events stream can have several writers"),
        ({"server_name": "h", "stream_writers": {"caches": ["master"]}}, "stream_writers.caches: unknown stream"),
        ({"server_name": "h", "worker_replication_secret": "s", "workers": {"g": {"app": "generic"}},
          "federation_sender_instances": ["g"]},
         "federation_sender_instances[0]: 'g' is not a worker with app: federation_sender"),
        ({"server_name": "h", "worker_replication_secret": "s", "workers": {"fs": {"app": "federation_sender"}},
          "federation_sender_instances": ["fs"]},
         "send_federation: federation_sender_instances are configured"),
        ({"server_name": "h", "workers": {"g": {"app": "generic"}}},
         "worker_replication_secret: workers are configured"),
        ({"server_name": "h", "instance_map": {"p1": {"host": "p1"}}}, "instance_map.p1.port: is required"),
    ],
)
def test_errors_name_the_key_path(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(raw)
    assert message in str(info.value)


def test_connection_limits_defaults_and_overrides() -> None:
    default = _parse({"server_name": "h"}).listeners[0].connection_limits
    assert (default.header_timeout, default.body_timeout, default.idle_timeout) == (
        timedelta(seconds=30), timedelta(seconds=60), timedelta(seconds=75))
    assert (default.max_connections_per_ip, default.exempt_ranges) == (100, ("127.0.0.0/8", "::1/128"))
    assert not default.is_capped("127.0.0.1") and default.is_capped("192.0.2.7")  # a proxy here is exempt
    limits = _parse({"server_name": "h", "listeners": [{"type": "http", "port": 1, "connection_limits": {
        "header_timeout": "2s", "body_timeout": "5m", "idle_timeout": "500ms",
        "max_connections_per_ip": 3, "exempt_ranges": ["127.0.0.0/8", "::1/128"]}}]}).listeners[0].connection_limits
    nothing = _parse({"server_name": "h", "listeners": [{"type": "http", "port": 1, "connection_limits": {
        "exempt_ranges": []}}]}).listeners[0].connection_limits
    assert nothing.is_capped("127.0.0.1")
    assert (limits.header_timeout, limits.body_timeout, limits.idle_timeout, limits.max_connections_per_ip) == (
        timedelta(seconds=2), timedelta(minutes=5), timedelta(milliseconds=500), 3)
    assert not limits.is_capped("127.0.0.5") and not limits.is_capped("::1") and limits.is_capped("10.0.0.1")


def test_durations_need_units() -> None:
    assert parse_duration("x", "500ms") == timedelta(milliseconds=500)
    assert parse_duration("x", "10m") == timedelta(minutes=10)
    assert parse_duration("x", "7d") == timedelta(days=7)
    for bad in ("10", 10, "ten minutes", "-1s", ""):
        with pytest.raises(ConfigError):
            parse_duration("x", bad)


def test_generated_config_loads_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "homeserver.yaml"
    path.write_text(generate_config_text("example.org", "data"))
    config = load_config(path)
    assert config.server_name == "example.org"
    assert config.data_dir == tmp_path / "data"
    assert config.enable_registration is True
    assert [listener.type for listener in config.listeners] == ["http", "metrics"]
    # Every key the generated file sets is one the loader knows.
    assert set(yaml.safe_load(path.read_text())) <= {"server_name", "data_dir", "listeners", "redis", "log_level", "enable_registration"}


def test_data_dir_override_wins(tmp_path: Path) -> None:
    path = tmp_path / "homeserver.yaml"
    path.write_text("server_name: example.org\ndata_dir: /somewhere\n")
    assert load_config(path, data_dir_override=tmp_path / "d").data_dir == (tmp_path / "d").resolve()


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("server_name: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line 2"):
        load_config(bad)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(not_mapping)


def test_the_docker_example_layout_parses() -> None:
    """docker/config/homeserver.yaml (main, a generic worker, two persisters, a federation
    sender, a media repository) passes every check of the worker layout."""
    config = load_config(Path(__file__).resolve().parents[2] / "docker" / "config" / "homeserver.yaml")
    assert config.stream_writers["events"] == ("persister1", "persister2")
    assert config.federation_sender_instances == ("federation_sender1",)
    assert {name: w.app for name, w in config.workers.items()} == {
        "generic1": "generic", "persister1": "event_persister", "persister2": "event_persister",
        "federation_sender1": "federation_sender", "media1": "media_repository",
    }
    assert config.media_worker == "media1"
    assert not config.send_federation and config.redis.enabled


def test_replication_and_database_sections_parse_into_their_packages_types() -> None:
    """The loader fills replication's and storage's own config types; their errors
    keep the dotted key path of the YAML."""
    from replication.config import RedisConfig, ReplicationConfig
    from storage.config import DatabaseConfig, EmbeddedDatabaseConfig

    config = _parse(
        {
            "server_name": "example.com",
            "replication": {"keepalive_interval": "2s", "timeout": "6s", "max_outbound_buffer": 500},
            "redis": {"enabled": True},
            "allow_unauthenticated_replication": True,
            "database": {"url": "postgresql://u@h/db", "min_connections": 2, "embedded": {"binaries": "system"}},
        }
    )
    assert config.replication == ReplicationConfig(
        keepalive_interval=timedelta(seconds=2), timeout=timedelta(seconds=6), max_outbound_buffer=500,
        redis=RedisConfig(enabled=True, url="redis://127.0.0.1:6379/0"), allow_unauthenticated=True,
    )
    assert config.redis is config.replication.redis and config.allow_unauthenticated_replication
    assert config.database == DatabaseConfig(
        url="postgresql://u@h/db", min_connections=2, embedded=EmbeddedDatabaseConfig(binaries="system")
    )
    # Without a replication section, redis and the opt-in still reach replication's config.
    bare = _parse({"server_name": "example.com", "redis": {"enabled": True}})
    assert bare.replication == ReplicationConfig(redis=RedisConfig(enabled=True))
    assert _parse({"server_name": "example.com"}).replication == ReplicationConfig()

    with pytest.raises(ConfigError, match="replication.timeout: must be longer than keepalive_interval"):
        _parse({"server_name": "example.com", "replication": {"keepalive_interval": "10s", "timeout": "5s"}})
    with pytest.raises(ConfigError, match="replication.flood: unknown key"):
        _parse({"server_name": "example.com", "replication": {"flood": 1}})
    with pytest.raises(ConfigError, match="redis.url: expected a redis://"):
        _parse({"server_name": "example.com", "redis": {"url": "http://x"}})
    listener = {"type": "replication", "port": 9093, "bind_addresses": ["0.0.0.0"]}
    with pytest.raises(ConfigError, match=r"listeners\[0\].bind_addresses: a replication listener on 0.0.0.0"):
        _parse({"server_name": "example.com", "listeners": [listener]})
    assert _parse({"server_name": "example.com", "listeners": [listener], "allow_unauthenticated_replication": True})
    _parse({"server_name": "example.com", "listeners": [{"type": "replication", "port": 9093, "bind_addresses": ["::1"]}]})


def test_federation_limits_defaults_and_overrides() -> None:
    from datetime import timedelta

    from homeserver.config import FederationLimitsConfig, RateLimit

    assert parse_config({"server_name": "h"}).federation_limits == FederationLimitsConfig()
    limits = parse_config({"server_name": "h", "federation_limits": {
        "dns_timeout": "500ms", "key_query_max_servers": 5, "rc_key_query": {"per_second": 0.5, "burst_count": 2},
    }}).federation_limits
    assert limits.dns_timeout == timedelta(milliseconds=500) and limits.key_query_max_servers == 5
    assert limits.rc_key_query == RateLimit(0.5, 2) and limits.connect_timeout == timedelta(seconds=10)
    gaps = parse_config({"server_name": "h", "federation_limits": {
        "missing_events_max": 30, "rc_missing_events": {"per_second": 0.1, "burst_count": 4}}}).federation_limits
    assert (gaps.missing_events_max, gaps.rc_missing_events) == (30, RateLimit(0.1, 4))
    assert (FederationLimitsConfig().missing_events_max, FederationLimitsConfig().rc_missing_events) == (
        100, RateLimit(1.0, 50))
    for raw, message in (
        ({"dns_timeout": "0s"}, "federation_limits.dns_timeout: expected a positive duration"),
        ({"tls_timeout": 3}, "federation_limits.tls_timeout: expected a duration"),
        ({"key_query_max_servers": 0}, "federation_limits.key_query_max_servers: expected an integer"),
        ({"missing_events_max": -1}, "federation_limits.missing_events_max: expected an integer"),
        ({"rc_missing_events": {"per_second": 0}}, "federation_limits.rc_missing_events"),
        ({"bogus": 1}, "federation_limits.bogus: unknown key"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config({"server_name": "h", "federation_limits": raw})


def test_media_section_defaults_and_overrides() -> None:
    from homeserver.media.config import MediaConfig, RateLimitSpec
    from homeserver.media.rules import ThumbnailSpec

    config = parse_config({"server_name": "h", "data_dir": "/srv/t"})
    assert config.media == MediaConfig() and config.media_store_path == Path("/srv/t/media")
    assert config.media.url_preview.enabled is False and "127.0.0.0/8" in config.media.url_preview.ip_range_blacklist
    media = parse_config({"server_name": "h", "media": {
        "store_path": "/mnt/media", "max_upload_size": "10M", "max_image_pixels": 1000,
        "thumbnail_sizes": [{"width": 64, "height": 64, "method": "crop"}], "rc_upload": {"burst_count": 3},
        "remote_media_lifetime": "never", "local_media_lifetime": "30d",
        "url_preview": {"enabled": True, "ip_range_whitelist": ["10.1.0.0/16"], "max_spider_size": 1024},
        "freeze_unauthenticated_media": True,
    }}).media
    assert media.freeze_unauthenticated_media and not MediaConfig().freeze_unauthenticated_media
    assert media.store_path == Path("/mnt/media") and media.max_upload_size == 10 * 1024 * 1024
    assert media.thumbnail_sizes == (ThumbnailSpec(64, 64, "crop"),)
    assert media.rc_upload == RateLimitSpec(1.0, 3)
    assert media.remote_media_lifetime is None and media.local_media_lifetime == timedelta(days=30)
    assert media.url_preview.enabled and media.url_preview.ip_range_whitelist == ("10.1.0.0/16",)
    for raw, message in (
        ({"max_upload_size": "lots"}, "media.max_upload_size: expected a positive size"),
        ({"max_upload_size": 0}, "media.max_upload_size: expected a positive size"),
        ({"thumbnail_sizes": []}, "media.thumbnail_sizes: expected at least one thumbnail size"),
        ({"thumbnail_sizes": [{"width": 0, "height": 1}]}, "media.thumbnail_sizes[0].width: expected an integer"),
        ({"thumbnail_sizes": [{"width": 1, "height": 1, "method": "zoom"}]}, "media.thumbnail_sizes[0].method"),
        ({"url_preview": {"ip_range_blacklist": ["nonsense"]}}, "media.url_preview.ip_range_blacklist[0]"),
        ({"url_preview": {"bogus": 1}}, "media.url_preview.bogus: unknown key"),
        ({"remote_media_timeout": "0s"}, "media.remote_media_timeout: expected a positive duration"),
        ({"bogus": 1}, "media.bogus: unknown key"),
        ({"freeze_unauthenticated_media": "yes"}, "media.freeze_unauthenticated_media: expected true or false"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config({"server_name": "h", "media": raw})


def test_one_media_repository_worker_at_most() -> None:
    base: dict[str, Any] = {"server_name": "h", "worker_replication_secret": "s", "redis": {"enabled": True},
                            "database": {"url": "postgresql://x/y"},
                            "instance_map": {"master": {"host": "127.0.0.1", "port": 9000}},
                            "listeners": [{"type": "http", "port": 9000, "resources": ["replication"]}]}
    config = parse_config({**base, "workers": {"m1": {"app": "media_repository"}}})
    assert config.media_worker == "m1"
    with pytest.raises(ConfigError, match=re.escape("workers.m2.app: only one media_repository worker")):
        parse_config({**base, "workers": {"m1": {"app": "media_repository"}, "m2": {"app": "media_repository"}}})
