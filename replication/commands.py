# tests: tests/unit/replication/test_commands.py tests/property/test_replication_commands.py
"""Replication commands: typed, frozen values and their one-line wire format.

This module owns the codec: text in, typed command out, and back. It knows the
exact line format of every command, as Synapse 1.163 writes it, and the limits
that keep untrusted input cheap to reject. It deliberately knows nothing about
connections, roles, time or transports; ``connection.py`` decides who may send
what and when.

Public API (everything a transport or handler needs):

- ``parse_line(line: str | bytes) -> Command``: one line, without its ``\\n``.
  Raises ``CommandParseError`` and nothing else for any malformed or unsupported
  input, so callers need exactly one ``except``. Blank lines are an error here;
  skipping them is the connection's business (``ReplicationConnection`` does).
- ``command.to_line() -> str``: the line to write, without the trailing ``\\n``.
  Every command class has it; ``parse_line(c.to_line()) == c`` for every valid
  command ``c``, and for every line Synapse 1.163 writes for a supported command,
  ``parse_line(line).to_line() == line`` exactly.
- The command classes (``RdataCommand`` ... ``RemoteServerUpCommand``), the
  ``Command`` union for exhaustive ``match``, ``COMMAND_TYPES`` (wire name to
  class) and the limits ``MAX_LINE_LENGTH``, ``MAX_INT_CHARS``, ``MAX_ROW_DEPTH``.

Constructing a command validates it: an invalid field raises
``LocalProtocolError`` naming the field, so an invalid command cannot exist.
RDATA rows are immutable JSON values: JSON arrays become tuples, JSON objects
become ``JsonObject`` (a read-only, hashable mapping). Stream tokens are
``StreamPosition`` values (``storage.tokens``), not bare ints: on the wire a
token is the decimal stream ID alone, and the parser pairs it with the
command's stream (``federation`` for FEDERATION_ACK), so a token of one stream
cannot be compared with, or applied to, another.

JSON is written the way Synapse writes it: compact separators, ASCII only
(``ensure_ascii``), no NaN or Infinity, object keys in insertion order.
"""

from __future__ import annotations

import json
import math
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from json.decoder import JSONDecoder
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Final, TypeAlias, Union, cast, final

import attrs

from replication.errors import CommandParseError, LocalProtocolError
from storage.tokens import StreamPosition

__all__ = [
    "COMMAND_TYPES",
    "ClearUserSyncCommand",
    "Command",
    "ErrorCommand",
    "FEDERATION_STREAM",
    "FederationAckCommand",
    "INT64_MAX",
    "INT64_MIN",
    "JsonObject",
    "JsonValue",
    "MAX_INT_CHARS",
    "MAX_LINE_LENGTH",
    "MAX_ROW_DEPTH",
    "NameCommand",
    "PingCommand",
    "PositionCommand",
    "RdataCommand",
    "RemoteServerUpCommand",
    "ReplicateCommand",
    "Row",
    "ServerCommand",
    "UserSyncCommand",
    "encode_json",
    "freeze_row",
    "parse_line",
]

# --------------------------------------------------------------------------
# Limits. Checked before any expensive work on untrusted input.

#: Longest accepted line, without its newline: characters for ``str`` input,
#: bytes for ``bytes`` input. Transports must use the same bound for their
#: line reader (e.g. ``LineOnlyReceiver.MAX_LENGTH``). RDATA rows carry IDs,
#: not event content, so a real line is a few hundred bytes.
MAX_LINE_LENGTH: Final = 1024 * 1024

#: Longest integer field accepted before ``int()`` is called:
#: ``-9223372036854775808`` (the smallest Postgres ``bigint``) has 20 characters.
MAX_INT_CHARS: Final = 20

#: Deepest nesting of arrays and objects accepted in an RDATA row (the row
#: itself is depth 1). Stream rows are two or three levels deep; the bound only
#: matters for JSON that clients supplied (e.g. receipt data).
MAX_ROW_DEPTH: Final = 64

#: Integer fields (tokens, timestamps) are Postgres ``bigint`` values.
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

# Integers inside rows are only bounded by what the stdlib can print
# (``sys.int_info.default_max_str_digits``, 4300 digits).
_ROW_INT_LIMIT: Final = 10**4300

#: The stream whose position FEDERATION_ACK acknowledges (its wire form names no stream).
FEDERATION_STREAM: Final = "federation"

_SHOW_CHARS: Final = 80


