# tests: tests/unit/replication/test_commands.py tests/unit/replication/test_connection.py
"""The replication package's error types.

One small hierarchy, split the way h11 splits it:

- ``CommandParseError``: a line from the wire is not a command we understand
  (malformed, too long, unsupported command name). The only exception
  ``parse_line`` ever raises.
- ``LocalProtocolError``: *this* process did something the protocol does not
  allow: built a command with an invalid field, sent a command its role may not
  send, or called the connection after it closed.

What the *peer* did wrong is not an exception here: the connection turns it into
a ``Closed(reason=Trigger.PROTOCOL_VIOLATION)`` event in exactly one place, its
inbound entry point ``ReplicationConnection.receive_line``.
"""

from __future__ import annotations

__all__ = ["CommandParseError", "LocalProtocolError", "ReplicationError"]


class ReplicationError(Exception):
    """Base class of every error raised by ``replication``.

    ``command`` and ``field`` name where the problem is when it concerns one
    field of one command (e.g. ``command="RDATA"``, ``field="token"``), so that
    callers and tests need not parse the message.
    """

    def __init__(
        self, message: str, *, command: str | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.command = command
        self.field = field


class CommandParseError(ReplicationError):
    """A line could not be turned into a command; the message says which field,
    shows the value (truncated) and states what was expected."""


class LocalProtocolError(ReplicationError):
    """This process broke the protocol or misused the API (h11's
    ``LocalProtocolError``): an invalid command was built, a command was sent from
    the wrong side, or a closed connection was used."""
