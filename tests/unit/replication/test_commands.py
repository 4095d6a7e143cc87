# tests: replication/commands.py
"""The replication codec: every command's line format, Synapse's real lines,
and the errors a malformed line gets.

The wire lines in ``data/replication_lines_synapse_1.163.txt`` are exactly what
Synapse 1.163.2 published over Redis during federation traffic (a copy of
``/work/shared/data``); Tributary must read every supported command in it and
write it back byte for byte.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import replication.commands as commands
from replication.commands import (
    COMMAND_TYPES,
    MAX_INT_CHARS,
    MAX_LINE_LENGTH,
    MAX_ROW_DEPTH,
    ClearUserSyncCommand,
    Command,
    ErrorCommand,
    FederationAckCommand,
    JsonObject,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    UserSyncCommand,
    encode_json,
    freeze_row,
    parse_line,
)
from replication.errors import CommandParseError, LocalProtocolError, ReplicationError
from storage.tokens import StreamPosition

SYNAPSE_LINES = Path(__file__).parent / "data" / "replication_lines_synapse_1.163.txt"

# One example per command: (line as written, command).
EXAMPLES: list[tuple[str, Command]] = [
    ("SERVER example.com", ServerCommand("example.com")),
    (
        'RDATA caches master 1005 ["get_user_by_id",["@a:example.com"],1795342117133]',
        RdataCommand("caches", "master", StreamPosition("caches", 1005), ("get_user_by_id", ("@a:example.com",), 1795342117133)),
    ),
    (
        'RDATA events master batch ["ev",["$e","!r","m.room.create","",null,null,null,false,false]]',
        RdataCommand(
            "events", "master", None, ("ev", ("$e", "!r", "m.room.create", "", None, None, None, False, False))
        ),
    ),
    (
        'RDATA receipts master 7 ["!r","m.read","@u:hs","$e",null,{"ts":1.5,"tags":["a"]}]',
        RdataCommand(
            "receipts", "master", StreamPosition("receipts", 7), ("!r", "m.read", "@u:hs", "$e", None, JsonObject({"ts": 1.5, "tags": ("a",)}))
        ),
    ),
    ("POSITION events master 53 54", PositionCommand("events", "master", StreamPosition("events", 53), StreamPosition("events", 54))),
    ("ERROR ping timeout", ErrorCommand("ping timeout")),
    ("ERROR ", ErrorCommand("")),
    ("PING 1490197665618", PingCommand(1490197665618)),
    ("NAME fed_sender1", NameCommand("fed_sender1")),
    ("REPLICATE ", ReplicateCommand()),
    (
        "USER_SYNC sync1 @alice:example.com ABCDEFGH start 1795342117133",
        UserSyncCommand("sync1", "@alice:example.com", "ABCDEFGH", True, 1795342117133),
    ),
    (
        "USER_SYNC sync1 @alice:example.com None end 5",
        UserSyncCommand("sync1", "@alice:example.com", None, False, 5),
    ),
    ("CLEAR_USER_SYNC sync1", ClearUserSyncCommand("sync1")),
    ("FEDERATION_ACK fed_sender1 0", FederationAckCommand("fed_sender1", StreamPosition("federation", 0))),
    ("REMOTE_SERVER_UP other.example.org:8448", RemoteServerUpCommand("other.example.org:8448")),
]


@pytest.mark.parametrize(("line", "command"), EXAMPLES, ids=[line[:30] for line, _ in EXAMPLES])
def test_every_command_parses_and_formats(line: str, command: Command) -> None:
    assert parse_line(line) == command
    assert command.to_line() == line
    assert parse_line(line.encode()) == command  # transports may hand over bytes


def test_examples_cover_every_command() -> None:
    assert {type(command) for _, command in EXAMPLES} == set(COMMAND_TYPES.values())
    assert all(cls.NAME == name for name, cls in COMMAND_TYPES.items())


# -- Synapse 1.163's real lines --------------------------------------------------

SUPPORTED_IN_FILE = ("RDATA", "POSITION", "REPLICATE", "FEDERATION_ACK")


def _synapse_lines() -> list[str]:
    return SYNAPSE_LINES.read_text(encoding="utf-8").split("\n")[:-1]  # ends with "\n"


def test_synapse_file_is_what_we_think() -> None:
    names = [line.partition(" ")[0] for line in _synapse_lines()]
    assert len(names) == 350
    assert {name: names.count(name) for name in set(names)} == {
        "RDATA": 121,
        "POSITION": 21,
        "REPLICATE": 1,
        "FEDERATION_ACK": 1,
        "LOCK_RELEASED": 205,
        "": 1,  # one blank line
    }


@pytest.mark.parametrize("name", SUPPORTED_IN_FILE)
def test_every_supported_synapse_line_round_trips_exactly(name: str) -> None:
    lines = [line for line in _synapse_lines() if line.partition(" ")[0] == name]
    assert lines
    for line in lines:
        command = parse_line(line)
        assert command.NAME == name
        assert command.to_line() == line


def test_synapse_rdata_rows_are_frozen_and_batches_have_no_token() -> None:
    rdata = [parse_line(line) for line in _synapse_lines() if line.startswith("RDATA ")]
    assert all(isinstance(command, RdataCommand) for command in rdata)
    batched = [c for c in rdata if isinstance(c, RdataCommand) and c.token is None]
    assert len(batched) == sum(1 for line in _synapse_lines() if line.startswith("RDATA events master batch "))
    first = rdata[0]
    assert first == RdataCommand(
        "caches", "master", StreamPosition("caches", 1005), ("get_user_by_id", ("@fed1_5a936acb:localhost:8448",), 1795342117133)
    )
    for command in rdata:
        assert isinstance(command, RdataCommand)
        hash(command)  # frozen all the way down: rows are tuples of JSON values


def test_synapse_replicate_line_has_a_trailing_space() -> None:
    """Synapse writes every command as NAME + " " + arguments, so REPLICATE goes
    out as "REPLICATE " and we write it the same way; the bare form parses too."""
    assert "REPLICATE " in _synapse_lines()
    assert parse_line("REPLICATE") == parse_line("REPLICATE ") == ReplicateCommand()


def test_unsupported_synapse_commands_get_a_clear_error() -> None:
    lock_lines = [line for line in _synapse_lines() if line.startswith("LOCK_RELEASED ")]
    assert len(lock_lines) == 205
    for line in lock_lines:
        with pytest.raises(CommandParseError) as caught:
            parse_line(line)
        assert "'LOCK_RELEASED' is not supported" in str(caught.value)
        assert "Synapse command" in str(caught.value)
        assert caught.value.command == "LOCK_RELEASED"
    with pytest.raises(CommandParseError, match="'NEW_ACTIVE_TASK' is not supported"):
        parse_line('NEW_ACTIVE_TASK "abc"')


def test_blank_line_is_an_error_for_the_codec() -> None:
    """Skipping blank lines is the connection's job; the codec says why it failed."""
    with pytest.raises(CommandParseError, match="empty line"):
        parse_line("")