def _show(value: object) -> str:
    """``repr`` of a value for an error message, truncated so that a 1 MiB line
    does not become a 1 MiB message."""
    if isinstance(value, (str, bytes, bytearray)) and len(value) > _SHOW_CHARS:
        return f"{value[:_SHOW_CHARS]!r}... ({len(value)} long)"
    if isinstance(value, int) and value.bit_length() > 256:  # repr() may refuse it
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    if len(text) > _SHOW_CHARS:
        return f"{text[:_SHOW_CHARS]}... ({type(value).__name__})"
    return text


# --------------------------------------------------------------------------
# JSON values in RDATA rows.


@final
class JsonObject(Mapping[str, "JsonValue"]):
    """An immutable JSON object: a read-only mapping from ``str`` to JSON values,
    hashable, and equal to another ``JsonObject`` with the same items.

    ``JsonObject({"a": [1, 2]})`` validates and freezes its values (the list
    becomes ``(1, 2)``); an invalid value raises ``LocalProtocolError``.
    """

    __slots__ = ("_data", "_hash")

    _data: dict[str, JsonValue]
    _hash: int | None

    def __init__(self, data: Mapping[str, object] = MappingProxyType({})) -> None:
        self._data = _freeze_object(data, "row", 1)
        self._hash = None

    @classmethod
    def _trusted(cls, data: dict[str, JsonValue]) -> JsonObject:
        # For the parser and the freezer: ``data`` is already frozen and owned.
        obj = cls.__new__(cls)
        obj._data = data
        obj._hash = None
        return obj

    def __getitem__(self, key: str) -> JsonValue:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def keys(self) -> KeysView[str]:
        return self._data.keys()

    def items(self) -> ItemsView[str, JsonValue]:
        return self._data.items()

    def values(self) -> ValuesView[JsonValue]:
        return self._data.values()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, JsonObject):
            return self._data == other._data
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"JsonObject({self._data!r})"


#: A frozen JSON value: arrays are tuples, objects are ``JsonObject``.
JsonValue: TypeAlias = Union[None, bool, int, float, str, "tuple[JsonValue, ...]", JsonObject]

#: An RDATA row: a JSON array, frozen. What each position means is defined by
#: the stream (``replication/streams.py``), not by the codec.
Row: TypeAlias = tuple[JsonValue, ...]


def _freeze_value(value: object, field: str, depth: int) -> JsonValue:
    """Validate one JSON value built by code and return its frozen form.
    ``depth`` is the depth of the array or object that contains it."""
    if value is None or type(value) is str or type(value) is bool:
        return value
    if type(value) is int:
        if -_ROW_INT_LIMIT < value < _ROW_INT_LIMIT:
            return value
        raise _row_error(field, f"an integer with more than 4300 digits ({_show(value)})")
    if type(value) is float:
        if math.isfinite(value):
            return value
        raise _row_error(
            field, f"a float that is not finite ({value!r}); JSON has no NaN or Infinity"
        )
    if isinstance(value, (tuple, list)):  # named tuples become plain tuples
        return _freeze_array(value, field, depth + 1)
    if isinstance(value, Mapping):  # JsonObject too: re-checked for depth
        return JsonObject._trusted(_freeze_object(value, field, depth + 1))
    raise _row_error(
        field,
        f"a value of type {type(value).__name__} ({_show(value)}); row values must be "
        "None, bool, int, float, str, tuple/list or a str-keyed mapping",
    )


# Item types that need neither a check nor a copy (ints need a range check).
_PLAIN_TYPES: Final = frozenset({str, bool, type(None)})


def _freeze_array(items: tuple[object, ...] | list[object], field: str, depth: int) -> Row:
    if depth > MAX_ROW_DEPTH:
        raise _row_error(field, f"arrays/objects nested more than {MAX_ROW_DEPTH} deep")
    if _PLAIN_TYPES.issuperset(map(type, items)):
        # Every item is already a frozen JSON value; a tuple is kept as it is.
        return cast(Row, items if type(items) is tuple else tuple(items))
    return tuple([_freeze_value(item, field, depth) for item in items])


def _freeze_object(data: Mapping[Any, object], field: str, depth: int) -> dict[str, JsonValue]:
    if depth > MAX_ROW_DEPTH:
        raise _row_error(field, f"arrays/objects nested more than {MAX_ROW_DEPTH} deep")
    frozen: dict[str, JsonValue] = {}
    for key, item in data.items():
        if type(key) is not str:
            raise _row_error(
                field, f"an object key of type {type(key).__name__} ({_show(key)}); JSON keys are str"
            )
        frozen[key] = _freeze_value(item, field, depth)
    return frozen


