# tests: replication/connection.py
"""The replication connection state machine, driven by a fake clock.

Time is only ever the ``now`` argument; ``ConnectionPair`` joins a server core
and a client core in memory, so these tests are the protocol's rules written as
stories: who speaks first, when PINGs go out, when silence closes a
connection, what a slow reader costs, and what a misbehaving peer gets.
"""

from __future__ import annotations

import pytest

from replication.commands import (
    COMMAND_TYPES,
    MAX_LINE_LENGTH,
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
)
from replication.connection import (
    KEEPALIVE_INTERVAL_SECONDS,
    MAX_OUTBOUND_BUFFER,
    PING_TIMEOUT_SECONDS,
    REDIS_RULES,
    TCP_RULES,
    TRANSITIONS,
    BadLinePolicy,
    Closed,
    CommandReceived,
    ConnectionConfig,
    ConnectionState,
    LineIgnored,
    ProtocolRules,
    ReplicationConnection,
    Role,
    Trigger,
)
from replication.errors import LocalProtocolError
from tests.unit.replication.helpers import CLIENT_NAME, SERVER_NAME, ConnectionPair, received
from storage.tokens import StreamPosition

# One instance of every command, to check the direction rules against.
ONE_OF_EACH: dict[str, Command] = {
    "SERVER": ServerCommand("example.com"),
    "RDATA": RdataCommand("events", "master", StreamPosition("events", 5), ("ev", ("$e",))),
    "POSITION": PositionCommand("events", "master", StreamPosition("events", 4), StreamPosition("events", 5)),
    "ERROR": ErrorCommand("oops"),
    "PING": PingCommand(1),
    "NAME": NameCommand("w1"),
    "REPLICATE": ReplicateCommand(),
    "USER_SYNC": UserSyncCommand("w1", "@u:example.com", "DEV", True, 1),
    "CLEAR_USER_SYNC": ClearUserSyncCommand("w1"),
    "FEDERATION_ACK": FederationAckCommand("w1", StreamPosition("federation", 3)),
    "REMOTE_SERVER_UP": RemoteServerUpCommand("other.example.org"),
}


def open_server(config: ConnectionConfig | None = None, now: float = 0.0) -> ReplicationConnection:
    """A started server core whose opening lines were already written."""
    conn = ReplicationConnection(Role.SERVER, SERVER_NAME, config or ConnectionConfig())
    conn.start(now)
    conn.pending_lines()
    return conn


def test_defaults_are_the_protocols() -> None:
    assert (KEEPALIVE_INTERVAL_SECONDS, PING_TIMEOUT_SECONDS, MAX_OUTBOUND_BUFFER) == (5.0, 15.0, 10_000)
    config = ConnectionConfig()
    assert (config.keepalive_interval, config.timeout, config.max_outbound_buffer) == (5.0, 15.0, 10_000)
    assert config.rules is TCP_RULES
    assert set(ONE_OF_EACH) == set(COMMAND_TYPES)


# -- opening ---------------------------------------------------------------------


def test_opening_handshake() -> None:
    """The server introduces itself and pings; the client names itself, pings
    and asks for positions. Both sides arm their timeouts on the other's PING."""
    pair = ConnectionPair(now=1490197665.618)
    pair.start()
    assert pair.transcript == [
        "> SERVER example.com",
        "> PING 1490197665618",
        "< NAME fed_sender1",
        "< PING 1490197665618",
        "< REPLICATE ",
    ]
    assert received(pair.client_events) == [ServerCommand(SERVER_NAME), PingCommand(1490197665618)]
    assert received(pair.server_events) == [NameCommand(CLIENT_NAME), PingCommand(1490197665618), ReplicateCommand()]
    assert pair.server.peer_name == CLIENT_NAME
    assert pair.client.peer_name == SERVER_NAME
    assert pair.server.timeout_armed and pair.client.timeout_armed
    assert pair.server.state is pair.client.state is ConnectionState.OPEN


def test_a_session_replicates_positions_and_rows() -> None:
    """After REPLICATE the server sends positions and rows; the client sends
    acks and sync notices; each side sees exactly what the other sent, in order."""
    pair = ConnectionPair()
    pair.start()
    pair.clear()
    rows: list[Command] = [
        PositionCommand("events", "master", StreamPosition("events", 53), StreamPosition("events", 53)),
        RdataCommand("events", "master", None, ("ev", ("$a",))),
        RdataCommand("events", "master", StreamPosition("events", 54), ("ev", ("$b",))),
        RemoteServerUpCommand("other.example.org"),
    ]
    pair.server_send(*rows)
    acks: list[Command] = [
        FederationAckCommand(CLIENT_NAME, StreamPosition("federation", 54)),
        UserSyncCommand(CLIENT_NAME, "@u:example.com", None, True, 1),
    ]
    pair.client_send(*acks)
    assert received(pair.client_events) == rows
    assert received(pair.server_events) == acks
    assert pair.transcript[1] == '> RDATA events master batch ["ev",["$a"]]'


