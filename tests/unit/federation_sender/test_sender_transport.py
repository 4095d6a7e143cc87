"""The homeserver's adapter from its federation client to the sender's ``Transport``."""

# tests: homeserver/federation/sender_transport.py

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import Deferred

from federation_sender.transport import TransactionFailed
from homeserver.remote.client import FederationClientError, HttpResponseError
from homeserver.federation.sender_transport import client_transport


class FakeClient:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.calls: list[tuple[str, str, bytes, float | None]] = []

    async def put_encoded(self, destination: str, path: str, content: bytes, *, timeout: float | None = None) -> Any:
        self.calls.append((destination, path, content, timeout))
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def run(client: FakeClient) -> Any:
    send = client_transport(client)

    async def call() -> Any:
        return await send("b.example", "17.3/x", b'{"pdus":[]}', 5.0)

    d = Deferred.fromCoroutine(call())
    results: list[Any] = []
    d.addBoth(results.append)
    return results[0]


def test_puts_the_body_at_the_quoted_transaction_path() -> None:
    client = FakeClient({"pdus": {}})
    assert run(client) == {"pdus": {}}
    assert client.calls == [("b.example", "/_matrix/federation/v1/send/17.3%2Fx", b'{"pdus":[]}', 5.0)]


@pytest.mark.parametrize(
    ("error", "status"),
    [(HttpResponseError("b.example", 502, b"{}"), 502), (FederationClientError("refused"), None)],
)
def test_client_errors_become_transaction_failed_with_the_status(error: Exception, status: int | None) -> None:
    failure = run(FakeClient(error))
    assert failure.check(TransactionFailed)
    assert failure.value.status == status