def _row_error(field: str, what: str) -> LocalProtocolError:
    return LocalProtocolError(
        f"RDATA {field} must be a JSON array of JSON values, but it contains {what}",
        command="RDATA",
        field=field,
    )


def freeze_row(value: object) -> Row:
    """Validate a row built by code and return it frozen: lists become tuples,
    mappings become ``JsonObject``. Raises ``LocalProtocolError`` naming the
    problem. ``RdataCommand`` applies it to its ``row`` argument, so writers may
    pass lists and dicts."""
    if isinstance(value, (tuple, list)):
        return _freeze_array(value, "row", 1)
    raise LocalProtocolError(
        f"RDATA row must be a tuple or list (a JSON array), got {type(value).__name__}: {_show(value)}",
        command="RDATA",
        field="row",
    )


# -- JSON encoding: compact, ASCII, no NaN, as Synapse's ``json_encoder``.


def _encode_default(value: object) -> object:
    if type(value) is JsonObject:
        return value._data
    raise TypeError(f"{type(value).__name__} is not a JSON value")


_CHECK_VALUE: Final = (None, True, 1.5, "\u00e9", {"a": [()]})
_CHECK_JSON: Final = '[null,true,1.5,"\\u00e9",{"a":[[]]}]'


def _make_chunk_encoder() -> Callable[[object, int], Iterable[str]]:
    """``chunks(value, 0)``: the JSON text of ``value`` in pieces to join.

    The stdlib's C encoder, built once: ``JSONEncoder.encode`` builds a new one
    on every call, which is half of its cost for a 200-byte row. No
    circular-reference check, since frozen values cannot contain themselves.
    Falls back to ``JSONEncoder`` if this Python's C encoder is missing or
    different.
    """
    c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
    if c_make_encoder is not None:
        try:
            chunks: Callable[[object, int], Iterable[str]] = c_make_encoder(
                None, _encode_default, json.encoder.encode_basestring_ascii,
                None, ":", ",", False, False, False,
            )
            if "".join(chunks(_CHECK_VALUE, 0)) == _CHECK_JSON:
                return chunks
        except (TypeError, ValueError):
            pass
    return _python_chunk_encoder()


def _python_chunk_encoder() -> Callable[[object, int], Iterable[str]]:
    encoder = json.JSONEncoder(
        separators=(",", ":"), allow_nan=False, check_circular=False, default=_encode_default
    )

    def chunks(value: object, _indent: int) -> Iterable[str]:
        return (encoder.encode(value),)

    return chunks


_json_chunks: Final = _make_chunk_encoder()
_join: Final = "".join


def encode_json(value: object) -> str:
    """Compact ASCII JSON, the wire form of rows (as Synapse writes it)."""
    return _join(_json_chunks(value, 0))


# -- JSON decoding of untrusted rows.


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range for a float")
    return value


_DECODER: Final = JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_raw_decode: Final = _DECODER.raw_decode


def _too_deep() -> CommandParseError:
    return CommandParseError(
        f"RDATA row_json must nest arrays/objects at most {MAX_ROW_DEPTH} deep",
        command="RDATA",
        field="row_json",
    )


def _freeze_parsed(items: list[Any], budget: int, depth: int) -> tuple[Row, int]:
    """Freeze a list fresh from the JSON decoder, in place; ``depth`` is its own.

    ``budget`` is an upper bound on the arrays and objects still inside
    ``items`` (from counting ``[`` and ``{`` in the text), so the scan stops as
    soon as every container has been found: for ``["ev",[...9 values]]`` it
    looks at two items, not eleven. Values from the decoder need no type checks.
    Returns the frozen tuple and the unspent budget.
    """
    if budget:
        index = 0
        for item in items:
            kind = type(item)
            if kind is list:
                if depth >= MAX_ROW_DEPTH:
                    raise _too_deep()
                items[index], budget = _freeze_parsed(item, budget - 1, depth + 1)
                if not budget:
                    break
            elif kind is dict:
                if depth >= MAX_ROW_DEPTH:
                    raise _too_deep()
                items[index], budget = _freeze_parsed_object(item, budget - 1, depth + 1)
                if not budget:
                    break
            index += 1
    return tuple(items), budget


