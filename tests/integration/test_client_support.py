"""Support for the test_client_* modules (no tests here): an in-process homeserver and an HTTP client.

``running_server`` starts a real ``HomeServer`` (real listener, real PostgreSQL)
inside the test process, so a test can reach its handlers; ``Client`` talks to
it over loopback HTTP with Twisted's Agent. Rate limits are generous unless a
test overrides them, and bcrypt uses its cheapest cost.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from io import BytesIO
from pathlib import Path
from typing import Any

import attrs
from prometheus_client import CollectorRegistry
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from homeserver.app import HomeServer
from homeserver.config import parse_config
from tests.harness import free_port
from tests.twisted_plugin import reactor

GENEROUS = {"per_second": 1000, "burst_count": 1000}
SERVER_NAME = "test.local"


def server_config(dsn: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "server_name": SERVER_NAME,
        "listeners": [{"type": "http", "port": free_port(), "resources": ["client", "health"]}],
        "database": {"url": dsn, "max_connections": 4},
        "enable_registration": True,
        "bcrypt_rounds": 4,
        "rc_registration": GENEROUS,
        "rc_login": {"address": GENEROUS, "account": GENEROUS, "failed_attempts": GENEROUS},
        "log_level": "WARNING",
        **extra,
    }





@attrs.frozen
class Response:
    status: int
    body: Any

    @property
    def errcode(self) -> str | None:
        return self.body.get("errcode") if isinstance(self.body, dict) else None


class Client:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._agent = Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False))

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        if not path.startswith("/"):
            path = "/_matrix/client/v3/" + path
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        header_map = {k.encode(): [v.encode()] for k, v in (headers or {}).items()}
        if token is not None:
            header_map[b"Authorization"] = [f"Bearer {token}".encode()]
        producer = FileBodyProducer(BytesIO(data)) if data is not None else None
        response = await self._agent.request(
            method.encode(), (self.base_url + path).encode(), Headers(header_map), producer
        )
        content = await readBody(response)
        try:
            parsed: Any = json.loads(content) if content else None
        except ValueError:
            parsed = content
        return Response(response.code, parsed)

    async def register(self, username: str | None, password: str = "password", **fields: Any) -> Response:
        body: dict[str, Any] = {"password": password, "auth": {"type": "m.login.dummy"}, **fields}
        if username is not None:
            body["username"] = username
        return await self.request("POST", "register", body)

    async def register_ok(self, username: str, password: str = "password", **fields: Any) -> dict[str, Any]:
        response = await self.register(username, password, **fields)
        assert response.status == 200, response
        result: dict[str, Any] = response.body
        return result

    async def login(self, user: str, password: str = "password", **fields: Any) -> Response:
        body = {"type": "m.login.password", "identifier": {"type": "m.id.user", "user": user}, "password": password}
        return await self.request("POST", "login", {**body, **fields})


@asynccontextmanager
async def running_server(dsn: str, tmp_path: Path, **extra: Any) -> AsyncIterator[tuple[HomeServer, Client]]:
    config = parse_config(server_config(dsn, tmp_path, **extra), config_path=tmp_path / "homeserver.yaml")
    hs = HomeServer(config, reactor, registry=CollectorRegistry())
    await hs.start()
    try:
        yield hs, Client(f"http://127.0.0.1:{config.listeners[0].port}")
    finally:
        await hs.stop()
