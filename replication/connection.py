# tests: tests/unit/replication/test_connection.py
"""The replication connection: a sans-I/O state machine, in the style of h11.

Rule 1: this module owns the protocol's decisions for one connection: the
opening commands, which side may send which command, keep-alive PINGs, the
timeout, the bounded outbound buffer while the transport is paused, and what
happens when the peer breaks the protocol.

Rule 2: it never touches a socket, a clock, a logger or a metric. Lines go in
(``receive_line``), commands go in (``send``), time goes in (``now``, seconds
as a float, e.g. Twisted's ``clock.seconds()``); events and lines to write come
out. The transport adapter (TCP or Redis) does the I/O, the logging and the
counting.

How an adapter drives it::

    conn = ReplicationConnection(Role.CLIENT, "fed_sender1", ConnectionConfig(
        expected_server_name="example.com"))
    conn.start(now)                                # queues NAME, PING, REPLICATE
    events = conn.receive_line(line, now)          # for every line read
    events = conn.send(PositionCommand(...), now)  # for every command to send
    events = conn.tick(now)                        # every second, or at conn.next_deadline()
    transport.write(conn.pending_lines())          # after every call above
    conn.pause_writing() / conn.resume_writing()   # from the transport's flow control

Every call that can end the connection returns a ``Closed`` event when it does;
the adapter then writes ``pending_lines()`` (the final ``ERROR``) and drops the
transport. After that, ``receive_line``, ``send`` and ``tick`` raise
``LocalProtocolError``: the connection is finished, as in h11.

Blank (whitespace-only) lines are skipped by ``receive_line``: they are not
commands, do not count as traffic for the timeout, and are never an error.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, TypeAlias, Union

import attrs

from replication.commands import (
    COMMAND_TYPES,
    MAX_LINE_LENGTH,
    Command,
    ErrorCommand,
    NameCommand,
    PingCommand,
    ReplicateCommand,
    ServerCommand,
    parse_line,
)
from replication.errors import CommandParseError, LocalProtocolError

__all__ = [
    "BadLinePolicy",
    "Closed",
    "CommandReceived",
    "ConnectionConfig",
    "ConnectionState",
    "Event",
    "KEEPALIVE_INTERVAL_SECONDS",
    "LineIgnored",
    "MAX_OUTBOUND_BUFFER",
    "PING_TIMEOUT_SECONDS",
    "ProtocolRules",
    "REDIS_RULES",
    "ReplicationConnection",
    "Role",
    "TCP_RULES",
    "TRANSITIONS",
    "Trigger",
]

#: Send a command (a PING if nothing else) when nothing was sent for this long.
KEEPALIVE_INTERVAL_SECONDS: Final = 5.0

#: Close when nothing was received for this long, once the peer has sent a PING.
PING_TIMEOUT_SECONDS: Final = 15.0

#: Commands buffered while the transport is paused before the connection gives
#: up on the peer (``Trigger.CONGESTED``).
MAX_OUTBOUND_BUFFER: Final = 10_000


class Role(enum.Enum):
    """Which end of a connection this is. Over TCP the main process is the
    SERVER and workers are CLIENTs; over Redis the role only picks the opening
    commands."""

    SERVER = "server"
    CLIENT = "client"

    @property
    def peer(self) -> Role:
        return Role.CLIENT if self is Role.SERVER else Role.SERVER


class ConnectionState(enum.Enum):
    """IDLE until ``start()``; OPEN while commands flow; CLOSED when this side
    ended it (timeout, congestion, ``close()``); ERROR when the peer broke the
    protocol. CLOSED and ERROR are final."""

    IDLE = "IDLE"
    OPEN = "OPEN"
    CLOSED = "CLOSED"
    ERROR = "ERROR"


class Trigger(enum.Enum):
    """What moves the state machine; ``Closed.reason`` is one of the last four."""

    START = "start"
    PROTOCOL_VIOLATION = "protocol_violation"
    TIMED_OUT = "timed_out"
    CONGESTED = "congested"
    CLOSE = "close"


#: The state machine, as data: (state, trigger) -> next state. A pair that is
#: not here cannot happen. docs/replication.md shows this table (a test checks).
TRANSITIONS: Final[Mapping[tuple[ConnectionState, Trigger], ConnectionState]] = MappingProxyType(
    {
        (ConnectionState.IDLE, Trigger.START): ConnectionState.OPEN,
        (ConnectionState.IDLE, Trigger.CLOSE): ConnectionState.CLOSED,
        (ConnectionState.OPEN, Trigger.PROTOCOL_VIOLATION): ConnectionState.ERROR,
        (ConnectionState.OPEN, Trigger.TIMED_OUT): ConnectionState.CLOSED,
        (ConnectionState.OPEN, Trigger.CONGESTED): ConnectionState.CLOSED,
        (ConnectionState.OPEN, Trigger.CLOSE): ConnectionState.CLOSED,
    }
)

_FINAL_STATES: Final = frozenset({ConnectionState.CLOSED, ConnectionState.ERROR})


class BadLinePolicy(enum.Enum):
    """What a line that does not parse does to the connection."""

    #: ERROR to the peer and state ERROR (TCP: the peer is one process that
    #: speaks our protocol, so a bad line means it is broken or not ours).
    CLOSE = "close"
    #: A ``LineIgnored`` event and nothing else (Redis: one bad publisher, e.g.
    #: a newer version with a command we lack, must not cut everyone off).
    IGNORE = "ignore"


_BOTH: Final = frozenset({Role.SERVER, Role.CLIENT})
_SERVER: Final = frozenset({Role.SERVER})
_CLIENT: Final = frozenset({Role.CLIENT})

# The commands start() can build: they need only this side's name and the time.
_OPENING_COMMANDS: Final = frozenset({"SERVER", "NAME", "PING", "REPLICATE"})


def _frozen_senders(value: Mapping[str, frozenset[Role]]) -> Mapping[str, frozenset[Role]]:
    return MappingProxyType({name: frozenset(roles) for name, roles in value.items()})


def _frozen_opening(value: Mapping[Role, tuple[str, ...]]) -> Mapping[Role, tuple[str, ...]]:
    return MappingProxyType({role: tuple(names) for role, names in value.items()})


def _check_senders(
    inst: ProtocolRules,
    attribute: attrs.Attribute[Mapping[str, frozenset[Role]]],
    value: Mapping[str, frozenset[Role]],
) -> None:
    if set(value) != set(COMMAND_TYPES):
        raise ValueError(
            f"ProtocolRules senders must name every command exactly once: "
            f"missing {sorted(set(COMMAND_TYPES) - set(value))}, "
            f"unknown {sorted(set(value) - set(COMMAND_TYPES))}"
        )


def _check_opening(
    inst: ProtocolRules,
    attribute: attrs.Attribute[Mapping[Role, tuple[str, ...]]],
    value: Mapping[Role, tuple[str, ...]],
) -> None:
    for role in Role:
        for name in value.get(role, ()):
            if name not in _OPENING_COMMANDS:
                raise ValueError(
                    f"ProtocolRules opening for {role.value} may only use "
                    f"{sorted(_OPENING_COMMANDS)}, got {name!r}"
                )
            if role not in inst.senders[name]:
                raise ValueError(
                    f"ProtocolRules opening for {role.value} sends {name}, "
                    f"which senders does not allow a {role.value} to send"
                )


@attrs.frozen(slots=True)
class ProtocolRules:
    """Which side may send which command, what each side sends first, and what
    a bad line does: the part of the protocol a transport chooses.

    ``TCP_RULES`` is the classic direction table; ``REDIS_RULES`` lets every
    process send everything, since on a pub/sub channel all processes are peers.
    """

    name: str
    #: command name -> the roles allowed to send it
    senders: Mapping[str, frozenset[Role]] = attrs.field(
        converter=_frozen_senders, validator=_check_senders
    )
    #: role -> names of the commands ``start()`` sends, in order
    opening: Mapping[Role, tuple[str, ...]] = attrs.field(
        converter=_frozen_opening, validator=_check_opening
    )
    bad_line: BadLinePolicy = BadLinePolicy.CLOSE

    def may_send(self, role: Role, command_name: str) -> bool:
        return role in self.senders.get(command_name, ())


#: TCP: the main process is the server, workers are clients.
TCP_RULES: Final = ProtocolRules(
    name="tcp",
    senders={
        "SERVER": _SERVER,
        "RDATA": _SERVER,
        "POSITION": _SERVER,
        "ERROR": _BOTH,
        "PING": _BOTH,
        "NAME": _CLIENT,
        "REPLICATE": _CLIENT,
        "USER_SYNC": _CLIENT,
        "CLEAR_USER_SYNC": _CLIENT,
        "FEDERATION_ACK": _CLIENT,
        "REMOTE_SERVER_UP": _BOTH,
    },
    opening={
        Role.SERVER: ("SERVER", "PING"),
        Role.CLIENT: ("NAME", "PING", "REPLICATE"),
    },
    bad_line=BadLinePolicy.CLOSE,
)

#: Redis pub/sub: every process publishes its own commands to one channel, so
#: anyone may send anything; on (re)connecting a process asks for positions.
#: Meant to be used with keepalive and timeout off (Redis has its own).
REDIS_RULES: Final = ProtocolRules(
    name="redis",
    senders={name: _BOTH for name in COMMAND_TYPES},
    opening={Role.SERVER: ("REPLICATE",), Role.CLIENT: ("REPLICATE",)},
    bad_line=BadLinePolicy.IGNORE,
)


def _positive_or_none(inst: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"ConnectionConfig {attribute.name} must be a positive number of seconds "
            f"or None (off), got {value!r}"
        )


def _positive_int(inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(
            f"ConnectionConfig {attribute.name} must be a positive integer, got {value!r}"
        )


@attrs.frozen(slots=True)
class ConnectionConfig:
    """Per-connection settings; the defaults are the protocol's.

    ``keepalive_interval`` and ``timeout`` are seconds; None turns them off
    (Redis). ``expected_server_name``: a client closes the connection if the
    server's SERVER names another homeserver.
    """

    keepalive_interval: float | None = attrs.field(
        default=KEEPALIVE_INTERVAL_SECONDS, validator=_positive_or_none
    )
    timeout: float | None = attrs.field(default=PING_TIMEOUT_SECONDS, validator=_positive_or_none)
    max_outbound_buffer: int = attrs.field(default=MAX_OUTBOUND_BUFFER, validator=_positive_int)
    rules: ProtocolRules = TCP_RULES
    expected_server_name: str | None = None

    def __attrs_post_init__(self) -> None:
        keepalive, timeout = self.keepalive_interval, self.timeout
        if keepalive is not None and timeout is not None and not timeout > keepalive:
            raise ValueError(
                f"ConnectionConfig timeout must be longer than keepalive_interval "
                f"({keepalive!r} s), or a quiet but healthy peer would be cut off; "
                f"got {timeout!r} s"
            )


# --------------------------------------------------------------------------
# Events: what the adapter learns from each call.


@attrs.frozen(slots=True)
class CommandReceived:
    """The peer sent a valid command, allowed from its side. Every command is
    reported, PING and ERROR included (the adapter may log or count them);
    the connection has already handled PING (timeout) and SERVER/NAME."""

    command: Command


@attrs.frozen(slots=True)
class LineIgnored:
    """A line that did not parse was dropped (``BadLinePolicy.IGNORE`` only).
    ``line`` is truncated to 200 characters."""

    line: str
    reason: str


@attrs.frozen(slots=True)
class Closed:
    """The connection is finished. Write ``pending_lines()`` (its final ERROR,
    if any) and drop the transport.

    ``reason``: ``PROTOCOL_VIOLATION`` (the peer's fault; state ERROR),
    ``TIMED_OUT``, ``CONGESTED`` or ``CLOSE`` (state CLOSED). ``message`` is the
    text of the ERROR sent to the peer, or why nothing was sent.
    """

    reason: Trigger
    message: str


Event: TypeAlias = Union[CommandReceived, LineIgnored, Closed]


def _printable(text: str) -> str:
    """ERROR messages must be printable; our messages quote peer input with
    repr(), but make sure."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else "?" for char in text)


def _shorten(line: str | bytes | bytearray, limit: int = 200) -> str:
    if not isinstance(line, str):
        line = bytes(line[:limit]).decode("utf-8", errors="replace")
    return line if len(line) <= limit else line[:limit] + "..."


class ReplicationConnection:
    """One replication connection's protocol state. Not thread-safe; one per
    transport connection, discarded when the transport goes away.

    ``role`` is this side; ``name`` is this side's name on the wire (the server
    name in SERVER for a server, the instance name in NAME for a client).
    """

    def __init__(
        self, role: Role, name: str, config: ConnectionConfig = ConnectionConfig()
    ) -> None:
        # Built now so that a bad name fails here rather than at start().
        if role is Role.SERVER:
            ServerCommand(name)
        else:
            NameCommand(name)
        self.role: Final = role
        self.name: Final = name
        self.config: Final = config
        self._rules = config.rules
        self._state = ConnectionState.IDLE
        self._closed: Closed | None = None
        #: The peer's name, from its SERVER (we are a client) or NAME (server).
        self.peer_name: str | None = None
        self._outbox: list[str] = []
        self._paused = False
        self._peer_pinged = False
        self._last_sent = 0.0
        self._last_received = 0.0

    # -- state ----------------------------------------------------------

    @property
    def state(self) -> ConnectionState:
        return self._state

    @property
    def closed(self) -> Closed | None:
        """The ``Closed`` event that finished the connection, if it is finished."""
        return self._closed

    @property
    def timeout_armed(self) -> bool:
        """True once the peer has sent a PING: from then on, silence for
        ``config.timeout`` seconds closes the connection."""
        return self._peer_pinged

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def buffered(self) -> int:
        """Lines waiting for ``pending_lines()``."""
        return len(self._outbox)

    def _transition(self, trigger: Trigger) -> None:
        next_state = TRANSITIONS.get((self._state, trigger))
        if next_state is None:
            raise LocalProtocolError(
                f"no transition from {self._state.name} on {trigger.value}"
            )
        self._state = next_state

    def _require_open(self, action: str) -> None:
        if self._state is ConnectionState.OPEN:
            return
        if self._state is ConnectionState.IDLE:
            raise LocalProtocolError(f"can't {action}: the connection is IDLE; call start() first")
        assert self._closed is not None
        raise LocalProtocolError(
            f"can't {action}: the connection is {self._state.name} "
            f"({self._closed.reason.value}: {self._closed.message})"
        )

    # -- opening ----------------------------------------------------------

    def start(self, now: float) -> list[Event]:
        """The transport is connected: queue this side's opening commands
        (server: SERVER, PING; client: NAME, PING, REPLICATE under TCP_RULES)
        and start the keep-alive clock."""
        if self._state is not ConnectionState.IDLE:
            raise LocalProtocolError(f"can't start: the connection is already {self._state.name}")
        self._transition(Trigger.START)
        self._last_sent = self._last_received = now
        for name in self._rules.opening.get(self.role, ()):
            self._outbox.append(self._opening_command(name, now).to_line())
        return []

    def _opening_command(self, name: str, now: float) -> Command:
        match name:
            case "SERVER":
                return ServerCommand(self.name)
            case "NAME":
                return NameCommand(self.name)
            case "PING":
                return PingCommand(_ms(now))
            case "REPLICATE":
                return ReplicateCommand()
            case _:  # ProtocolRules validates opening; unreachable
                raise LocalProtocolError(f"{name} can't be an opening command")

    # -- inbound ----------------------------------------------------------

    def receive_line(self, line: str | bytes | bytearray, now: float) -> list[Event]:
        """One line from the peer, without its ``\\n`` (a trailing ``\\r`` is
        dropped too, for people typing into telnet). Returns the events it
        caused; the peer's protocol violations come back as a ``Closed`` event
        (with an ERROR queued), never as an exception."""
        self._require_open("receive a line")
        if line[-1:] in ("\r", b"\r"):
            line = line[:-1]
        if not line or line.isspace():
            return []
        try:
            command = parse_line(line)
        except CommandParseError as e:
            if self._rules.bad_line is BadLinePolicy.IGNORE:
                return [LineIgnored(_shorten(line), e.message)]
            return self._violation(f"can't parse line: {e.message}")
        peer = self.role.peer
        if peer not in self._rules.senders[command.NAME]:
            return self._violation(
                f"{command.NAME} may not be sent by a {peer.value} ({self._rules.name} rules)"
            )
        self._last_received = now
        match command:
            case PingCommand():
                self._peer_pinged = True
            case ServerCommand(server_name=server_name):
                expected = self.config.expected_server_name
                if expected is not None and server_name != expected:
                    return self._violation(
                        f"connected to server {server_name!r}, expected {expected!r}"
                    )
                self.peer_name = server_name
            case NameCommand(name=name):
                self.peer_name = name
            case _:
                pass
        return [CommandReceived(command)]

    def _violation(self, message: str) -> list[Event]:
        message = _printable(message)
        self._outbox.append(ErrorCommand(message).to_line())
        return self._finish(Trigger.PROTOCOL_VIOLATION, message)

    def _finish(self, trigger: Trigger, message: str) -> list[Event]:
        self._transition(trigger)
        self._closed = Closed(trigger, message)
        return [self._closed]

    # -- outbound ---------------------------------------------------------

    def send(self, command: Command, now: float) -> list[Event]:
        """Queue a command for the peer. Returns ``[Closed(CONGESTED)]`` if
        the transport is paused and the buffer is full, else ``[]``.

        Raises ``LocalProtocolError`` if this side may not send the command
        (the connection stays OPEN: nothing was queued), if its line is longer
        than ``MAX_LINE_LENGTH``, or if the connection is not OPEN.
        """
        self._require_open(f"send {command.NAME}")
        if not self._rules.may_send(self.role, command.NAME):
            raise LocalProtocolError(
                f"a {self.role.value} may not send {command.NAME} ({self._rules.name} rules)",
                command=command.NAME,
            )
        line = command.to_line()
        if len(line) > MAX_LINE_LENGTH:
            raise LocalProtocolError(
                f"{command.NAME} line is {len(line)} characters, more than the "
                f"{MAX_LINE_LENGTH} a reader accepts",
                command=command.NAME,
            )
        return self._queue(line, now)

    def _queue(self, line: str, now: float) -> list[Event]:
        if self._paused and len(self._outbox) >= self.config.max_outbound_buffer:
            # Drop the backlog: the reader reconnects and fetches what it
            # missed from the database, which is cheaper than replaying it.
            message = (
                f"congested: the peer did not keep up; dropping "
                f"{len(self._outbox)} buffered commands"
            )
            self._outbox.clear()
            self._outbox.append(ErrorCommand(message).to_line())
            return self._finish(Trigger.CONGESTED, message)
        self._outbox.append(line)
        self._last_sent = now
        return []

    def pending_lines(self) -> list[str]:
        """The lines to write now (without ``\\n``), oldest first; the
        connection forgets them. Empty while paused, unless the connection is
        finished: then it holds only what must go out before the close."""
        if self._paused and self._state not in _FINAL_STATES:
            return []
        lines, self._outbox = self._outbox, []
        return lines

    def pause_writing(self) -> None:
        """The transport's buffer is full: hold lines (up to
        ``max_outbound_buffer``) until ``resume_writing()``."""
        self._paused = True

    def resume_writing(self) -> None:
        """The transport drained: ``pending_lines()`` returns what was held."""
        self._paused = False

    # -- time -------------------------------------------------------------

    def tick(self, now: float) -> list[Event]:
        """Let time pass: close on timeout (``[Closed(TIMED_OUT)]``, only once
        the peer has sent a PING), else queue a PING if nothing was sent for
        ``keepalive_interval``. Call it at least every second, or at
        ``next_deadline()``."""
        self._require_open("tick")
        timeout = self.config.timeout
        if timeout is not None and self._peer_pinged and now - self._last_received >= timeout:
            message = f"ping timeout: nothing received for {now - self._last_received:.1f} s"
            self._outbox.append(ErrorCommand(message).to_line())
            return self._finish(Trigger.TIMED_OUT, message)
        keepalive = self.config.keepalive_interval
        if keepalive is not None and now - self._last_sent >= keepalive:
            return self._queue(PingCommand(_ms(now)).to_line(), now)
        return []

    def next_deadline(self) -> float | None:
        """The earliest time at which ``tick`` will do something (send a PING
        or time out), or None if it never will."""
        if self._state is not ConnectionState.OPEN:
            return None
        deadlines = []
        if self.config.keepalive_interval is not None:
            deadlines.append(self._last_sent + self.config.keepalive_interval)
        if self.config.timeout is not None and self._peer_pinged:
            deadlines.append(self._last_received + self.config.timeout)
        return min(deadlines, default=None)

    # -- closing ----------------------------------------------------------

    def close(self, message: str | None = None) -> list[Event]:
        """This side ends the connection (shutting down, or the transport was
        lost). With a ``message``, an ``ERROR <message>`` is queued for the peer.
        Returns ``[Closed(CLOSE)]``, or ``[]`` if already finished."""
        if self._state in _FINAL_STATES:
            return []
        if message is not None and self._state is ConnectionState.OPEN:
            message = _printable(message)
            self._outbox.append(ErrorCommand(message).to_line())
        return self._finish(Trigger.CLOSE, message if message is not None else "closed locally")


def _ms(now: float) -> int:
    return int(now * 1000)
