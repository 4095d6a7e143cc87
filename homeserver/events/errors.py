"""The error hierarchy of the events core: one base, one class per kind of failure.

Every function in ``homeserver.events`` that rejects its input raises a subclass of
``EventsError``; nothing here raises a bare ``KeyError``/``TypeError`` on malformed
federation input. The HTTP layer maps these to Matrix error codes (see each class).
"""

# tests: tests/unit/events/test_event.py, tests/unit/events/test_auth.py

from __future__ import annotations


class EventsError(Exception):
    """Base class of every error raised by ``homeserver.events``."""


class UnsupportedRoomVersion(EventsError):
    """The room version is not one we implement (HTTP: 400 ``M_UNSUPPORTED_ROOM_VERSION``)."""

    def __init__(self, version: object) -> None:
        super().__init__(f"unsupported room version {version!r}; supported: 1 to 12")
        self.version = version


class InvalidEvent(EventsError):
    """A PDU does not match the event format of its room version.

    Over federation such an event is dropped; on the client API it is a 400
    ``M_BAD_JSON``.
    """


class EventTooLarge(InvalidEvent):
    """An event, or one of its size-limited keys, exceeds the spec's byte limits (``M_TOO_LARGE``)."""


class SignatureError(EventsError):
    """A required signature is missing or does not verify; the event must be dropped."""


class AuthError(EventsError):
    """The authorization rules reject the event (HTTP: 403 ``M_FORBIDDEN``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MissingEventsError(EventsError):
    """A pure algorithm needs events the caller did not supply; fetch them and retry."""

    def __init__(self, event_ids: frozenset[str], what: str) -> None:
        shown = ", ".join(sorted(event_ids)[:5])
        more = "" if len(event_ids) <= 5 else f" and {len(event_ids) - 5} more"
        super().__init__(f"{what}: missing {len(event_ids)} event(s): {shown}{more}")
        self.event_ids = event_ids


class InvalidCreateRoomRequest(EventsError):
    """A ``/createRoom`` body is malformed (HTTP: 400 ``M_BAD_JSON`` / ``M_INVALID_PARAM``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"createRoom '{field}': {message}")
        self.field = field
