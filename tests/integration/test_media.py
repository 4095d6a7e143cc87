"""The media repository against one real ``tributary run`` process (real PostgreSQL, real disk):
upload and download byte for byte, headers, deduplication, thumbnails, asynchronous uploads,
bad input, limits, quarantine and delete, URL previews."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg2
import pytest
from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import Site

from tests.conftest import scratch_database
from tests.harness import TributaryProcess
from tests.integration.media_support import animated_gif, http, image_size, png, register, upload
from tests.twisted_plugin import reactor

pytestmark = pytest.mark.e2e


@attrs.frozen
class Server:
    process: TributaryProcess
    dsn: str

    @property
    def url(self) -> str:
        return self.process.base_url

    def make_admin(self, user_id: str) -> None:
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("UPDATE users SET admin = TRUE WHERE user_id = %s", (user_id,))
        conn.close()


@pytest.fixture(scope="module")
def server(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("media")
    with scratch_database(postgres_template) as dsn:
        media = {
            "max_upload_size": "1M",
            "max_image_pixels": 4_000_000,
            "rc_upload": {"per_second": 0.001, "burst_count": 12},
            "max_pending_uploads": 2,
            "url_preview": {"enabled": True, "ip_range_whitelist": ["127.0.0.2/32"]},
        }
        proc = TributaryProcess.configure(tmp, database_url=dsn, extra={
            "log_level": "WARNING", "allow_guest_access": True, "media": media})
        proc.start()
        try:
            yield Server(proc, dsn)
        finally:
            assert proc.stop() == 0, proc.output[-5000:]
            assert "Traceback" not in proc.output, proc.output[-5000:]


class Static(Resource):
    """One fixed answer (twisted.web.static.Data, without its deprecation warnings)."""

    isLeaf = True

    def __init__(self, body: bytes, content_type: str) -> None:
        super().__init__()
        self._body, self._type = body, content_type.encode()

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"Content-Type", self._type)
        return self._body


def media_files(server: Server) -> list[Path]:
    return [p for p in (server.process.data_dir / "media").rglob("*") if p.is_file()]


async def test_upload_and_download_byte_for_byte_with_safe_headers(server: Server) -> None:
    token = await register(server.url, "dl")
    data = png(40, 30)
    uri = await upload(server.url, token, data, "image/png", "cat.png")
    media_id = uri.rsplit("/", 1)[1]
    v1 = await http("GET", f"{server.url}/_matrix/client/v1/media/download/localhost/{media_id}", token=token)
    assert v1.code == 200 and v1.body == data
    assert v1.headers["content-type"] == "image/png"
    assert v1.headers["content-disposition"] == 'inline; filename="cat.png"'
    assert v1.headers["cross-origin-resource-policy"] == "cross-origin"
    assert "sandbox" in v1.headers["content-security-policy"] and "default-src 'none'" in v1.headers[
        "content-security-policy"]
    assert v1.headers["x-content-type-options"] == "nosniff"
    legacy = await http("GET", f"{server.url}/_matrix/media/v3/download/localhost/{media_id}/other.png")
    assert legacy.code == 200 and legacy.body == data
    assert legacy.headers["content-disposition"] == 'inline; filename="other.png"'
    anonymous = await http("GET", f"{server.url}/_matrix/client/v1/media/download/localhost/{media_id}")
    assert anonymous.code == 401 and anonymous.errcode == "M_MISSING_TOKEN"
    config = await http("GET", f"{server.url}/_matrix/client/v1/media/config", token=token)
    assert config.code == 200 and config.json == {"m.upload.size": 1024 * 1024}
    # A guest may read media (the images of rooms it reads), not upload.
    guest = await http("POST", f"{server.url}/_matrix/client/v3/register?kind=guest", b"{}",
                       headers={"Content-Type": "application/json"})
    assert guest.code == 200, guest
    guest_token = guest.json["access_token"]
    read = await http("GET", f"{server.url}/_matrix/client/v1/media/download/localhost/{media_id}", token=guest_token)
    assert read.code == 200 and read.body == data
    refused = await http("POST", f"{server.url}/_matrix/media/v3/upload", b"x", token=guest_token,
                         headers={"Content-Type": "text/plain"})
    assert refused.code == 403 and refused.errcode == "M_GUEST_ACCESS_FORBIDDEN"


async def test_html_is_an_attachment_and_identical_uploads_share_one_file(server: Server) -> None:
    token = await register(server.url, "dedup")
    page = b"<html><script>alert(1)</script></html>" + hashlib.sha256(b"dedup").hexdigest().encode()
    first = await upload(server.url, token, page, "text/html", "x.html")
    second = await upload(server.url, token, page, "text/html")
    assert first != second
    digest = hashlib.sha256(page).hexdigest()
    assert [p for p in media_files(server) if p.name == digest[4:]] != []
    assert len([p for p in media_files(server) if p.name == digest[4:]]) == 1
    got = await http("GET", f"{server.url}/_matrix/client/v1/media/download/localhost/{first.rsplit('/', 1)[1]}",
                     token=token)
    assert got.body == page and got.headers["content-disposition"] == 'attachment; filename="x.html"'
    odd = await upload(server.url, token, b"bytes", "text/html\r\nX: y")
    got = await http("GET", f"{server.url}/_matrix/media/v3/download/localhost/{odd.rsplit('/', 1)[1]}")
    assert got.headers["content-type"] == "application/octet-stream"


async def test_thumbnails_crop_scale_and_animated(server: Server) -> None:
    token = await register(server.url, "thumbs")
    media_id = (await upload(server.url, token, png(1000, 500), "image/png")).rsplit("/", 1)[1]
    base = f"{server.url}/_matrix/client/v1/media/thumbnail/localhost/{media_id}"
    crop = await http("GET", f"{base}?width=32&height=32&method=crop", token=token)
    assert crop.code == 200 and crop.headers["content-type"] == "image/png" and image_size(crop.body) == (32, 32)
    scale = await http("GET", f"{base}?width=300&height=200&method=scale", token=token)
    assert scale.code == 200 and image_size(scale.body) == (320, 160)
    again = await http("GET", f"{base}?width=300&height=200&method=scale", token=token)
    assert again.body == scale.body
    legacy = await http("GET", f"{server.url}/_matrix/media/v3/thumbnail/localhost/{media_id}?width=32&height=32")
    assert legacy.code == 200
    gif = (await upload(server.url, token, animated_gif(), "image/gif")).rsplit("/", 1)[1]
    animated = await http("GET", f"{server.url}/_matrix/client/v1/media/thumbnail/localhost/{gif}"
                                 "?width=32&height=32&method=crop&animated=true", token=token)
    assert animated.code == 200 and animated.headers["content-type"] == "image/gif"
    for bad in ["width=0&height=1", "width=a&height=1", "height=1", "width=1&height=1&method=zoom",
                "width=1&height=1&animated=yes"]:
        response = await http("GET", f"{base}?{bad}", token=token)
        assert response.code == 400 and response.errcode == "M_INVALID_PARAM", (bad, response)


async def test_bad_images_and_traversal_attempts_are_refused(server: Server) -> None:
    token = await register(server.url, "bad")
    truncated = (await upload(server.url, token, png(200, 200)[:80], "image/png")).rsplit("/", 1)[1]
    text = (await upload(server.url, token, b"just text", "text/plain")).rsplit("/", 1)[1]
    # 25 megapixels of one colour: a small file, over the 4 megapixel limit of this server.
    bomb = (await upload(server.url, token, png(5000, 5000), "image/png")).rsplit("/", 1)[1]
    svg = (await upload(server.url, token, b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")
           ).rsplit("/", 1)[1]
    base = f"{server.url}/_matrix/client/v1/media/thumbnail/localhost"
    for media_id, status, errcode in [(truncated, 400, "M_UNKNOWN"), (text, 400, "M_UNKNOWN"),
                                      (bomb, 413, "M_TOO_LARGE"), (svg, 400, "M_UNKNOWN")]:
        response = await http("GET", f"{base}/{media_id}?width=32&height=32", token=token)
        assert (response.code, response.errcode) == (status, errcode), (media_id, response)
    for path in ["..%2F..%2F..%2Fetc%2Fpasswd", "%2e%2e", "..", "a%00b", "x" * 300, "%2Fetc%2Fpasswd"]:
        response = await http("GET", f"{server.url}/_matrix/media/v3/download/localhost/{path}")
        assert response.code in (400, 404) and response.errcode in ("M_NOT_FOUND", "M_INVALID_PARAM"), (path, response)
        assert b"root:" not in response.body
    bad_server = await http("GET", f"{server.url}/_matrix/media/v3/download/..%2F../abc")
    assert bad_server.code == 400
    put = await http("PUT", f"{server.url}/_matrix/media/v3/upload/localhost/..%2Fescape", b"x", token=token)
    assert put.code == 404


async def test_limits_size_and_rate(server: Server) -> None:
    token = await register(server.url, "limits")
    too_big = await http("POST", f"{server.url}/_matrix/media/v3/upload", b"x" * (1024 * 1024 + 1), token=token,
                         headers={"Content-Type": "application/octet-stream"})
    assert too_big.code == 413 and too_big.errcode == "M_TOO_LARGE"
    codes = []
    for i in range(13):
        response = await http("POST", f"{server.url}/_matrix/media/v3/upload", b"%d" % i, token=token,
                              headers={"Content-Type": "text/plain"})
        codes.append(response.code)
    assert codes == [200] * 12 + [429]  # the burst of 12; the 413 above did not count
    other = await register(server.url, "limits2")
    assert (await upload(server.url, other, b"fine", "text/plain")).startswith("mxc://localhost/")


async def test_asynchronous_upload(server: Server) -> None:
    alice = await register(server.url, "async_a")
    bob = await register(server.url, "async_b")
    created = await http("POST", f"{server.url}/_matrix/media/v1/create", token=alice)
    assert created.code == 200, created
    uri, expires = created.json["content_uri"], created.json["unused_expires_at"]
    assert isinstance(expires, int)
    media_id = uri.rsplit("/", 1)[1]
    early = await http("GET", f"{server.url}/_matrix/client/v1/media/download/localhost/{media_id}?timeout_ms=0",
                       token=alice)
    assert early.code == 504 and early.errcode == "M_NOT_YET_UPLOADED"
    put_url = f"{server.url}/_matrix/media/v3/upload/localhost/{media_id}"
    stolen = await http("PUT", put_url, b"bob's", token=bob, headers={"Content-Type": "text/plain"})
    assert stolen.code == 403 and stolen.errcode == "M_FORBIDDEN"
    # A download that starts before the bytes arrive waits for them (timeout_ms), then gets them.
    waiting = Deferred.fromCoroutine(http(
        "GET", f"{server.url}/_matrix/client/v1/media/download/localhost/{media_id}?timeout_ms=15000", token=bob))
    await task.deferLater(reactor, 0.3, lambda: None)
    assert not waiting.called
    done = await http("PUT", put_url + "?filename=a.txt", b"alice's", token=alice,
                      headers={"Content-Type": "text/plain"})
    assert done.code == 200, done
    woken = await waiting
    assert woken.code == 200 and woken.body == b"alice's"
    again = await http("PUT", put_url, b"again", token=alice, headers={"Content-Type": "text/plain"})
    assert again.code == 409 and again.errcode == "M_CANNOT_OVERWRITE_MEDIA"
    got = await http("GET", f"{server.url}/_matrix/client/v1/media/download/localhost/{media_id}", token=bob)
    assert got.body == b"alice's" and got.headers["content-disposition"] == 'inline; filename="a.txt"'
    for _ in range(2):
        assert (await http("POST", f"{server.url}/_matrix/media/v1/create", token=bob)).code == 200
    too_many = await http("POST", f"{server.url}/_matrix/media/v1/create", token=bob)
    assert too_many.code == 429 and too_many.errcode == "M_LIMIT_EXCEEDED"
    elsewhere = await http("PUT", f"{server.url}/_matrix/media/v3/upload/example.org/{media_id}", b"x", token=alice)
    assert elsewhere.code == 403


async def test_quarantine_and_delete_need_an_admin(server: Server) -> None:
    """Only server admins quarantine or delete media, through the admin API's guard (403 and an
    audit line for anyone else); quarantined media is 404 to everyone."""
    user = await register(server.url, "q_user")
    admin = await register(server.url, "q_admin")
    data = png(64, 64, (1, 2, 3))
    media_id = (await upload(server.url, user, data, "image/png")).rsplit("/", 1)[1]
    thumb = await http("GET", f"{server.url}/_matrix/client/v1/media/thumbnail/localhost/{media_id}?width=32&height=32",
                       token=user)
    assert thumb.code == 200
    quarantine = f"{server.url}/_synapse/admin/v1/media/quarantine/localhost/{media_id}"
    refused = await http("POST", quarantine, token=admin)
    assert refused.code == 403 and refused.errcode == "M_FORBIDDEN"
    server.make_admin("@q_admin:localhost")
    assert (await http("POST", quarantine, token=admin)).code == 200
    for url in [f"{server.url}/_matrix/client/v1/media/download/localhost/{media_id}",
                f"{server.url}/_matrix/client/v1/media/thumbnail/localhost/{media_id}?width=32&height=32"]:
        gone = await http("GET", url, token=user)
        assert gone.code == 404 and gone.errcode == "M_NOT_FOUND"
    missing = await http("POST", f"{server.url}/_synapse/admin/v1/media/quarantine/localhost/nosuchmedia", token=admin)
    assert missing.code == 404
    delete = f"{server.url}/_synapse/admin/v1/media/localhost/{media_id}"
    assert (await http("DELETE", delete, token=user)).code == 403
    deleted = await http("DELETE", delete, token=admin)
    assert deleted.code == 200 and deleted.json["deleted_media"] == [media_id]
    assert (await http("DELETE", delete, token=admin)).code == 404
    # The admin API's guard: refusals are in the audit log (WARNING, which this server logs).
    log = server.process.log_path.read_text(encoding="utf-8")
    assert f"[@q_user:localhost] refused (not an admin): DELETE /_synapse/admin/v1/media/localhost/{media_id}" in log
    digest = hashlib.sha256(data).hexdigest()
    assert not [p for p in media_files(server) if p.name == digest[4:]]


async def test_url_previews_parse_opengraph_and_refuse_denied_addresses(server: Server) -> None:
    token = await register(server.url, "preview")
    root = Resource()
    page = (b"<html><head><title>t</title><meta property='og:title' content='A page'>"
            b"<meta property='og:image' content='/img.png'></head></html>")
    root.putChild(b"page", Static(page, "text/html; charset=utf-8"))
    root.putChild(b"img.png", Static(png(50, 40), "image/png"))
    port = reactor.listenTCP(0, Site(root), interface="127.0.0.2")
    try:
        address = f"http://127.0.0.2:{port.getHost().port}"
        ok = await http("GET", f"{server.url}/_matrix/client/v1/media/preview_url?url={address}/page", token=token)
        assert ok.code == 200, ok
        assert ok.json["og:title"] == "A page" and ok.json["og:image"].startswith("mxc://localhost/")
        assert (ok.json["og:image:width"], ok.json["og:image:height"]) == (50, 40)
        denied = await http("GET", f"{server.url}/_matrix/client/v1/media/preview_url"
                                   f"?url=http://127.0.0.1:{port.getHost().port}/page", token=token)
        assert denied.code == 403 and denied.errcode == "M_FORBIDDEN"
        for bad in ["file:///etc/passwd", "http://10.0.0.1/", "http://[::1]/", "gopher://x/"]:
            response = await http("GET", f"{server.url}/_matrix/client/v1/media/preview_url?url={bad}", token=token)
            assert response.code in (400, 403), (bad, response)
    finally:
        await port.stopListening()


async def test_hostile_requests_get_matrix_errors_never_a_500(server: Server) -> None:
    token = await register(server.url, "fuzz")
    media_id = (await upload(server.url, token, png(20, 20), "image/png")).rsplit("/", 1)[1]
    requests: list[tuple[str, str, bytes | None, dict[str, str]]] = [
        ("GET", f"/_matrix/client/v1/media/thumbnail/localhost/{media_id}?width=99999&height=99999&method=crop", None, {}),
        ("GET", f"/_matrix/client/v1/media/thumbnail/localhost/{media_id}?width=1&height=1&method=scale", None, {}),
        ("GET", f"/_matrix/client/v1/media/download/localhost/{media_id}?timeout_ms=-1", None, {}),
        ("GET", f"/_matrix/client/v1/media/download/localhost/{media_id}?timeout_ms=99999999999", None, {}),
        ("GET", f"/_matrix/client/v1/media/download/localhost/{media_id}?allow_remote=maybe", None, {}),
        ("GET", "/_matrix/client/v1/media/download/localhost:99999/abc", None, {}),
        ("GET", "/_matrix/client/v1/media/download/%ff/abc", None, {}),
        ("GET", "/_matrix/client/v1/media/download/localhost/%ff%fe", None, {}),
        ("GET", f"/_matrix/client/v1/media/download/localhost/{media_id}/%2e%2e%2f%2e%2e%2fx", None, {}),
        ("GET", "/_matrix/client/v1/media/preview_url?url=http://%E2%98%83.example/", None, {}),
        ("GET", "/_matrix/client/v1/media/preview_url", None, {}),
        ("GET", "/_matrix/client/v1/media/preview_url?url=http://[zz]/", None, {}),
        ("POST", "/_matrix/media/v3/upload?filename=%00%0d%0a", b"abc", {"Content-Type": "\x01"}),
        ("POST", "/_matrix/media/v3/upload", b"", {}),
        ("PUT", "/_matrix/media/v3/upload/localhost/", b"x", {}),
        ("PUT", f"/_matrix/media/v3/upload/localhost/{media_id}", b"x", {}),
        ("POST", "/_synapse/admin/v1/media/quarantine/localhost/..", None, {}),
        ("DELETE", "/_synapse/admin/v1/media/localhost/%2F", None, {}),
    ]
    for method, path, body, headers in requests:
        response = await http(method, server.url + path, body, token=token, headers=headers)
        assert response.code < 500 or response.errcode is not None, (method, path, response)
        assert response.code != 500, (method, path, response)
        if response.code >= 400:
            assert response.errcode is not None, (method, path, response)
