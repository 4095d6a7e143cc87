"""Remote media between two real Tributary processes federating over TLS on loopback: a user of
one downloads (and thumbnails) the other's media through their own server, which fetches it
over the authenticated federation media endpoint once and serves it from its cache after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ssl
import urllib.request

import attrs
import pytest
import yaml
from twisted.internet.threads import deferToThread

from tests.conftest import scratch_database
from homeserver.remote.client import FederationClient, HttpResponseError
from homeserver.keys import load_or_create_signing_key
from homeserver.media.remote import media_from_multipart
from tests.harness import TributaryProcess, free_port
from tests.twisted_plugin import reactor
from tests.integration.media_support import http, image_size, png, register, upload

pytestmark = pytest.mark.e2e

FED = {"verify_certificates": False, "ip_range_whitelist": ["127.0.0.0/8"]}


@attrs.frozen
class Pair:
    a: TributaryProcess
    b: TributaryProcess
    a_name: str
    b_name: str


def _federating(tmp: Path, dsn: str, media: dict[str, object]) -> tuple[TributaryProcess, str]:
    fed_port = free_port()
    name = f"127.0.0.1:{fed_port}"
    proc = TributaryProcess.configure(tmp, database_url=dsn, server_name=name,
                                      extra={"federation": FED, "log_level": "WARNING", "media": media})
    config = yaml.safe_load(proc.config_path.read_text())
    config["listeners"].append({"type": "http", "port": fed_port, "tls": True, "resources": ["federation", "keys"]})
    proc.config_path.write_text(yaml.safe_dump(config))
    return proc, name


@pytest.fixture(scope="module")
def pair(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with scratch_database(postgres_template) as dsn_a, scratch_database(postgres_template) as dsn_b:
        a, a_name = _federating(tmp_path_factory.mktemp("a"), dsn_a, {})
        b, b_name = _federating(tmp_path_factory.mktemp("b"), dsn_b, {"max_remote_media_size": 200_000})
        a.start()
        try:
            b.start()
            try:
                yield Pair(a, b, a_name, b_name)
            finally:
                assert b.stop() == 0, b.output[-5000:]
                assert "Traceback" not in b.output, b.output[-5000:]
        finally:
            assert a.stop() == 0, a.output[-5000:]
            assert "Traceback" not in a.output, a.output[-5000:]


def metric(proc: TributaryProcess, line_start: str) -> float:
    status, body = proc.get("/metrics", port=proc.metrics_port)
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{line_start} not in /metrics")


@pytest.mark.timeout(90)
async def test_remote_download_and_thumbnail_through_our_server(pair: Pair) -> None:
    alice = await register(pair.a.base_url, "alice")
    bob = await register(pair.b.base_url, "bob")
    data = png(600, 300, (10, 200, 10))
    media_id = (await upload(pair.a.base_url, alice, data, "image/png", "green.png")).rsplit("/", 1)[1]
    url = f"{pair.b.base_url}/_matrix/client/v1/media/download/{pair.a_name}/{media_id}"
    first = await http("GET", url, token=bob)
    assert first.code == 200, first
    assert first.body == data and first.headers["content-type"] == "image/png"
    assert first.headers["content-disposition"] == 'inline; filename="green.png"'
    assert metric(pair.b, 'tributary_media_remote_fetches_total{outcome="ok"}') == 1
    second = await http("GET", url, token=bob)
    assert second.body == data
    assert metric(pair.b, 'tributary_media_downloads_total{source="remote_cached"}') >= 1
    assert metric(pair.b, 'tributary_media_remote_fetches_total{outcome="ok"}') == 1
    thumb = await http("GET", f"{pair.b.base_url}/_matrix/client/v1/media/thumbnail/{pair.a_name}/{media_id}"
                              "?width=96&height=96&method=crop", token=bob)
    assert thumb.code == 200 and image_size(thumb.body) == (96, 96)
    # The old unauthenticated path on the federation listener: what servers without the federation
    # media endpoint fetch our media from (and what our fallback asks of them).
    legacy = await deferToThread(_get_tls, f"https://{pair.a_name}/_matrix/media/v3/download/{pair.a_name}/{media_id}")
    assert legacy == data


def _get_tls(url: str) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, context=context, timeout=10) as response:
        body: bytes = response.read()
        return body


@pytest.mark.timeout(90)
async def test_remote_failures(pair: Pair) -> None:
    alice = await register(pair.a.base_url, "alice2")
    bob = await register(pair.b.base_url, "bob2")
    missing = await http("GET", f"{pair.b.base_url}/_matrix/client/v1/media/download/{pair.a_name}/nosuchmedia",
                         token=bob)
    assert missing.code == 404 and missing.errcode == "M_NOT_FOUND"
    big = bytes(range(256)) * 1000  # 256,000 bytes: over b's 200,000-byte limit for remote media
    media_id = (await upload(pair.a.base_url, alice, big, "application/octet-stream")).rsplit("/", 1)[1]
    too_big = await http("GET", f"{pair.b.base_url}/_matrix/client/v1/media/download/{pair.a_name}/{media_id}",
                         token=bob)
    assert too_big.code == 413 and too_big.errcode == "M_TOO_LARGE"
    not_cached = await http("GET", f"{pair.b.base_url}/_matrix/media/v3/download/{pair.a_name}/{media_id}"
                                   "?allow_remote=false")
    assert not_cached.code == 404
    unreachable = await http("GET", f"{pair.b.base_url}/_matrix/client/v1/media/download/127.0.0.1:1/abc",
                             token=bob)
    assert unreachable.code == 502 and unreachable.errcode == "M_UNKNOWN"


@pytest.mark.timeout(90)
async def test_federation_thumbnail_endpoint_is_signed_multipart(pair: Pair) -> None:
    """B's own key signs requests to A's federation media endpoints (as B would): the thumbnail is
    a multipart answer with a 32x32 PNG; an unsigned request is refused."""
    alice = await register(pair.a.base_url, "alice3")
    media_id = (await upload(pair.a.base_url, alice, png(200, 100), "image/png")).rsplit("/", 1)[1]
    key = load_or_create_signing_key(pair.b.data_dir / f"{pair.b_name.replace(':', '_')}.signing.key")
    client = FederationClient(reactor, server_name=pair.b_name, signing_key=key, verify_certificates=False,
                              ip_range_whitelist=["127.0.0.0/8"])
    try:
        path = f"/_matrix/federation/v1/media/thumbnail/{media_id}"
        answer = await client.get_bytes(pair.a_name, path, query={"width": "32", "height": "32", "method": "crop"},
                                        max_bytes=1_000_000)
        parsed = media_from_multipart(answer.content_type, answer.body)
        assert parsed is not None and parsed[0] == "image/png" and image_size(parsed[2]) == (32, 32)
        with pytest.raises(HttpResponseError) as unsigned:
            await client.get_bytes(pair.a_name, path, query={"width": "32", "height": "32"}, signed=False,
                                   max_bytes=1_000_000)
        assert unsigned.value.code == 401
        with pytest.raises(HttpResponseError) as bad:
            await client.get_bytes(pair.a_name, path, query={"width": "0", "height": "32"}, max_bytes=1_000_000)
        assert bad.value.code == 400
        with pytest.raises(HttpResponseError) as missing:
            await client.get_bytes(pair.a_name, "/_matrix/federation/v1/media/download/nosuch", max_bytes=1_000_000)
        assert missing.value.code == 404
    finally:
        await client.close()