def _freeze_parsed_object(data: dict[str, Any], budget: int, depth: int) -> tuple[JsonObject, int]:
    if budget:
        for key, item in data.items():
            kind = type(item)
            if kind is list:
                if depth >= MAX_ROW_DEPTH:
                    raise _too_deep()
                data[key], budget = _freeze_parsed(item, budget - 1, depth + 1)
            elif kind is dict:
                if depth >= MAX_ROW_DEPTH:
                    raise _too_deep()
                data[key], budget = _freeze_parsed_object(item, budget - 1, depth + 1)
            else:
                continue
            if not budget:
                break
    return JsonObject._trusted(data), budget


def _parse_row(text: str) -> Row:
    if not text.startswith("["):
        raise CommandParseError(
            f"RDATA row_json must be a JSON array starting with '[', got {_show(text)}",
            command="RDATA",
            field="row_json",
        )
    try:
        value, end = _raw_decode(text)
    except (ValueError, RecursionError) as e:
        raise CommandParseError(
            f"RDATA row_json must be a valid JSON array, got {_show(text)} ({e})",
            command="RDATA",
            field="row_json",
        ) from e
    if end != len(text):
        raise CommandParseError(
            f"RDATA row_json must be exactly one JSON array, got extra text after "
            f"character {end}: {_show(text[end:])}",
            command="RDATA",
            field="row_json",
        )
    budget = text.count("[") - 1
    if "{" in text:
        budget += text.count("{")
    if not budget:
        return tuple(value)
    return _freeze_parsed(value, budget, 1)[0]


# --------------------------------------------------------------------------
# Field validators (attrs). They raise LocalProtocolError; parse_line turns it
# into CommandParseError.

_NAME_RULE: Final = "a non-empty string of printable characters without spaces"


def _field_error(command: str, field: str, expected: str, value: object) -> LocalProtocolError:
    return LocalProtocolError(
        f"{command} {field} must be {expected}, got {_show(value)}", command=command, field=field
    )


def _is_name(value: object) -> bool:
    # Names become space-separated fields: no spaces; printable, so no line
    # breaks, control characters or lone surrogates reach the wire.
    return type(value) is str and value != "" and " " not in value and value.isprintable()


