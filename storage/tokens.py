"""Stream tokens: one writer's position in one stream, vector-clock positions in a
stream, and the composite ``/sync`` token.

This module owns the token types and their string forms, and nothing else: it
is pure (no database, no Twisted). A token names writers by the small integer
the ``instance_map`` table gives them; turning instance names into those IDs is
the job of ``storage.stores.instance_map``. A malformed token from a client
raises ``InvalidTokenError``, which the HTTP layer maps to ``400 M_INVALID_PARAM``.

``StreamPosition(stream="events", value=54)`` is a stream ID in a named stream,
as replication commands carry it: comparing positions of two different streams
raises ``TypeError`` instead of silently comparing numbers.

String forms of the vector clocks (docs/streams.md has the full story):

- ``s{pos}``: every writer is at ``pos``;
- ``m{min}~{id}.{pos}~{id}.{pos}``: every writer is at ``min`` except the listed
  ones, which are ahead of it (ids ascending, each ``pos > min``);
- the composite ``/sync`` token joins one component per stream with ``_``:
  the events component in the form above, the others as a bare ``{pos}`` or the
  ``m...`` form, e.g. ``s1843_12_0_7_3_m90~2.94_41``.

Each value has exactly one string form: parsing rejects anything that would
not be produced by serialising, so ``str(parse(s)) == s`` whenever parse succeeds.
"""

# tests: tests/unit/storage/test_tokens.py, tests/property/test_tokens.py

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar, Final, Self

import attrs

#: Largest stream position: stream IDs are PostgreSQL ``bigint``.
MAX_POSITION: Final = 2**63 - 1
#: Largest instance ID (``instance_map.instance_id`` is an ``integer``).
MAX_INSTANCE_ID: Final = 2**31 - 1
#: Longest token string accepted before any parsing is attempted.
MAX_TOKEN_LENGTH: Final = 4096

_MAX_POSITION_DIGITS: Final = len(str(MAX_POSITION))
_MAX_INSTANCE_DIGITS: Final = len(str(MAX_INSTANCE_ID))


class InvalidTokenError(ValueError):
    """A token string that is not one this server issues.

    Carries what the HTTP layer needs for ``400 M_INVALID_PARAM``: ``errcode``,
    ``http_status``, and a message that names the token kind, shows (a bounded
    prefix of) the value and says what was expected.
    """

    errcode: Final = "M_INVALID_PARAM"
    http_status: Final = 400

    def __init__(self, kind: str, token: object, reason: str) -> None:
        shown = token[:100] if isinstance(token, str) else token
        super().__init__(f"invalid {kind} {shown!r}: {reason}")
        self.kind = kind
        self.token = shown
        self.reason = reason


#: Smallest stream ID a ``StreamPosition`` holds (Postgres ``bigint``; replication
#: carries signed 64-bit tokens, as Synapse's wire format does).
MIN_STREAM_ID: Final = -(2**63)


def _check_stream_id(inst: object, attribute: object, value: int) -> None:
    if type(value) is not int or not MIN_STREAM_ID <= value <= MAX_POSITION:
        raise ValueError(f"a stream position's value must be an int that fits in 64 bits, got {value!r}")


def _check_stream_name(inst: object, attribute: object, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"a stream position's stream must be a non-empty stream name, got {value!r}")


@attrs.frozen(slots=True, order=False)
class StreamPosition:
    """A stream ID in one named stream: where a writer is, or the ID of a row.

    Positions of the same stream compare by ``value``; comparing positions of
    two different streams (or a position with a bare int) raises ``TypeError``,
    so a token of one stream can never be mistaken for another's. Equality is
    plain: positions of different streams are simply unequal.

    >>> StreamPosition("events", 53) < StreamPosition("events", 54)
    True
    """

    stream: str = attrs.field(validator=_check_stream_name)
    value: int = attrs.field(validator=_check_stream_id)

    def _other_value(self, other: object, op: str) -> int:
        if type(other) is not StreamPosition:
            raise TypeError(
                f"cannot compare a StreamPosition of {self.stream!r} with {type(other).__name__} ({other!r}) using {op}"
            )
        if other.stream != self.stream:
            raise TypeError(
                f"cannot compare positions of different streams: {self.stream!r} {op} {other.stream!r}"
            )
        return other.value

    def __lt__(self, other: StreamPosition) -> bool:
        return self.value < self._other_value(other, "<")

    def __le__(self, other: StreamPosition) -> bool:
        return self.value <= self._other_value(other, "<=")

    def __gt__(self, other: StreamPosition) -> bool:
        return self.value > self._other_value(other, ">")

    def __ge__(self, other: StreamPosition) -> bool:
        return self.value >= self._other_value(other, ">=")

    def at(self, value: int) -> StreamPosition:
        """Another position in the same stream."""
        return StreamPosition(self.stream, value)

    def __str__(self) -> str:
        return f"{self.stream}@{self.value}"