def test_client_closes_when_the_server_is_not_the_expected_one() -> None:
    client = ReplicationConnection(Role.CLIENT, CLIENT_NAME, ConnectionConfig(expected_server_name="example.com"))
    client.start(0.0)
    client.pending_lines()
    [event] = client.receive_line("SERVER evil.example", 0.1)
    assert event == Closed(Trigger.PROTOCOL_VIOLATION, "connected to server 'evil.example', expected 'example.com'")
    assert client.pending_lines() == ["ERROR connected to server 'evil.example', expected 'example.com'"]
    assert client.state is ConnectionState.ERROR


def test_calls_before_start_or_twice_start_are_refused() -> None:
    conn = ReplicationConnection(Role.SERVER, SERVER_NAME)
    assert conn.state is ConnectionState.IDLE
    with pytest.raises(LocalProtocolError, match="IDLE; call start"):
        conn.receive_line("PING 1", 0.0)
    with pytest.raises(LocalProtocolError, match="IDLE; call start"):
        conn.send(PingCommand(1), 0.0)
    conn.start(0.0)
    with pytest.raises(LocalProtocolError, match="already OPEN"):
        conn.start(0.0)


def test_a_bad_own_name_fails_at_construction() -> None:
    with pytest.raises(LocalProtocolError, match="SERVER server_name"):
        ReplicationConnection(Role.SERVER, "has space")
    with pytest.raises(LocalProtocolError, match="NAME name"):
        ReplicationConnection(Role.CLIENT, "")


# -- keep-alive --------------------------------------------------------------------


def test_keepalive_pings_when_nothing_was_sent_for_the_interval() -> None:
    """A PING goes out 5 s after the last command sent, and any command sent
    resets that clock."""
    conn = open_server(now=100.0)
    assert conn.next_deadline() == 105.0
    assert conn.tick(104.9) == [] and conn.pending_lines() == []
    assert conn.tick(105.0) == [] and conn.pending_lines() == ["PING 105000"]
    conn.send(PositionCommand("events", "master", StreamPosition("events", 1), StreamPosition("events", 1)), 107.0)  # not a PING, still traffic
    conn.pending_lines()
    assert conn.tick(111.9) == [] and conn.pending_lines() == []
    assert conn.next_deadline() == 112.0
    conn.tick(112.0)
    assert conn.pending_lines() == ["PING 112000"]


def test_keepalive_in_a_pair_keeps_an_idle_connection_alive() -> None:
    """Two idle cores ticking every second for a minute: PINGs every 5 s each
    way, and nobody times out."""
    pair = ConnectionPair(now=0.0)
    pair.start()
    pair.clear()
    for _ in range(60):
        pair.advance(1.0)
    assert pair.server.state is pair.client.state is ConnectionState.OPEN
    assert pair.transcript.count("> PING 5000") == 1
    assert sum(line.startswith("> PING") for line in pair.transcript) == 12
    assert sum(line.startswith("< PING") for line in pair.transcript) == 12


def test_keepalive_and_timeout_can_be_turned_off() -> None:
    conn = open_server(ConnectionConfig(keepalive_interval=None, timeout=None))
    conn.receive_line("PING 1", 0.0)
    assert conn.next_deadline() is None
    assert conn.tick(10_000.0) == [] and conn.pending_lines() == []


# -- timeout -----------------------------------------------------------------------


