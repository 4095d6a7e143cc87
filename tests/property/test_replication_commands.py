# tests: replication/commands.py replication/connection.py
"""Properties of the replication codec and connection.

- For every command type, ``parse_line(c.to_line()) == c``, and formatting the
  parsed command gives the same line again (the line is canonical).
- Arbitrary text, and arbitrary bytes, never make ``parse_line`` raise anything
  but ``CommandParseError``; nor do lines that look almost right (a real
  command name followed by junk).
- A connection fed arbitrary lines only ever returns events or finishes with a
  ``Closed`` event; it never raises while it is open.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replication.commands import (
    COMMAND_TYPES,
    FEDERATION_STREAM,
    INT64_MAX,
    INT64_MIN,
    ClearUserSyncCommand,
    Command,
    ErrorCommand,
    FederationAckCommand,
    JsonObject,
    JsonValue,
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
from replication.connection import Closed, ConnectionState, ReplicationConnection, Role
from replication.errors import CommandParseError
from storage.tokens import StreamPosition

# Names: printable, no spaces (letters, digits, punctuation, symbols).
names = st.text(
    alphabet=st.characters(categories=("L", "N", "P", "S"), exclude_characters=" "),
    min_size=1,
    max_size=20,
)
int64s = st.integers(min_value=INT64_MIN, max_value=INT64_MAX)
# Printable text for ERROR messages: names plus the (ASCII) space.
messages = st.text(
    alphabet=st.characters(categories=("L", "N", "P", "S"), include_characters=" "), max_size=40
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)  # any text: JSON escapes it (ensure_ascii)
)
json_values: st.SearchStrategy[JsonValue] = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=6), children, max_size=4).map(JsonObject),
    max_leaves=12,
)
rows = st.lists(json_values, max_size=6).map(tuple)


@st.composite
def rdata_commands(draw: st.DrawFn) -> RdataCommand:
    stream = draw(names)
    token = draw(st.none() | int64s.map(lambda value: StreamPosition(stream, value)))
    return RdataCommand(stream, draw(names), token, draw(rows))


@st.composite
def position_commands(draw: st.DrawFn) -> PositionCommand:
    stream = draw(names)
    prev, new = draw(int64s), draw(int64s)
    return PositionCommand(stream, draw(names), StreamPosition(stream, prev), StreamPosition(stream, new))


# One strategy per command, by wire name.
COMMAND_STRATEGIES: dict[str, st.SearchStrategy[Command]] = {
    "SERVER": st.builds(ServerCommand, names),
    "RDATA": rdata_commands(),
    "POSITION": position_commands(),
    "ERROR": st.builds(ErrorCommand, messages),
    "PING": st.builds(PingCommand, int64s),
    "NAME": st.builds(NameCommand, names),
    "REPLICATE": st.just(ReplicateCommand()),
    "USER_SYNC": st.builds(
        UserSyncCommand, names, names, st.none() | names.filter(lambda n: n != "None"), st.booleans(), int64s
    ),
    "CLEAR_USER_SYNC": st.builds(ClearUserSyncCommand, names),
    "FEDERATION_ACK": st.builds(
        FederationAckCommand, names, int64s.map(lambda value: StreamPosition(FEDERATION_STREAM, value))
    ),
    "REMOTE_SERVER_UP": st.builds(RemoteServerUpCommand, names),
}


def test_there_is_a_strategy_for_every_command() -> None:
    assert COMMAND_STRATEGIES.keys() == COMMAND_TYPES.keys()


@pytest.mark.parametrize("name", sorted(COMMAND_TYPES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_parse_inverts_format(name: str, data: st.DataObject) -> None:
    command = data.draw(COMMAND_STRATEGIES[name])
    assert command.NAME == name
    line = command.to_line()
    assert "\n" not in line and "\r" not in line
    parsed = parse_line(line)
    assert parsed == command
    assert parsed.to_line() == line
    assert parse_line(line.encode("utf-8")) == command


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_raises_only_command_parse_error(text: str) -> None:
    try:
        parse_line(text)
    except CommandParseError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_command_parse_error(data: bytes) -> None:
    try:
        parse_line(data)
    except CommandParseError:
        pass


near_misses = st.builds(
    lambda name, sep, rest: f"{name}{sep}{rest}",
    st.sampled_from(sorted(COMMAND_TYPES)),
    st.sampled_from([" ", "", "  "]),
    st.text(alphabet=string.printable + "[]{}\",:-0123456789batchNone\u00e9\x00", max_size=80),
)


@settings(max_examples=500, deadline=None)
@given(near_misses)
def test_lines_that_almost_parse_raise_only_command_parse_error(line: str) -> None:
    try:
        command = parse_line(line)
    except CommandParseError:
        return
    assert parse_line(command.to_line()) == command


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(near_misses, st.text(max_size=40), st.binary(max_size=40)), max_size=20))
def test_a_connection_fed_junk_only_returns_events(lines: list[str | bytes]) -> None:
    conn = ReplicationConnection(Role.SERVER, "example.com")
    conn.start(0.0)
    for now, line in enumerate(lines):
        events = conn.receive_line(line, float(now))
        if conn.state is not ConnectionState.OPEN:
            assert isinstance(events[-1], Closed)
            assert conn.pending_lines()[-1].startswith("ERROR ")
            break
