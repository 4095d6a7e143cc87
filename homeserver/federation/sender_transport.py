"""The federation sender's transport, on top of this server's federation client.

``federation_sender`` knows nothing of the homeserver: it is handed a
``Transport``. This adapter sends its transactions with ``FederationClient``
(signing, server-name resolution, TLS) and turns the client's errors into the
sender's ``TransactionFailed`` (with the HTTP status, or None for no answer).
"""

# tests: tests/unit/federation_sender/test_sender_transport.py, tests/integration/test_federation_sender.py

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

from federation_sender.transport import TransactionFailed, Transport
from homeserver.remote.client import FederationClientError, HttpResponseError


class JsonPutter(Protocol):
    """What the adapter needs of ``FederationClient``."""

    async def put_encoded(self, destination: str, path: str, body: bytes, *, timeout: float | None = None) -> Any: ...


def client_transport(client: JsonPutter) -> Transport:
    """``PUT /_matrix/federation/v1/send/{txnId}`` through the federation client; the body is
    the transaction's canonical JSON, sent and signed over as it is."""

    async def send(destination: str, txn_id: str, body: bytes, timeout: float) -> Any:
        path = f"/_matrix/federation/v1/send/{quote(txn_id, safe='')}"
        try:
            return await client.put_encoded(destination, path, body, timeout=timeout)
        except HttpResponseError as e:
            raise TransactionFailed(e.code, str(e)) from e
        except FederationClientError as e:
            raise TransactionFailed(None, str(e)) from e

    return send
