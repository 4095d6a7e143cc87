"""Support for the test_media* modules (no tests here): raw HTTP with response headers, images."""

from __future__ import annotations

import io
import json
from typing import Any

import attrs
from PIL import Image
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from tests.twisted_plugin import reactor


@attrs.frozen
class Raw:
    code: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def errcode(self) -> str | None:
        try:
            value = json.loads(self.body)
        except ValueError:
            return None
        return value.get("errcode") if isinstance(value, dict) else None


_agent = Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False))


async def http(method: str, url: str, body: bytes | None = None, *, token: str | None = None,
               headers: dict[str, str] | None = None) -> Raw:
    header_map = {k.encode(): [v.encode()] for k, v in (headers or {}).items()}
    if token is not None:
        header_map[b"Authorization"] = [f"Bearer {token}".encode()]
    producer = FileBodyProducer(io.BytesIO(body)) if body is not None else None
    response = await _agent.request(method.encode(), url.encode(), Headers(header_map), producer)
    content = await readBody(response)
    flat = {k.decode().lower(): v[0].decode("latin-1") for k, v in response.headers.getAllRawHeaders()}
    return Raw(response.code, flat, content)


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def animated_gif(size: int = 64, frames: int = 3) -> bytes:
    images = [Image.new("RGB", (size, size), (i * 60, 0, 0)) for i in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=50, loop=0)
    return buffer.getvalue()


def image_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        return image.size


async def register(base_url: str, name: str) -> str:
    body = json.dumps({"username": name, "password": "pw", "auth": {"type": "m.login.dummy"}}).encode()
    response = await http("POST", f"{base_url}/_matrix/client/v3/register", body,
                          headers={"Content-Type": "application/json"})
    assert response.code == 200, response
    token: str = response.json["access_token"]
    return token


async def upload(base_url: str, token: str, data: bytes, content_type: str, filename: str | None = None) -> str:
    query = f"?filename={filename}" if filename else ""
    response = await http("POST", f"{base_url}/_matrix/media/v3/upload{query}", data, token=token,
                          headers={"Content-Type": content_type})
    assert response.code == 200, response
    uri: str = response.json["content_uri"]
    assert uri.startswith("mxc://")
    return uri
