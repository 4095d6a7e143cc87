"""Application service registrations as typed values, and who owns which names.

An ``AppService`` is one registration file (``app_service_config_files`` in homeserver.yaml,
parsed by ``homeserver/config.py``): its tokens, its URL and its namespaces. The
``AppServiceRegistry`` answers the questions the rest of the server asks: whose ``as_token``
is this, may this service act as this user, does an exclusive namespace keep this user ID or
alias from everyone else, which services care about an event. Pure: no I/O, no config loading.

Namespace regexes match from the start of the string (``re.match``), as Synapse does: a
registration's ``@irc_.*`` covers ``@irc_bob:example.org``. Write ``^...$`` for an exact match.
"""

# tests: tests/unit/appservice/test_registration.py

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
import attrs


@attrs.frozen
class Namespace:
    """One ``namespaces.users/aliases/rooms`` entry."""

    regex: str
    exclusive: bool
    pattern: re.Pattern[str] = attrs.field(eq=False, repr=False)

    @classmethod
    def of(cls, regex: str, exclusive: bool) -> Namespace:
        """Raises ``re.error`` for a bad regex."""
        return cls(regex, exclusive, re.compile(regex))

    def matches(self, text: str) -> bool:
        return self.pattern.match(text) is not None


def _any(namespaces: Iterable[Namespace], text: str, *, exclusive_only: bool = False) -> bool:
    return any(ns.matches(text) for ns in namespaces if ns.exclusive or not exclusive_only)


@attrs.frozen
class AppService:
    """One registration (see docs/appservices.md for each key)."""

    id: str
    # Where transactions and queries go; None: the service only uses the client API.
    url: str | None
    as_token: str
    hs_token: str
    # The full user ID of ``sender_localpart``: what the service acts as without ``user_id``.
    sender: str
    users: tuple[Namespace, ...] = ()
    aliases: tuple[Namespace, ...] = ()
    rooms: tuple[Namespace, ...] = ()
    rate_limited: bool = True
    protocols: tuple[str, ...] = ()
    # Typing, receipts and presence in transactions (MSC2409 ``receive_ephemeral``).
    receive_ephemeral: bool = False
    # To-device messages for its users in transactions (MSC2409's ``receive_to_device``).
    receive_to_device: bool = False
    # ``device_id`` masquerading (``org.matrix.msc3202``; standard since spec v1.17 anyway).
    device_masquerading: bool = True
    # The file it came from, for messages.
    source: str = ""

    def may_act_as(self, user_id: str) -> bool:
        """Its sender or a user in one of its user namespaces."""
        return user_id == self.sender or _any(self.users, user_id)

    def is_interested_in_user(self, user_id: str) -> bool:
        return self.may_act_as(user_id)

    def is_interested_in_alias(self, alias: str) -> bool:
        return _any(self.aliases, alias)

    def is_interested_in_room(self, room_id: str) -> bool:
        return _any(self.rooms, room_id)

    def owns_user_exclusively(self, user_id: str) -> bool:
        return user_id == self.sender or _any(self.users, user_id, exclusive_only=True)

    def owns_alias_exclusively(self, alias: str) -> bool:
        return _any(self.aliases, alias, exclusive_only=True)


@attrs.frozen
class EventFacts:
    """What decides whether a service wants an event: its own fields and its room's."""

    sender: str
    room_id: str
    # The user a membership event is about.
    member: str | None
    # The room's aliases (local directory aliases and its canonical alias event's).
    room_aliases: tuple[str, ...] = ()
    # The room's current members (join or invite) on this server.
    room_members: tuple[str, ...] = ()


def is_interested(service: AppService, facts: EventFacts) -> bool:
    """The spec's "interested": sender, membership target, room ID, an alias of the room, or a
    member of the room in its user namespaces."""
    if service.is_interested_in_user(facts.sender):
        return True
    if facts.member is not None and service.is_interested_in_user(facts.member):
        return True
    if service.is_interested_in_room(facts.room_id):
        return True
    if any(service.is_interested_in_alias(alias) for alias in facts.room_aliases):
        return True
    return any(service.is_interested_in_user(member) for member in facts.room_members)


class AppServiceRegistry:
    """Every configured service, looked up by token, ID and namespace."""

    def __init__(self, services: Iterable[AppService] = ()) -> None:
        self.services: tuple[AppService, ...] = tuple(services)
        self._by_token: Mapping[str, AppService] = {s.as_token: s for s in self.services}
        self._by_id: Mapping[str, AppService] = {s.id: s for s in self.services}

    def __bool__(self) -> bool:
        return bool(self.services)

    def by_token(self, token: str) -> AppService | None:
        return self._by_token.get(token)

    def by_id(self, service_id: str) -> AppService | None:
        return self._by_id.get(service_id)

    def exclusive_user_owner(self, user_id: str) -> AppService | None:
        """The service whose exclusive user namespace (or sender) holds ``user_id``."""
        return next((s for s in self.services if s.owns_user_exclusively(user_id)), None)

    def exclusive_alias_owner(self, alias: str) -> AppService | None:
        return next((s for s in self.services if s.owns_alias_exclusively(alias)), None)

    def user_query_targets(self, user_id: str) -> tuple[AppService, ...]:
        """Services to ask about an unknown user: those with a URL whose user namespaces hold it."""
        return tuple(s for s in self.services if s.url is not None and _any(s.users, user_id))

    def alias_query_targets(self, alias: str) -> tuple[AppService, ...]:
        return tuple(s for s in self.services if s.url is not None and s.is_interested_in_alias(alias))

    def with_protocol(self, protocol: str) -> tuple[AppService, ...]:
        return tuple(s for s in self.services if s.url is not None and protocol in s.protocols)

    def pushed_to(self) -> tuple[AppService, ...]:
        """Services transactions go to (those with a URL)."""
        return tuple(s for s in self.services if s.url is not None)