# -- malformed lines name the field ----------------------------------------------

MALFORMED: list[tuple[str | bytes, str | None, str]] = [
    # (line, field named by the error or None, fragment of the message)
    ("RDATA events master abc []", "token", "got 'abc'"),
    ("RDATA events master +1 []", "token", "stream ID or 'batch'"),
    ("RDATA events master 1_0 []", "token", "decimal digits"),
    ("RDATA events master \u0661 []", "token", "decimal digits"),
    ("RDATA events master - []", "token", "got '-'"),
    ("RDATA events master 9223372036854775808 []", "token", "64 bits"),
    ("RDATA events master 1 {}", "row_json", "JSON array"),
    ("RDATA events master 1 [1", "row_json", "valid JSON"),
    ("RDATA events master 1 [1] x", "row_json", "extra text"),
    ("RDATA events master 1 [1] ", "row_json", "extra text"),
    ("RDATA events master 1 [NaN]", "row_json", "NaN"),
    ("RDATA events master 1 [1e999]", "row_json", "out of range"),
    ("RDATA events master 1 [" + "9" * 5000 + "]", "row_json", "valid JSON"),
    ("RDATA events master 1 " + "[" * (MAX_ROW_DEPTH + 1) + "]" * (MAX_ROW_DEPTH + 1), "row_json", "deep"),
    ("RDATA events master 1 " + "[" * 100_000, "row_json", "valid JSON"),
    ("RDATA events  1 []", "instance", "non-empty"),
    ("RDATA ev\tents master 1 []", "stream", "printable"),
    ("RDATA events master 1", None, "needs 4 space-separated fields"),
    ("RDATA", None, "got 0"),
    ("POSITION events master 1", None, "needs 4 space-separated fields"),
    ("POSITION events master x 2", "prev_token", "got 'x'"),
    ("POSITION events master 1 " + "9" * 30, "new_token", "fitting in 64 bits"),
    ("POSITION events master 1 2 3", None, "got 5"),
    ("PING abc", "timestamp_ms", "an integer"),
    ("PING", "timestamp_ms", "got ''"),
    ("PING 1 2", None, "needs 1 space-separated field"),
    ("USER_SYNC w @u:hs DEV maybe 1", "state", "'start' or 'end'"),
    ("USER_SYNC w @u:hs DEV start x", "last_sync_ms", "an integer"),
    ("USER_SYNC w @u:hs start 1", None, "needs 5"),
    ("FEDERATION_ACK fed 1 2", None, "needs 2"),
    ("FEDERATION_ACK fed x", "token", "an integer"),
    ("REPLICATE now", None, "no arguments"),
    ("SERVER ", "server_name", "non-empty"),
    ("SERVER a b", None, "needs 1"),
    ("NAME \x00", "name", "printable"),
    ("ERROR bad\ttab", "message", "printable"),
    ("CLEAR_USER_SYNC ", "instance", "non-empty"),
    ("REMOTE_SERVER_UP \u2028", "server_name", "printable"),
    ("FOO bar", None, "'FOO' is not supported (unknown command)"),
    ("rdata events master 1 []", None, "'rdata' is not supported"),
    (" PING 1", None, "leading space"),
    ("RDATA events master 1 [" + "0," * MAX_LINE_LENGTH + "0]", None, f"at most {MAX_LINE_LENGTH} characters"),
    (b"PING \xff", None, "UTF-8"),
    (b"PING 1" + b"0" * MAX_LINE_LENGTH, None, f"at most {MAX_LINE_LENGTH} bytes"),
]