def _check_name(inst: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not _is_name(value):
        raise _field_error(inst.NAME, attribute.name, _NAME_RULE, value)  # type: ignore[attr-defined]


def _check_int64(inst: object, attribute: attrs.Attribute[int], value: object) -> None:
    if type(value) is not int or not INT64_MIN <= value <= INT64_MAX:
        raise _field_error(
            inst.NAME, attribute.name, "an integer that fits in 64 bits", value  # type: ignore[attr-defined]
        )


def _check_position(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A ``StreamPosition`` of the command's own stream (``FEDERATION_STREAM``
    for commands without a stream field). ``StreamPosition`` itself keeps the
    value within 64 bits."""
    stream: str = getattr(inst, "stream", FEDERATION_STREAM)
    if type(value) is not StreamPosition or value.stream != stream:
        raise _field_error(
            inst.NAME,  # type: ignore[attr-defined]
            attribute.name,
            f"a StreamPosition of the {stream!r} stream",
            value,
        )


def _check_token(inst: object, attribute: attrs.Attribute[StreamPosition | None], value: object) -> None:
    if value is not None:
        _check_position(inst, attribute, value)


def _check_text(inst: object, attribute: attrs.Attribute[str], value: object) -> None:
    if type(value) is not str or not value.isprintable():
        raise _field_error(
            inst.NAME,  # type: ignore[attr-defined]
            attribute.name,
            "a string of printable characters (spaces allowed)",
            value,
        )


def _check_bool(inst: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if type(value) is not bool:
        raise _field_error(inst.NAME, attribute.name, "a bool", value)  # type: ignore[attr-defined]


def _check_device_id(inst: object, attribute: attrs.Attribute[str | None], value: object) -> None:
    if value is None:
        return
    if not _is_name(value):
        raise _field_error(
            inst.NAME, attribute.name, f"None or {_NAME_RULE}", value  # type: ignore[attr-defined]
        )
    if value == "None":
        raise _field_error(
            inst.NAME,  # type: ignore[attr-defined]
            attribute.name,
            "None or a device ID other than the string 'None' (the wire's spelling of no device)",
            value,
        )


# --------------------------------------------------------------------------
# Commands. Each class: NAME on the wire, fields, to_line().


@attrs.frozen(slots=True)
class ServerCommand:
    """Sent by the server first on every connection: its server name, so the
    client can check it reached the right homeserver.

    Format: ``SERVER <server_name>``. Example: ``SERVER example.com``
    """

    NAME: ClassVar[str] = "SERVER"
    server_name: str = attrs.field(validator=_check_name)

    def to_line(self) -> str:
        return f"SERVER {self.server_name}"


@attrs.frozen(slots=True)
class RdataCommand:
    """One row of a stream, from the process that wrote it.

    Format: ``RDATA <stream> <instance> <token|batch> <row_json>``.
    Example: ``RDATA caches master 1005 ["get_user_by_id",["@a:hs.example"],1795342117133]``

    ``token`` is a ``StreamPosition`` of ``stream``, or None, on the wire as
    ``batch``: more rows share the token that the last RDATA of the group
    carries, so readers advance only on a real token. ``row_json`` may contain
    spaces (it is the rest of the line).
    """

    NAME: ClassVar[str] = "RDATA"
    stream: str = attrs.field(validator=_check_name)
    instance: str = attrs.field(validator=_check_name)
    token: StreamPosition | None = attrs.field(validator=_check_token)
    row: Row = attrs.field(converter=freeze_row)

    def to_line(self) -> str:
        token = self.token
        return (
            f"RDATA {self.stream} {self.instance} "
            f"{'batch' if token is None else token.value} {_join(_json_chunks(self.row, 0))}"
        )


@attrs.frozen(slots=True)
class PositionCommand:
    """A writer's position in a stream, without rows: no rows were written by
    ``instance`` between ``prev_token`` and ``new_token``. Readers whose position
    for (stream, instance) is behind ``prev_token`` missed rows and fetch them
    from the database. Sent in answer to REPLICATE and whenever a writer's
    position moves without rows.

    Format: ``POSITION <stream> <instance> <prev_token> <new_token>``.
    Example: ``POSITION events master 25940 25940``. Both tokens are
    ``StreamPosition`` values of ``stream``.
    """

    NAME: ClassVar[str] = "POSITION"
    stream: str = attrs.field(validator=_check_name)
    instance: str = attrs.field(validator=_check_name)
    prev_token: StreamPosition = attrs.field(validator=_check_position)
    new_token: StreamPosition = attrs.field(validator=_check_position)

    def to_line(self) -> str:
        return f"POSITION {self.stream} {self.instance} {self.prev_token.value} {self.new_token.value}"


@attrs.frozen(slots=True)
class ErrorCommand:
    """Either side reports an error; usually the sender closes the connection
    right after.

    Format: ``ERROR <message>`` (the message is the rest of the line and may
    contain spaces). Example: ``ERROR ping timeout``
    """

    NAME: ClassVar[str] = "ERROR"
    message: str = attrs.field(validator=_check_text)

    def to_line(self) -> str:
        return f"ERROR {self.message}"


@attrs.frozen(slots=True)
class PingCommand:
    """Keep-alive, sent by both sides when they have sent nothing else for a
    while. The first PING from a peer arms the receiver's timeout.

    Format: ``PING <timestamp_ms>``. Example: ``PING 1490197665618``
    """

    NAME: ClassVar[str] = "PING"
    timestamp_ms: int = attrs.field(validator=_check_int64)

    def to_line(self) -> str:
        return f"PING {self.timestamp_ms}"


@attrs.frozen(slots=True)
class NameCommand:
    """Sent by the client at the start: its instance name, for the server's
    logs. Optional on the wire.

    Format: ``NAME <name>``. Example: ``NAME fed_sender1``
    """

    NAME: ClassVar[str] = "NAME"
    name: str = attrs.field(validator=_check_name)

    def to_line(self) -> str:
        return f"NAME {self.name}"


@attrs.frozen(slots=True)
class ReplicateCommand:
    """Sent by the client at the start: asks for a POSITION of every stream.

    Format: ``REPLICATE`` with no arguments. Written ``REPLICATE `` with one
    trailing space, exactly as Synapse writes it (``NAME + " " + args`` with
    empty args); both forms parse. Example: ``REPLICATE``
    """

    NAME: ClassVar[str] = "REPLICATE"

    def to_line(self) -> str:
        return "REPLICATE "


@attrs.frozen(slots=True)
class UserSyncCommand:
    """A user (on one device) started or stopped syncing on ``instance``; the
    presence writer uses it to decide who is online.

    Format: ``USER_SYNC <instance> <user_id> <device_id|None> <start|end> <last_sync_ms>``.
    Example: ``USER_SYNC sync1 @alice:hs.example ABCDEFGH start 1795342117133``

    A missing device is written ``None``, so a device literally named ``None``
    cannot be sent (construction refuses it).
    """

    NAME: ClassVar[str] = "USER_SYNC"
    instance: str = attrs.field(validator=_check_name)
    user_id: str = attrs.field(validator=_check_name)
    device_id: str | None = attrs.field(validator=_check_device_id)
    is_syncing: bool = attrs.field(validator=_check_bool)
    last_sync_ms: int = attrs.field(validator=_check_int64)

    def to_line(self) -> str:
        device = "None" if self.device_id is None else self.device_id
        state = "start" if self.is_syncing else "end"
        return f"USER_SYNC {self.instance} {self.user_id} {device} {state} {self.last_sync_ms}"


@attrs.frozen(slots=True)
class ClearUserSyncCommand:
    """``instance`` is shutting down: forget every USER_SYNC it sent.

    Format: ``CLEAR_USER_SYNC <instance>``. Example: ``CLEAR_USER_SYNC sync1``
    """

    NAME: ClassVar[str] = "CLEAR_USER_SYNC"
    instance: str = attrs.field(validator=_check_name)

    def to_line(self) -> str:
        return f"CLEAR_USER_SYNC {self.instance}"


@attrs.frozen(slots=True)
class FederationAckCommand:
    """The federation sender ``instance`` has processed the ``federation``
    stream up to ``token``; the stream's writer may drop what is older.

    Format: ``FEDERATION_ACK <instance> <token>``. Example: ``FEDERATION_ACK fed_sender1 0``.
    ``token`` is a ``StreamPosition`` of the ``federation`` stream (``FEDERATION_STREAM``).
    """

    NAME: ClassVar[str] = "FEDERATION_ACK"
    instance: str = attrs.field(validator=_check_name)
    token: StreamPosition = attrs.field(validator=_check_position)

    def to_line(self) -> str:
        return f"FEDERATION_ACK {self.instance} {self.token.value}"


@attrs.frozen(slots=True)
class RemoteServerUpCommand:
    """A remote homeserver talked to us, so it is up again: every process
    clears its backoff and wakes its federation queue.

    Format: ``REMOTE_SERVER_UP <server_name>``. Example: ``REMOTE_SERVER_UP other.example:8448``
    """

    NAME: ClassVar[str] = "REMOTE_SERVER_UP"
    server_name: str = attrs.field(validator=_check_name)

    def to_line(self) -> str:
        return f"REMOTE_SERVER_UP {self.server_name}"


Command: TypeAlias = Union[
    ServerCommand,
    RdataCommand,
    PositionCommand,
    ErrorCommand,
    PingCommand,
    NameCommand,
    ReplicateCommand,
    UserSyncCommand,
    ClearUserSyncCommand,
    FederationAckCommand,
    RemoteServerUpCommand,
]

#: Wire name to class, for every supported command.
COMMAND_TYPES: Final[Mapping[str, type[Command]]] = MappingProxyType(
    {
        cls.NAME: cls
        for cls in (
            ServerCommand,
            RdataCommand,
            PositionCommand,
            ErrorCommand,
            PingCommand,
            NameCommand,
            ReplicateCommand,
            UserSyncCommand,
            ClearUserSyncCommand,
            FederationAckCommand,
            RemoteServerUpCommand,
        )
    }
)

# Commands other homeservers' replication (Synapse 1.163) sends that Tributary
# does not implement: named in the error so an operator knows why.
_FOREIGN_COMMANDS: Final = frozenset({"USER_IP", "LOCK_RELEASED", "NEW_ACTIVE_TASK"})


# --------------------------------------------------------------------------
# Parsing.

# Building a parsed RDATA without its constructor: the parser has validated
# every field already, and a frozen attrs class's ``__init__`` would check and
# freeze the row a second time. The slot descriptors' setters are the cheapest
# way to fill a frozen slotted instance.
_object_new: Final = object.__new__
_set_rdata_stream: Final[Callable[[RdataCommand, str], None]] = RdataCommand.__dict__["stream"].__set__
_set_rdata_instance: Final[Callable[[RdataCommand, str], None]] = RdataCommand.__dict__["instance"].__set__
_set_rdata_token: Final[Callable[[RdataCommand, StreamPosition | None], None]] = RdataCommand.__dict__["token"].__set__
_set_position_stream: Final[Callable[[StreamPosition, str], None]] = StreamPosition.__dict__["stream"].__set__
_set_position_value: Final[Callable[[StreamPosition, int], None]] = StreamPosition.__dict__["value"].__set__


def _position(stream: str, value: int) -> StreamPosition:
    """A ``StreamPosition`` of fields the parser has already checked (a
    printable stream name, a 64-bit value), without re-running its validators."""
    position = _object_new(StreamPosition)
    _set_position_stream(position, stream)
    _set_position_value(position, value)
    return position
_set_rdata_row: Final[Callable[[RdataCommand, Row], None]] = RdataCommand.__dict__["row"].__set__


def _fields(name: str, rest: str, spec: str) -> list[str]:
    """Split ``rest`` into exactly as many fields as ``spec`` names."""
    parts = rest.split(" ")
    expected = spec.count(" ") + 1
    if len(parts) != expected:
        raise CommandParseError(
            f"{name} needs {expected} space-separated field{'s' if expected > 1 else ''} "
            f"({spec}), got {len(parts) if rest else 0}: {_show(f'{name} {rest}')}",
            command=name,
        )
    return parts


def _parse_int(name: str, field: str, text: str, expected: str = "an integer") -> int:
    """``int(text)`` for ASCII decimal digits with an optional ``-``, at most
    ``MAX_INT_CHARS`` long and within 64 bits; anything else (``+1``, ``1_0``,
    `` 1``, ``١``) is a CommandParseError."""
    if 0 < len(text) <= MAX_INT_CHARS and text.isascii():
        digits = text[1:] if text[0] == "-" else text
        if digits.isdigit():
            value = int(text)
            if INT64_MIN <= value <= INT64_MAX:
                return value
    raise CommandParseError(
        f"{name} {field} must be {expected} (decimal digits, fitting in 64 bits), got {_show(text)}",
        command=name,
        field=field,
    )


def _parse_server(rest: str) -> Command:
    return ServerCommand(_fields("SERVER", rest, "server_name")[0])


def _parse_rdata(rest: str) -> Command:
    # The hot path: validate inline, then build the command without re-running
    # the validators and the row freezer that the constructor applies.
    parts = rest.split(" ", 3)
    if len(parts) != 4:
        raise CommandParseError(
            f"RDATA needs 4 space-separated fields (stream instance token row_json), "
            f"got {len(parts) if rest else 0}: {_show('RDATA ' + rest)}",
            command="RDATA",
        )
    stream, instance, token_text, row_text = parts
    # Fields from split(" ") contain no spaces; printable rules out the rest.
    if not stream or not stream.isprintable():
        raise _field_error("RDATA", "stream", _NAME_RULE, stream)
    if not instance or not instance.isprintable():
        raise _field_error("RDATA", "instance", _NAME_RULE, instance)
    token: StreamPosition | None
    if token_text == "batch":
        token = None
    else:
        if len(token_text) <= 18 and token_text.isdigit() and token_text.isascii():
            value = int(token_text)  # at most 18 digits: always within 64 bits
        else:
            value = _parse_int("RDATA", "token", token_text, "a stream ID or 'batch'")
        # _position(stream, value), inlined: this is the hot path.
        token = _object_new(StreamPosition)
        _set_position_stream(token, stream)
        _set_position_value(token, value)
    command = _object_new(RdataCommand)
    _set_rdata_stream(command, stream)
    _set_rdata_instance(command, instance)
    _set_rdata_token(command, token)
    _set_rdata_row(command, _parse_row(row_text))
    return command


def _parse_position(rest: str) -> Command:
    stream, instance, prev_token, new_token = _fields(
        "POSITION", rest, "stream instance prev_token new_token"
    )
    if not _is_name(stream):
        raise _field_error("POSITION", "stream", _NAME_RULE, stream)
    return PositionCommand(
        stream,
        instance,
        _position(stream, _parse_int("POSITION", "prev_token", prev_token)),
        _position(stream, _parse_int("POSITION", "new_token", new_token)),
    )


def _parse_error(rest: str) -> Command:
    return ErrorCommand(rest)


def _parse_ping(rest: str) -> Command:
    (timestamp,) = _fields("PING", rest, "timestamp_ms")
    return PingCommand(_parse_int("PING", "timestamp_ms", timestamp))


def _parse_name(rest: str) -> Command:
    return NameCommand(_fields("NAME", rest, "name")[0])


def _parse_replicate(rest: str) -> Command:
    if rest:
        raise CommandParseError(
            f"REPLICATE takes no arguments, got {_show(rest)}", command="REPLICATE"
        )
    return ReplicateCommand()


def _parse_user_sync(rest: str) -> Command:
    instance, user_id, device_id, state, last_sync_ms = _fields(
        "USER_SYNC", rest, "instance user_id device_id start|end last_sync_ms"
    )
    if state not in ("start", "end"):
        raise CommandParseError(
            f"USER_SYNC state must be 'start' or 'end', got {_show(state)}",
            command="USER_SYNC",
            field="state",
        )
    return UserSyncCommand(
        instance,
        user_id,
        None if device_id == "None" else device_id,
        state == "start",
        _parse_int("USER_SYNC", "last_sync_ms", last_sync_ms),
    )


def _parse_clear_user_sync(rest: str) -> Command:
    return ClearUserSyncCommand(_fields("CLEAR_USER_SYNC", rest, "instance")[0])


def _parse_federation_ack(rest: str) -> Command:
    instance, token = _fields("FEDERATION_ACK", rest, "instance token")
    return FederationAckCommand(
        instance, _position(FEDERATION_STREAM, _parse_int("FEDERATION_ACK", "token", token))
    )


def _parse_remote_server_up(rest: str) -> Command:
    return RemoteServerUpCommand(_fields("REMOTE_SERVER_UP", rest, "server_name")[0])


_PARSERS: Final[Mapping[str, Callable[[str], Command]]] = MappingProxyType(
    {
        "RDATA": _parse_rdata,
        "POSITION": _parse_position,
        "PING": _parse_ping,
        "SERVER": _parse_server,
        "ERROR": _parse_error,
        "NAME": _parse_name,
        "REPLICATE": _parse_replicate,
        "USER_SYNC": _parse_user_sync,
        "CLEAR_USER_SYNC": _parse_clear_user_sync,
        "FEDERATION_ACK": _parse_federation_ack,
        "REMOTE_SERVER_UP": _parse_remote_server_up,
    }
)
assert _PARSERS.keys() == COMMAND_TYPES.keys()

_SUPPORTED_NAMES: Final = ", ".join(COMMAND_TYPES)


def _decode(data: bytes | bytearray) -> str:
    if len(data) > MAX_LINE_LENGTH:
        raise CommandParseError(
            f"line must be at most {MAX_LINE_LENGTH} bytes, got {len(data)}: {_show(data)}"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CommandParseError(
            f"line must be UTF-8, got invalid byte(s) at {e.start} ({e.reason}): {_show(data)}"
        ) from e


def parse_line(line: str | bytes | bytearray) -> Command:
    """Parse one line (without its ``\\n``) into a command.

    Raises ``CommandParseError`` for anything else: a line over
    ``MAX_LINE_LENGTH``, invalid UTF-8, an empty line, an unsupported command
    name, the wrong number of fields, or a field with a bad value; the message
    names the command and field, shows the value (truncated) and says what was
    expected.

    >>> parse_line("POSITION events master 53 54")  # doctest: +NORMALIZE_WHITESPACE
    PositionCommand(stream='events', instance='master',
                    prev_token=StreamPosition(stream='events', value=53),
                    new_token=StreamPosition(stream='events', value=54))
    """
    text: str
    if type(line) is str:
        if len(line) > MAX_LINE_LENGTH:
            raise CommandParseError(
                f"line must be at most {MAX_LINE_LENGTH} characters, got {len(line)}: {_show(line)}"
            )
        text = line
    elif isinstance(line, (bytes, bytearray)):
        text = _decode(line)
    else:
        raise TypeError(f"parse_line takes str or bytes, got {type(line).__name__}")
    name, _, rest = text.partition(" ")
    parser = _PARSERS.get(name)
    if parser is None:
        raise _unsupported(name, text)
    try:
        return parser(rest)
    except LocalProtocolError as e:
        raise CommandParseError(e.message, command=e.command, field=e.field) from e


def _unsupported(name: str, line: str) -> CommandParseError:
    if not line:
        return CommandParseError(
            "empty line: a line must start with a command name (connections skip blank lines)"
        )
    if not name:
        return CommandParseError(
            f"line must start with a command name, got a leading space: {_show(line)}"
        )
    if name in _FOREIGN_COMMANDS:
        why = "a Synapse command that Tributary does not implement"
    else:
        why = "unknown command"
    return CommandParseError(
        f"command {_show(name)} is not supported ({why}); supported commands: {_SUPPORTED_NAMES}",
        command=name,
    )