def test_timeout_is_armed_only_after_the_peers_first_ping() -> None:
    """Someone types NAME and REPLICATE into netcat and then reads for a
    minute: without a PING from them the server never times them out. Once they
    PING, 15 s of silence closes the connection with an ERROR."""
    conn = open_server(now=0.0)
    conn.receive_line("NAME netcat", 1.0)
    conn.receive_line("REPLICATE", 2.0)
    for second in range(3, 60):
        assert conn.tick(float(second)) == []
    assert conn.state is ConnectionState.OPEN and not conn.timeout_armed
    conn.pending_lines()

    conn.receive_line("PING 1", 59.5)
    assert conn.timeout_armed
    assert conn.next_deadline() == 60.0  # the keep-alive due since the PING at 55
    conn.tick(60.0)
    assert conn.next_deadline() == 65.0
    conn.receive_line("FEDERATION_ACK netcat 3", 70.0)  # any command is traffic
    assert conn.tick(84.9) == []
    [event] = conn.tick(85.0)
    assert event == Closed(Trigger.TIMED_OUT, "ping timeout: nothing received for 15.0 s")
    assert conn.pending_lines()[-1] == "ERROR ping timeout: nothing received for 15.0 s"
    assert conn.state is ConnectionState.CLOSED
    assert conn.next_deadline() is None
    with pytest.raises(LocalProtocolError, match=r"can't tick: the connection is CLOSED \(timed_out: ping timeout"):
        conn.tick(86.0)


def test_a_silent_peer_in_a_pair_times_out_after_15_seconds() -> None:
    """The client stops ticking (a frozen worker): the server closes it."""
    pair = ConnectionPair(now=0.0)
    pair.start()
    for _ in range(14):
        pair.now += 1.0
        assert pair.server.tick(pair.now) in ([],)
    pair.now += 1.0
    [event] = pair.server.tick(pair.now)
    assert isinstance(event, Closed) and event.reason is Trigger.TIMED_OUT


def test_blank_lines_are_skipped_and_are_not_traffic() -> None:
    conn = open_server(now=0.0)
    conn.receive_line("PING 1", 0.0)
    for line in ("", "   ", "\r", b"", b"\t"):
        assert conn.receive_line(line, 10.0) == []
    [event] = conn.tick(15.0)
    assert isinstance(event, Closed) and event.reason is Trigger.TIMED_OUT


def test_a_trailing_carriage_return_is_dropped() -> None:
    conn = open_server()
    assert conn.receive_line("PING 7\r", 1.0) == [CommandReceived(PingCommand(7))]
    assert conn.receive_line(b"REPLICATE\r", 1.0) == [CommandReceived(ReplicateCommand())]


# -- congestion --------------------------------------------------------------------


def test_paused_transport_holds_lines_until_resumed() -> None:
    conn = open_server(ConnectionConfig(max_outbound_buffer=3))
    conn.pause_writing()
    for token in (1, 2, 3):
        assert conn.send(RdataCommand("events", "master", StreamPosition("events", token), ()), 1.0) == []
    assert conn.pending_lines() == [] and conn.buffered == 3
    conn.resume_writing()
    assert conn.pending_lines() == [f"RDATA events master {token} []" for token in (1, 2, 3)]


def test_a_reader_that_does_not_keep_up_is_disconnected() -> None:
    """The transport stays paused while the writer produces 4 rows with room for
    3: the backlog is dropped, the reader gets one ERROR and the connection
    closes as congested. The reader will reconnect and read the gap from the
    database."""
    conn = open_server(ConnectionConfig(max_outbound_buffer=3))
    conn.pause_writing()
    for token in (1, 2, 3):
        conn.send(RdataCommand("events", "master", StreamPosition("events", token), ()), 1.0)
    [event] = conn.send(RdataCommand("events", "master", StreamPosition("events", 4), ()), 1.0)
    assert event == Closed(Trigger.CONGESTED, "congested: the peer did not keep up; dropping 3 buffered commands")
    assert conn.state is ConnectionState.CLOSED
    assert conn.closed == event
    assert conn.pending_lines() == ["ERROR congested: the peer did not keep up; dropping 3 buffered commands"]
    with pytest.raises(LocalProtocolError, match=r"can't send RDATA: the connection is CLOSED \(congested"):
        conn.send(RdataCommand("events", "master", StreamPosition("events", 5), ()), 1.0)


def test_keepalive_pings_count_against_the_buffer() -> None:
    conn = open_server(ConnectionConfig(max_outbound_buffer=2), now=0.0)
    conn.pause_writing()
    conn.tick(5.0)
    conn.tick(10.0)
    [event] = conn.tick(15.0)
    assert isinstance(event, Closed) and event.reason is Trigger.CONGESTED


def test_a_burst_while_writable_is_not_congestion() -> None:
    """The bound is for a reader that stopped reading, not for bursts: with the
    transport writable, a writer may queue far more than the bound at once."""
    conn = open_server(ConnectionConfig(max_outbound_buffer=10))
    for token in range(1000):
        assert conn.send(RdataCommand("events", "master", StreamPosition("events", token), ()), 1.0) == []
    assert len(conn.pending_lines()) == 1000