@pytest.mark.parametrize(
    ("line", "field", "fragment"), MALFORMED, ids=[repr(line[:40]) for line, _, _ in MALFORMED]
)
def test_malformed_lines_name_the_field_and_value(line: str | bytes, field: str | None, fragment: str) -> None:
    with pytest.raises(CommandParseError) as caught:
        parse_line(line)
    error = caught.value
    assert fragment in error.message
    assert error.field == field
    if field is not None:
        assert f" {field} " in error.message
    assert len(error.message) < 600, "values in messages are truncated"
    assert isinstance(error, ReplicationError)


def test_integer_fields_are_bounded_before_int() -> None:
    longest = "-9223372036854775808"
    assert len(longest) == MAX_INT_CHARS
    assert parse_line(f"POSITION s i {longest} 9223372036854775807") == PositionCommand(
        "s", "i", StreamPosition("s", -(2**63)), StreamPosition("s", 2**63 - 1)
    )
    with pytest.raises(CommandParseError, match="new_token"):
        parse_line("POSITION s i 0 " + "1" * (MAX_INT_CHARS + 1))


def test_parse_line_rejects_non_text() -> None:
    with pytest.raises(TypeError, match="str or bytes"):
        parse_line(42)  # type: ignore[arg-type]


# -- JSON as Synapse writes it ------------------------------------------------------


