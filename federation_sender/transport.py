"""How the sender reaches a destination: one ``PUT /send/{txnId}`` per call.

The sender depends only on this protocol; the homeserver supplies the
implementation (``homeserver/federation/sender_transport.py`` wraps its
federation client), and tests supply fakes. A call either returns the
destination's 2xx answer body or raises ``TransactionFailed``; anything else it
raises is a bug in the transport and is treated as a crash of that
destination's loop.

``body`` is the transaction as canonical JSON bytes (``PlannedTransaction.body``): the
transport sends them as they are and signs the request over them, encoding nothing again.
"""

# tests: tests/unit/federation_sender/test_sender.py

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol


class TransactionFailed(Exception):
    """A ``PUT /send`` got no 2xx answer; ``status`` None means no answer at all."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status


class Transport(Protocol):
    def __call__(self, destination: str, txn_id: str, body: bytes, timeout: float) -> Awaitable[Any]: ...