def test_default_buffer_bound_is_ten_thousand_commands() -> None:
    conn = open_server()
    conn.pause_writing()
    command = PositionCommand("events", "master", StreamPosition("events", 1), StreamPosition("events", 1))
    for _ in range(MAX_OUTBOUND_BUFFER):
        assert conn.send(command, 1.0) == []
    [event] = conn.send(command, 1.0)
    assert isinstance(event, Closed) and event.reason is Trigger.CONGESTED


# -- who may send what -------------------------------------------------------------

TCP_DIRECTIONS = {
    "SERVER": "S",
    "RDATA": "S",
    "POSITION": "S",
    "ERROR": "SC",
    "PING": "SC",
    "NAME": "C",
    "REPLICATE": "C",
    "USER_SYNC": "C",
    "CLEAR_USER_SYNC": "C",
    "FEDERATION_ACK": "C",
    "REMOTE_SERVER_UP": "SC",
}


def test_tcp_direction_table() -> None:
    for name, sides in TCP_DIRECTIONS.items():
        assert TCP_RULES.may_send(Role.SERVER, name) == ("S" in sides), name
        assert TCP_RULES.may_send(Role.CLIENT, name) == ("C" in sides), name


@pytest.mark.parametrize("name", sorted(COMMAND_TYPES))
@pytest.mark.parametrize("receiver_role", [Role.SERVER, Role.CLIENT])
def test_commands_from_the_wrong_side_are_rejected_with_error(name: str, receiver_role: Role) -> None:
    receiver = ReplicationConnection(receiver_role, "me")
    receiver.start(0.0)
    receiver.pending_lines()
    line = ONE_OF_EACH[name].to_line()
    events = receiver.receive_line(line, 1.0)
    if TCP_RULES.may_send(receiver_role.peer, name):
        assert events == [CommandReceived(ONE_OF_EACH[name])]
        assert receiver.state is ConnectionState.OPEN
    else:
        message = f"{name} may not be sent by a {receiver_role.peer.value} (tcp rules)"
        assert events == [Closed(Trigger.PROTOCOL_VIOLATION, message)]
        assert receiver.pending_lines() == [f"ERROR {message}"]
        assert receiver.state is ConnectionState.ERROR
        with pytest.raises(LocalProtocolError, match="connection is ERROR"):
            receiver.receive_line("PING 1", 2.0)


def test_sending_from_the_wrong_side_is_a_local_error_and_changes_nothing() -> None:
    pair = ConnectionPair()
    pair.start()
    with pytest.raises(LocalProtocolError, match="a client may not send RDATA"):
        pair.client.send(ONE_OF_EACH["RDATA"], pair.now)
    with pytest.raises(LocalProtocolError, match="a server may not send REPLICATE"):
        pair.server.send(ReplicateCommand(), pair.now)
    assert pair.client.state is pair.server.state is ConnectionState.OPEN
    assert pair.client.pending_lines() == []


def test_an_unparseable_line_is_a_protocol_violation_over_tcp() -> None:
    conn = open_server()
    [event] = conn.receive_line("LOCK_RELEASED [\"master\",\"lock\",\"key\"]", 1.0)
    assert isinstance(event, Closed) and event.reason is Trigger.PROTOCOL_VIOLATION
    assert event.message.startswith("can't parse line: command 'LOCK_RELEASED' is not supported")
    [error_line] = conn.pending_lines()
    assert error_line.startswith("ERROR can't parse line: command 'LOCK_RELEASED'")
    assert conn.state is ConnectionState.ERROR


def test_bytes_that_are_not_utf8_are_a_protocol_violation() -> None:
    conn = open_server()
    [event] = conn.receive_line(b"PING \xff\xfe", 1.0)
    assert isinstance(event, Closed) and "UTF-8" in event.message
    assert conn.pending_lines()[0].isprintable()


def test_an_error_from_the_peer_is_reported_not_fatal() -> None:
    conn = open_server()
    assert conn.receive_line("ERROR something broke", 1.0) == [CommandReceived(ErrorCommand("something broke"))]
    assert conn.state is ConnectionState.OPEN


def test_lines_longer_than_a_reader_accepts_are_not_sent() -> None:
    conn = open_server()
    with pytest.raises(LocalProtocolError, match=f"more than the {MAX_LINE_LENGTH}"):
        conn.send(RdataCommand("s", "master", StreamPosition("s", 1), ("x" * MAX_LINE_LENGTH,)), 1.0)
    assert conn.state is ConnectionState.OPEN


# -- Redis rules -------------------------------------------------------------------