def test_row_json_is_compact_ascii_and_keeps_key_order() -> None:
    command = RdataCommand("s", "i", StreamPosition("s", 1), ("é ☃", {"z": 1, "a": [True, None, -0.5]}, 10**20))
    assert command.to_line() == 'RDATA s i 1 ["\\u00e9 \\u2603",{"z":1,"a":[true,null,-0.5]},100000000000000000000]'
    assert parse_line(command.to_line()) == command


def test_the_fast_c_encoder_is_used_and_the_fallback_writes_the_same() -> None:
    """Rows are encoded with the stdlib's C encoder built once (the bench
    depends on it); the pure-Python fallback must write identical JSON."""
    assert type(commands._json_chunks).__module__ == "_json"
    fallback = commands._python_chunk_encoder()
    row = ("é", None, True, -1.25e-7, 10**30, {"k": [1, {"z": ()}]}, JsonObject({"o": ()}))
    assert "".join(fallback(row, 0)) == encode_json(row)
    assert encode_json(row) == (
        '["\\u00e9",null,true,-1.25e-07,1000000000000000000000000000000,{"k":[1,{"z":[]}]},{"o":[]}]'
    )


def test_row_json_with_spaces_is_accepted_and_normalised() -> None:
    """The seed document's examples put spaces after commas."""
    line = 'RDATA caches master 550953771 ["get_user_by_id", ["@bob:example.com"], 1550574873251]'
    command = parse_line(line)
    row = ("get_user_by_id", ("@bob:example.com",), 1550574873251)
    assert command == RdataCommand("caches", "master", StreamPosition("caches", 550953771), row)
    assert command.to_line() == line.replace(", ", ",")


def test_brackets_inside_strings_do_not_confuse_the_freezer() -> None:
    line = 'RDATA s i 1 ["[{[",["]",{"k":"[["}],[]]'
    command = parse_line(line)
    assert isinstance(command, RdataCommand)
    assert command.row == ("[{[", ("]", JsonObject({"k": "[["})), ())
    assert command.to_line() == line


# -- constructing commands validates them -------------------------------------------


def test_rows_built_in_code_are_frozen() -> None:
    command = RdataCommand("s", "i", None, ["a", ["b", {"c": [1]}]])  # the converter accepts any value
    assert command.row == ("a", ("b", JsonObject({"c": (1,)})))
    assert isinstance(command.row[1], tuple)
    hash(command)
    nested = command.row[1]
    assert isinstance(nested, tuple)
    obj = nested[1]
    assert isinstance(obj, JsonObject)
    with pytest.raises(TypeError):
        obj["c"] = 2  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"stream": "ev ents"}, "stream", "without spaces"),
        ({"stream": ""}, "stream", "non-empty"),
        ({"instance": "a\nb"}, "instance", "printable"),
        ({"token": "1"}, "token", "a StreamPosition of the 's' stream"),
        ({"token": 1}, "token", "a StreamPosition of the 's' stream, got 1"),
        ({"token": StreamPosition("events", 1)}, "token", "of the 's' stream, got StreamPosition(stream='events'"),
        ({"row": "[]"}, "row", "tuple or list"),
        ({"row": ({1, 2},)}, "row", "type set"),
        ({"row": (math.nan,)}, "row", "not finite"),
        ({"row": ({1: "a"},)}, "row", "object key of type int"),
        ({"row": (10**4300,)}, "row", "4300 digits"),
    ],
)
def test_invalid_rdata_cannot_be_built(kwargs: dict[str, object], field: str, fragment: str) -> None:
    fields: dict[str, object] = {"stream": "s", "instance": "i", "token": StreamPosition("s", 1), "row": ()}
    fields.update(kwargs)
    with pytest.raises(LocalProtocolError) as caught:
        RdataCommand(**fields)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert fragment in caught.value.message


