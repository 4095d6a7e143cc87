# tests: tests/unit/replication/
"""Replication: how Tributary's processes tell each other about stream facts.

The sans-I/O core lives here and is importable without Twisted:

- ``replication.commands``: the typed commands and their line format
  (``parse_line``, ``Command.to_line``);
- ``replication.connection``: ``ReplicationConnection``, the per-connection
  state machine (opening, direction rules, keep-alive, timeout, congestion);
- ``replication.errors``: ``ReplicationError`` and its subclasses.

Transports (TCP, Redis) are thin adapters around the core. See
docs/replication.md for the protocol.
"""

from replication.commands import (
    COMMAND_TYPES,
    ClearUserSyncCommand,
    Command,
    ErrorCommand,
    FederationAckCommand,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    UserSyncCommand,
    parse_line,
)
from replication.connection import (
    Closed,
    CommandReceived,
    ConnectionConfig,
    ConnectionState,
    LineIgnored,
    ReplicationConnection,
    Role,
    Trigger,
)
from replication.errors import CommandParseError, LocalProtocolError, ReplicationError

__all__ = [
    "COMMAND_TYPES",
    "ClearUserSyncCommand",
    "Closed",
    "Command",
    "CommandParseError",
    "CommandReceived",
    "ConnectionConfig",
    "ConnectionState",
    "ErrorCommand",
    "FederationAckCommand",
    "LineIgnored",
    "LocalProtocolError",
    "NameCommand",
    "PingCommand",
    "PositionCommand",
    "RdataCommand",
    "RemoteServerUpCommand",
    "ReplicateCommand",
    "ReplicationConnection",
    "ReplicationError",
    "Role",
    "ServerCommand",
    "Trigger",
    "UserSyncCommand",
    "parse_line",
]