def test_redis_rules_let_everyone_send_everything_and_ignore_bad_lines() -> None:
    """On a Redis channel every process is a peer, and one bad publisher must
    not cut everyone off."""
    conn = ReplicationConnection(
        Role.CLIENT, "worker1", ConnectionConfig(keepalive_interval=None, timeout=None, rules=REDIS_RULES)
    )
    conn.start(0.0)
    assert conn.pending_lines() == ["REPLICATE "]
    for command in ONE_OF_EACH.values():
        assert conn.receive_line(command.to_line(), 1.0) == [CommandReceived(command)]
        assert REDIS_RULES.may_send(Role.CLIENT, command.NAME)
    [event] = conn.receive_line('LOCK_RELEASED ["master","lock","key"]', 1.0)
    assert isinstance(event, LineIgnored)
    assert event.line == 'LOCK_RELEASED ["master","lock","key"]'
    assert "not supported" in event.reason
    assert conn.state is ConnectionState.OPEN
    assert conn.pending_lines() == []


def test_protocol_rules_are_validated() -> None:
    senders = dict(TCP_RULES.senders)
    del senders["PING"]
    with pytest.raises(ValueError, match=r"missing \['PING'\]"):
        ProtocolRules("broken", senders, TCP_RULES.opening)
    with pytest.raises(ValueError, match="which senders does not allow a client"):
        ProtocolRules("broken", TCP_RULES.senders, {Role.CLIENT: ("SERVER",)})
    with pytest.raises(ValueError, match="may only use"):
        ProtocolRules("broken", TCP_RULES.senders, {Role.CLIENT: ("RDATA",)})
    assert BadLinePolicy.CLOSE is TCP_RULES.bad_line


# -- closing -----------------------------------------------------------------------


def test_close_sends_an_error_once_and_is_idempotent() -> None:
    conn = open_server()
    assert conn.close("server stopping") == [Closed(Trigger.CLOSE, "server stopping")]
    assert conn.pending_lines() == ["ERROR server stopping"]
    assert conn.close("again") == []
    assert conn.state is ConnectionState.CLOSED
    idle = ReplicationConnection(Role.CLIENT, CLIENT_NAME)
    assert idle.close() == [Closed(Trigger.CLOSE, "closed locally")]
    assert idle.pending_lines() == []


def test_final_lines_go_out_even_while_paused() -> None:
    conn = open_server()
    conn.pause_writing()
    conn.send(PingCommand(1), 1.0)
    conn.close("bye")
    assert conn.pending_lines() == ["PING 1", "ERROR bye"]


def test_every_state_change_follows_the_transition_table() -> None:
    """TRANSITIONS is the whole state machine: every state the tests above
    reach is an entry, and every entry is reachable."""
    reached = set()
    conn = ReplicationConnection(Role.SERVER, SERVER_NAME)
    conn.close()
    reached.add((ConnectionState.IDLE, Trigger.CLOSE))
    conn = open_server()
    reached.add((ConnectionState.IDLE, Trigger.START))
    conn.receive_line("RDATA a b 1 []", 1.0)
    reached.add((ConnectionState.OPEN, Trigger.PROTOCOL_VIOLATION))
    conn = open_server(ConnectionConfig(max_outbound_buffer=1))
    conn.pause_writing()
    conn.send(PingCommand(1), 0.0)
    conn.send(PingCommand(1), 0.0)
    reached.add((ConnectionState.OPEN, Trigger.CONGESTED))
    conn = open_server()
    conn.receive_line("PING 1", 0.0)
    conn.tick(100.0)
    reached.add((ConnectionState.OPEN, Trigger.TIMED_OUT))
    conn = open_server()
    conn.close()
    reached.add((ConnectionState.OPEN, Trigger.CLOSE))
    assert reached == set(TRANSITIONS)
    assert {TRANSITIONS[key] for key in reached} == {
        ConnectionState.OPEN,
        ConnectionState.CLOSED,
        ConnectionState.ERROR,
    }


# -- configuration -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"keepalive_interval": 0}, "keepalive_interval must be a positive number"),
        ({"timeout": -1.0}, "timeout must be a positive number"),
        ({"timeout": True}, "timeout must be a positive number"),
        ({"timeout": 5.0}, "timeout must be longer than keepalive_interval"),
        ({"max_outbound_buffer": 0}, "max_outbound_buffer must be a positive integer"),
    ],
)
def test_bad_config_is_refused_with_the_setting_named(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ConnectionConfig(**kwargs)  # type: ignore[arg-type]