def _parse_uint(kind: str, whole: str, text: str, what: str, max_digits: int, max_value: int) -> int:
    """A non-negative decimal integer without sign, leading zeros or spaces."""
    if not text:
        raise InvalidTokenError(kind, whole, f"{what} is empty")
    if not (text.isascii() and text.isdigit()):
        raise InvalidTokenError(kind, whole, f"{what} {text[:30]!r} is not a decimal number")
    if len(text) > 1 and text[0] == "0":
        raise InvalidTokenError(kind, whole, f"{what} {text[:30]!r} has a leading zero")
    if len(text) > max_digits:
        raise InvalidTokenError(kind, whole, f"{what} has {len(text)} digits; at most {max_digits} are allowed")
    value = int(text)
    if value > max_value:
        raise InvalidTokenError(kind, whole, f"{what} {value} is larger than {max_value}")
    return value


def _check_position(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_POSITION:
        raise ValueError(f"{what} must be an int between 0 and {MAX_POSITION}, got {value!r}")
    return value


def _validate_entries(inst: _VectorClock, attribute: object, value: tuple[tuple[int, int], ...]) -> None:
    previous_id = 0
    for entry in value:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"instance_positions entries must be (instance_id, position) pairs, got {entry!r}")
        instance_id, position = entry
        if type(instance_id) is not int or not 1 <= instance_id <= MAX_INSTANCE_ID:
            raise ValueError(f"instance IDs must be ints between 1 and {MAX_INSTANCE_ID}, got {instance_id!r}")
        if instance_id <= previous_id:
            raise ValueError(f"instance IDs must be unique and ascending, got {instance_id} after {previous_id}")
        _check_position(position, f"the position of instance {instance_id}")
        if position <= inst.minimum:
            raise ValueError(
                f"instance {instance_id} is listed at {position}, not ahead of the minimum {inst.minimum}; "
                "only writers ahead of the minimum are listed (use from_positions to normalise)"
            )
        previous_id = instance_id


def _validate_minimum(inst: object, attribute: object, value: int) -> None:
    _check_position(value, "minimum")