def test_rows_deeper_than_the_limit_cannot_be_built() -> None:
    row: object = ()
    for _ in range(MAX_ROW_DEPTH - 1):
        row = (row,)
    assert isinstance(freeze_row(row), tuple)  # exactly MAX_ROW_DEPTH deep
    parsed = parse_line(RdataCommand("s", "i", StreamPosition("s", 1), row).to_line())
    assert isinstance(parsed, RdataCommand)
    with pytest.raises(LocalProtocolError, match="nested more than"):
        freeze_row((row,))
    with pytest.raises(LocalProtocolError, match="nested more than"):
        freeze_row(({"a": row},))


def test_other_commands_validate_their_fields() -> None:
    with pytest.raises(LocalProtocolError, match="USER_SYNC device_id .* 'None'"):
        UserSyncCommand("w", "@u:hs", "None", True, 1)
    with pytest.raises(LocalProtocolError, match="USER_SYNC is_syncing must be a bool"):
        UserSyncCommand("w", "@u:hs", None, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="ERROR message must be"):
        ErrorCommand("two\nlines")
    with pytest.raises(LocalProtocolError, match="PING timestamp_ms"):
        PingCommand(1.5)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="got an int of 16610 bits"):
        PingCommand(10**5000)
    with pytest.raises(LocalProtocolError, match="FEDERATION_ACK instance"):
        FederationAckCommand("a b", StreamPosition("federation", 1))


def test_tokens_are_positions_of_the_commands_own_stream() -> None:
    """A command cannot carry another stream's token, nor a bare int; the wire
    stays the bare stream ID."""
    with pytest.raises(LocalProtocolError, match="POSITION new_token must be a StreamPosition of the 'events' stream"):
        PositionCommand("events", "master", StreamPosition("events", 1), StreamPosition("caches", 2))
    with pytest.raises(LocalProtocolError, match="POSITION prev_token .* got 1"):
        PositionCommand("events", "master", 1, StreamPosition("events", 2))  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="FEDERATION_ACK token must be a StreamPosition of the 'federation'"):
        FederationAckCommand("fed1", StreamPosition("events", 1))
    assert commands.FEDERATION_STREAM == "federation"
    ack = parse_line("FEDERATION_ACK fed1 42")
    assert isinstance(ack, FederationAckCommand) and ack.token == StreamPosition("federation", 42)
    assert ack.to_line() == "FEDERATION_ACK fed1 42"


def test_parsed_tokens_of_different_streams_cannot_be_compared() -> None:
    """Every token parsed from Synapse's wire data belongs to its command's
    stream, and ordering two streams' tokens is a TypeError, not a number comparison."""
    tokens: dict[str, StreamPosition] = {}
    for line in _synapse_lines():
        if line.startswith(("RDATA ", "POSITION ")):
            command = parse_line(line)
            assert isinstance(command, (RdataCommand, PositionCommand))
            token = command.token if isinstance(command, RdataCommand) else command.new_token
            if token is not None:
                assert token.stream == command.stream
                tokens.setdefault(command.stream, token)
    assert {"events", "caches"} <= tokens.keys()
    with pytest.raises(TypeError, match="different streams"):
        assert tokens["events"] < tokens["caches"]
    assert tokens["events"] != tokens["caches"].at(tokens["events"].value)


def test_json_objects_are_immutable_hashable_mappings() -> None:
    a = JsonObject({"x": [1, {"y": None}]})
    b = JsonObject({"x": (1, JsonObject({"y": None}))})
    assert a == b and hash(a) == hash(b)
    assert a == {"x": (1, JsonObject({"y": None}))}
    assert a != JsonObject({"x": ()}) and a != 3
    assert list(a) == ["x"] and len(a) == 1 and "x" in a
    assert repr(JsonObject({"k": 1})) == "JsonObject({'k': 1})"
    assert encode_json((a,)) == '[{"x":[1,{"y":null}]}]'
