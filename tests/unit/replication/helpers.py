# tests: helper for tests/unit/replication/test_connection.py
"""Test helpers for the replication core: a server and a client joined in memory.

Like h11's ``ConnectionPair``: no sockets and no reactor, just two
``ReplicationConnection`` objects whose pending lines are handed to each other,
and a clock that only moves when a test says so.
"""

from __future__ import annotations

from collections.abc import Iterable

from replication.commands import Command
from replication.connection import (
    CommandReceived,
    ConnectionConfig,
    ConnectionState,
    Event,
    ReplicationConnection,
    Role,
)

SERVER_NAME = "example.com"
CLIENT_NAME = "fed_sender1"


class ConnectionPair:
    """A server core and a client core joined by an in-memory "wire".

    ``transcript`` records every line that crossed, as ``"> line"`` (server to
    client) or ``"< line"`` (client to server), the notation of
    docs/replication.md. ``server_events``/``client_events`` collect every event
    each side returned.
    """

    def __init__(
        self,
        server_config: ConnectionConfig | None = None,
        client_config: ConnectionConfig | None = None,
        now: float = 1000.0,
    ) -> None:
        self.now = now
        self.server = ReplicationConnection(
            Role.SERVER, SERVER_NAME, server_config or ConnectionConfig()
        )
        self.client = ReplicationConnection(
            Role.CLIENT,
            CLIENT_NAME,
            client_config or ConnectionConfig(expected_server_name=SERVER_NAME),
        )
        self.transcript: list[str] = []
        self.server_events: list[Event] = []
        self.client_events: list[Event] = []

    def start(self) -> None:
        """Both sides connect at ``now`` and exchange their opening lines."""
        self.server_events += self.server.start(self.now)
        self.client_events += self.client.start(self.now)
        self.pump()

    def pump(self) -> None:
        """Deliver pending lines both ways until neither side has any, as a
        wire with no delay would. A side that is finished stops receiving."""
        while True:
            to_client = self.server.pending_lines()
            to_server = self.client.pending_lines()
            if not to_client and not to_server:
                return
            for line in to_client:
                self.transcript.append(f"> {line}")
                if self.client.state is ConnectionState.OPEN:
                    self.client_events += self.client.receive_line(line, self.now)
            for line in to_server:
                self.transcript.append(f"< {line}")
                if self.server.state is ConnectionState.OPEN:
                    self.server_events += self.server.receive_line(line, self.now)

    def server_send(self, *commands: Command) -> None:
        for command in commands:
            self.server_events += self.server.send(command, self.now)
        self.pump()

    def client_send(self, *commands: Command) -> None:
        for command in commands:
            self.client_events += self.client.send(command, self.now)
        self.pump()

    def advance(self, seconds: float) -> None:
        """Move the clock, tick both open sides, and deliver what they sent."""
        self.now += seconds
        for conn, events in ((self.server, self.server_events), (self.client, self.client_events)):
            if conn.state is ConnectionState.OPEN:
                events += conn.tick(self.now)
        self.pump()

    def clear(self) -> None:
        """Forget the transcript and events so far (e.g. after the opening)."""
        self.transcript.clear()
        self.server_events.clear()
        self.client_events.clear()


def received(events: Iterable[Event]) -> list[Command]:
    """The commands among ``events``."""
    return [event.command for event in events if isinstance(event, CommandReceived)]