@attrs.frozen(slots=True)
class _VectorClock:
    """A position in a multi-writer stream: ``minimum`` for every writer, except the
    writers in ``instance_positions`` (``(instance_id, position)`` ascending by ID),
    which are further ahead.

    The token covers, for every writer ``i``, the facts ``i`` wrote with stream IDs
    up to ``get(i)``. Tokens are partially ordered: two tokens where each is
    ahead for some writer are neither before nor after each other.
    """

    minimum: int = attrs.field(validator=_validate_minimum)
    instance_positions: tuple[tuple[int, int], ...] = attrs.field(default=(), validator=_validate_entries)

    #: Names the token kind in error messages.
    KIND: ClassVar[str] = "stream token"

    @classmethod
    def from_positions(cls, positions: Mapping[int, int], minimum: int | None = None) -> Self:
        """The token for a vector of positions keyed by instance ID.

        ``minimum`` defaults to the smallest position (0 for an empty vector); entries
        at or below it are dropped, because the minimum already covers them.
        """
        if minimum is None:
            minimum = min(positions.values(), default=0)
        return cls(minimum, tuple(sorted((i, p) for i, p in positions.items() if p > minimum)))

    @classmethod
    def from_writer_positions(
        cls, positions: Mapping[str, int], writers: Iterable[str], instance_ids: Mapping[str, int]
    ) -> Self:
        """The token for a generator's view (``get_positions()``, ``writers``).

        The minimum is the linear position (the smallest of the configured
        writers' positions); writers ahead of it are listed under their
        ``instance_map`` IDs. Instances that are no longer writers are left out:
        the minimum already covers everything they wrote.
        """
        current = {writer: positions.get(writer, 0) for writer in writers}
        if not current:
            raise ValueError("a stream token needs at least one writer")
        minimum = min(current.values())
        ahead: dict[int, int] = {}
        for writer, position in current.items():
            if position > minimum:
                try:
                    ahead[instance_ids[writer]] = position
                except KeyError:
                    raise ValueError(f"writer {writer!r} has no instance ID; ensure it in instance_map first") from None
        return cls.from_positions(ahead, minimum)

    @classmethod
    def at(cls, position: int) -> Self:
        """The token where every writer is at ``position``."""
        return cls(position)

    def get(self, instance_id: int) -> int:
        """This token's position for one writer."""
        for listed_id, position in self.instance_positions:
            if listed_id == instance_id:
                return position
        return self.minimum

    @property
    def max_position(self) -> int:
        """The largest position of any writer (the minimum when none is ahead)."""
        return max((p for _, p in self.instance_positions), default=self.minimum)

    def _merged(self, other: _VectorClock) -> Iterator[tuple[int, int, int]]:
        """``(instance_id, self position, other position)`` for every listed instance."""
        ids = {i for i, _ in self.instance_positions} | {i for i, _ in other.instance_positions}
        for instance_id in sorted(ids):
            yield instance_id, self.get(instance_id), other.get(instance_id)

    def is_before_or_equal(self, other: Self) -> bool:
        """True when no writer is further in this token than in ``other``."""
        if self.minimum > other.minimum:
            return False
        if not self.instance_positions:  # one writer, or all at the minimum: the usual case
            return True
        return all(mine <= theirs for _, mine, theirs in self._merged(other))

    def is_before(self, other: Self) -> bool:
        """True when ``other`` covers everything this token covers, and more."""
        return self != other and self.is_before_or_equal(other)

    def is_after(self, other: Self) -> bool:
        """True when this token covers everything ``other`` covers, and more."""
        return other.is_before(self)

    def advance(self, other: Self) -> Self:
        """The smallest token covering both: the position-wise maximum."""
        minimum = max(self.minimum, other.minimum)
        merged = {i: max(mine, theirs) for i, mine, theirs in self._merged(other)}
        return type(self).from_positions(merged, minimum)

    def advance_instance(self, instance_id: int, position: int) -> Self:
        """This token with one writer moved forward to ``position`` (never backwards)."""
        if position <= self.get(instance_id):
            return self
        positions = dict(self.instance_positions)
        positions[instance_id] = position
        return type(self).from_positions(positions, self.minimum)

    def to_string(self) -> str:
        if not self.instance_positions:
            return f"s{self.minimum}"
        entries = "~".join(f"{i}.{p}" for i, p in self.instance_positions)
        return f"m{self.minimum}~{entries}"

    def __str__(self) -> str:
        return self.to_string()

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse ``s{pos}`` or ``m{min}~{id}.{pos}~...``; raise InvalidTokenError otherwise."""
        return cls._parse(text, text, bare_allowed=False)

    @classmethod
    def _parse(cls, text: object, whole: object, *, bare_allowed: bool) -> Self:
        kind = cls.KIND
        if not isinstance(text, str):
            raise InvalidTokenError(kind, whole, f"expected a string, got {type(text).__name__}")
        if len(text) > MAX_TOKEN_LENGTH:
            raise InvalidTokenError(kind, whole, f"is {len(text)} characters long; at most {MAX_TOKEN_LENGTH}")
        whole_text = whole if isinstance(whole, str) else text
        if text.startswith("s"):
            return cls(_parse_uint(kind, whole_text, text[1:], "the position", _MAX_POSITION_DIGITS, MAX_POSITION))
        if bare_allowed and text[:1].isdigit():
            return cls(_parse_uint(kind, whole_text, text, "the position", _MAX_POSITION_DIGITS, MAX_POSITION))
        if not text.startswith("m"):
            forms = "'s{pos}', '{pos}'" if bare_allowed else "'s{pos}'"
            raise InvalidTokenError(kind, whole_text, f"expected {forms} or 'm{{min}}~{{id}}.{{pos}}~...'")
        parts = text[1:].split("~")
        minimum = _parse_uint(kind, whole_text, parts[0], "the minimum", _MAX_POSITION_DIGITS, MAX_POSITION)
        if len(parts) == 1:
            raise InvalidTokenError(kind, whole_text, "an 'm' token lists at least one writer; use 's{pos}' otherwise")
        entries: list[tuple[int, int]] = []
        for part in parts[1:]:
            instance_text, dot, position_text = part.partition(".")
            if not dot:
                raise InvalidTokenError(kind, whole_text, f"writer entry {part[:40]!r} is not '{{id}}.{{pos}}'")
            instance_id = _parse_uint(
                kind, whole_text, instance_text, "an instance ID", _MAX_INSTANCE_DIGITS, MAX_INSTANCE_ID
            )
            position = _parse_uint(kind, whole_text, position_text, "a position", _MAX_POSITION_DIGITS, MAX_POSITION)
            if instance_id == 0:
                raise InvalidTokenError(kind, whole_text, "instance IDs start at 1")
            if entries and instance_id <= entries[-1][0]:
                raise InvalidTokenError(kind, whole_text, "writer entries must have unique, ascending instance IDs")
            if position <= minimum:
                raise InvalidTokenError(
                    kind, whole_text, f"writer {instance_id} is listed at {position}, not ahead of the minimum {minimum}"
                )
            entries.append((instance_id, position))
        return cls(minimum, tuple(entries))


class RoomStreamToken(_VectorClock):
    """A position in the events stream (the room timeline), as a vector clock."""

    __slots__ = ()
    KIND: ClassVar[str] = "room stream token"


class MultiWriterStreamToken(_VectorClock):
    """A position in any other stream, single- or multi-writer, as a vector clock."""

    __slots__ = ()
    KIND: ClassVar[str] = "stream token"


class SyncStreamKey(enum.StrEnum):
    """The streams a ``/sync`` token covers, in their order in the token string.

    The values are stream names (``storage.streams``); new keys go at the end.
    """

    EVENTS = "events"
    TYPING = "typing"
    RECEIPTS = "receipts"
    PRESENCE = "presence"
    TO_DEVICE = "to_device"
    ACCOUNT_DATA = "account_data"
    DEVICE_LISTS = "device_lists"


_ZERO = MultiWriterStreamToken(0)


@attrs.frozen(slots=True)
class StreamToken:
    """Where a ``/sync`` client is, in every stream it follows: one short opaque string.

    ``str(token)`` joins the components with ``_`` in ``SyncStreamKey`` order:
    the events component as ``s{pos}`` / ``m...``, every other one as a bare
    ``{pos}`` or ``m...`` (e.g. ``s1843_12_0_7_3_m90~2.94_41``).
    """

    events: RoomStreamToken
    typing: MultiWriterStreamToken = _ZERO
    receipts: MultiWriterStreamToken = _ZERO
    presence: MultiWriterStreamToken = _ZERO
    to_device: MultiWriterStreamToken = _ZERO
    account_data: MultiWriterStreamToken = _ZERO
    device_lists: MultiWriterStreamToken = _ZERO

    KIND: ClassVar[str] = "sync token"

    @classmethod
    def start(cls) -> StreamToken:
        """The token before anything happened: every stream at 0."""
        return cls(RoomStreamToken(0))

    def get(self, key: SyncStreamKey) -> _VectorClock:
        token: _VectorClock = getattr(self, key.value)
        return token

    def components(self) -> Iterable[tuple[SyncStreamKey, _VectorClock]]:
        for key in SyncStreamKey:
            yield key, self.get(key)

    def replace(self, key: SyncStreamKey, token: _VectorClock) -> StreamToken:
        """This token with one component replaced (a RoomStreamToken for EVENTS)."""
        expected = RoomStreamToken if key is SyncStreamKey.EVENTS else MultiWriterStreamToken
        if type(token) is not expected:
            raise TypeError(f"the {key.value} component is a {expected.__name__}, got {type(token).__name__}")
        changes: dict[str, Any] = {key.value: token}
        return attrs.evolve(self, **changes)

    def advance(self, key: SyncStreamKey, token: _VectorClock) -> StreamToken:
        """This token with one component moved forward to cover ``token`` as well."""
        current = self.get(key)
        if type(token) is not type(current):
            raise TypeError(f"the {key.value} component is a {type(current).__name__}, got {type(token).__name__}")
        return self.replace(key, current.advance(token))

    def advanced_keys(self, since: StreamToken) -> frozenset[SyncStreamKey]:
        """The streams in which this token covers more than ``since`` for some writer."""
        return frozenset(key for key, token in self.components() if not token.is_before_or_equal(since.get(key)))

    def to_string(self) -> str:
        parts = [self.events.to_string()]
        for key in tuple(SyncStreamKey)[1:]:
            token = self.get(key)
            parts.append(token.to_string() if token.instance_positions else str(token.minimum))
        return "_".join(parts)

    def __str__(self) -> str:
        return self.to_string()

    @classmethod
    def parse(cls, text: str) -> StreamToken:
        """Parse a ``/sync`` token; raise InvalidTokenError for anything we did not issue."""
        if not isinstance(text, str):
            raise InvalidTokenError(cls.KIND, text, f"expected a string, got {type(text).__name__}")
        if len(text) > MAX_TOKEN_LENGTH:
            raise InvalidTokenError(cls.KIND, text, f"is {len(text)} characters long; at most {MAX_TOKEN_LENGTH}")
        parts = text.split("_")
        if len(parts) != len(SyncStreamKey):
            raise InvalidTokenError(
                cls.KIND, text, f"expected {len(SyncStreamKey)} '_'-separated components, got {len(parts)}"
            )
        try:
            events = RoomStreamToken._parse(parts[0], text, bare_allowed=False)
            others = [MultiWriterStreamToken._parse(part, text, bare_allowed=True) for part in parts[1:]]
        except InvalidTokenError as e:
            raise InvalidTokenError(cls.KIND, text, e.reason) from None
        if any(part.startswith("s") for part in parts[1:]):
            # 's5' and '5' would be two spellings of one component.
            raise InvalidTokenError(cls.KIND, text, "only the first (events) component uses the 's' prefix")
        return cls(events, *others)
