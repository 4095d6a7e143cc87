"""User-interactive authentication (UIA): the 401 dance of /register, /account/password and device deletion.

``UiaSessions`` is pure bookkeeping (sessions in memory, expiring, bounded; it
takes ``now``). ``UserInteractiveAuth.check`` runs one round: it validates the
request's ``auth`` dict, runs the stage's checker, and either returns the
completed session or raises ``UiaRequired``, whose body is the spec's
``{flows, params, session, completed}`` (plus ``errcode``/``error`` after a
failed attempt). A session is bound to one operation and one user, and keeps
the operation's result so a client retrying a completed session gets the same
answer, and the parameters of its first request that gave any (``check``'s
``params``), which registration uses when a later request omits them. Sessions live in this process only: a restart sends clients back to
their first request.
"""

# tests: tests/unit/handlers/test_ui_auth.py

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import attrs

from storage.kernel.errors import MatrixError, bad_json

LOGIN_DUMMY: Final = "m.login.dummy"
LOGIN_PASSWORD: Final = "m.login.password"
LOGIN_REGISTRATION_TOKEN: Final = "m.login.registration_token"

SESSION_LIFETIME_SECONDS: Final = 600.0
MAX_SESSIONS: Final = 10_000

# A stage checker gets the ``auth`` dict and the user the session is bound to
# (None for registration); it returns normally on success and raises
# ``StageFailed`` (or a ``MatrixError`` for a malformed request) otherwise.
StageChecker = Callable[[Mapping[str, Any], str | None], Awaitable[None]]


class StageFailed(Exception):
    """An auth stage was attempted and failed; the client may try again."""

    def __init__(self, errcode: str, error: str) -> None:
        super().__init__(f"{errcode}: {error}")
        self.errcode = errcode
        self.error = error


@attrs.define
class UiaSession:
    session_id: str
    operation: str
    user_id: str | None
    created: float
    completed: list[str] = attrs.Factory(list)
    result: Any = None
    has_result: bool = False
    # The operation's parameters from the first request of the session that gave
    # any (registration keeps them, as Synapse does); None until then.
    params: Any = None

    def set_result(self, result: Any) -> None:
        self.result = result
        self.has_result = True


class UiaSessions:
    """Sessions by ID, oldest evicted first, each living ``SESSION_LIFETIME_SECONDS``."""

    def __init__(self, *, lifetime: float = SESSION_LIFETIME_SECONDS, max_sessions: int = MAX_SESSIONS) -> None:
        self._sessions: OrderedDict[str, UiaSession] = OrderedDict()
        self._lifetime = lifetime
        self._max_sessions = max_sessions

    def create(self, operation: str, user_id: str | None, now: float) -> UiaSession:
        self._expire(now)
        session = UiaSession(secrets.token_urlsafe(18), operation, user_id, now)
        self._sessions[session.session_id] = session
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        return session

    def get(self, session_id: str, now: float) -> UiaSession | None:
        self._expire(now)
        return self._sessions.get(session_id)

    def _expire(self, now: float) -> None:
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.created < self._lifetime:
                return
            self._sessions.popitem(last=False)

    def __len__(self) -> int:
        return len(self._sessions)


class UiaRequired(MatrixError):
    """401 with the UIA body: what the client must still complete, and why the last try failed."""

    def __init__(
        self,
        session: UiaSession,
        flows: Sequence[Sequence[str]],
        *,
        errcode: str | None = None,
        error: str | None = None,
    ) -> None:
        super().__init__(401, errcode or "M_FORBIDDEN", error or "Additional authentication is required")
        self.session = session
        self.flows = flows
        self.failed = errcode is not None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.failed:
            body["errcode"] = self.errcode
            body["error"] = self.error
        if self.session.completed:
            body["completed"] = list(self.session.completed)
        body["flows"] = [{"stages": list(stages)} for stages in self.flows]
        body["params"] = {}
        body["session"] = self.session.session_id
        return body


class UserInteractiveAuth:
    def __init__(self, sessions: UiaSessions, checkers: Mapping[str, StageChecker], clock: Callable[[], float]) -> None:
        self._sessions = sessions
        self._checkers = checkers
        self._clock = clock

    async def check(
        self,
        auth: object,
        *,
        operation: str,
        flows: Sequence[Sequence[str]],
        user_id: str | None,
        params: Any = None,
    ) -> UiaSession:
        """Run one UIA round for ``operation``; return the session once a flow is complete.

        ``params`` (when not None) is remembered on a session that has none yet,
        so the request that completes the session can use the first one's.
        Raises ``UiaRequired`` (401) while stages remain, and ``MatrixError``
        400/403 for malformed auth dicts or a session of another request.
        """
        now = self._clock()
        if auth is None:
            created = self._sessions.create(operation, user_id, now)
            created.params = params
            raise UiaRequired(created, flows)
        if not isinstance(auth, dict):
            raise bad_json("'auth' must be an object")
        session_id = auth.get("session")
        if session_id is None:
            session = self._sessions.create(operation, user_id, now)
        elif not isinstance(session_id, str):
            raise bad_json("'auth.session' must be a string")
        else:
            found = self._sessions.get(session_id, now)
            if found is None:
                raise MatrixError(400, "M_UNKNOWN", "Unknown or expired authentication session")
            if found.operation != operation or found.user_id != user_id:
                raise MatrixError(403, "M_FORBIDDEN", "This authentication session belongs to another request")
            session = found
        if session.params is None:
            session.params = params
        if session.has_result or _flow_complete(flows, session.completed):
            return session
        stage = auth.get("type")
        if stage is None:
            # The client asks where it stands (a stage completed out of band).
            raise UiaRequired(session, flows)
        if not isinstance(stage, str):
            raise bad_json("'auth.type' must be a string")
        if not any(stage in stages for stages in flows) or stage not in self._checkers:
            raise UiaRequired(session, flows, errcode="M_UNRECOGNIZED", error=f"Unsupported auth type {stage[:100]!r}")
        try:
            await self._checkers[stage](auth, user_id)
        except StageFailed as e:
            raise UiaRequired(session, flows, errcode=e.errcode, error=e.error) from None
        if stage not in session.completed:
            session.completed.append(stage)
        if _flow_complete(flows, session.completed):
            return session
        raise UiaRequired(session, flows)


    def existing(self, auth: object, *, operation: str, user_id: str | None) -> UiaSession | None:
        """The live session ``auth`` names for this operation and user, or None (``check`` reports why)."""
        if not isinstance(auth, dict) or not isinstance(auth.get("session"), str):
            return None
        found = self._sessions.get(auth["session"], self._clock())
        if found is None or found.operation != operation or found.user_id != user_id:
            return None
        return found


def _flow_complete(flows: Sequence[Sequence[str]], completed: Sequence[str]) -> bool:
    return any(all(stage in completed for stage in stages) for stages in flows)


async def check_dummy(auth: Mapping[str, Any], user_id: str | None) -> None:
    """``m.login.dummy`` always succeeds."""


def registration_token_checker(use_token: Callable[[str, int], Awaitable[bool]],
                               clock: Callable[[], float]) -> StageChecker:
    """``m.login.registration_token``: the token must exist, be unexpired and have uses left;
    passing the stage counts one use (``use_token`` does that atomically, so two sessions
    cannot share a token's last use)."""

    async def check(auth: Mapping[str, Any], user_id: str | None) -> None:
        token = auth.get("token")
        if not isinstance(token, str) or not 0 < len(token) <= 64:
            raise bad_json("'auth.token' must be a registration token (a string of 1 to 64 characters)")
        if not await use_token(token, int(clock() * 1000)):
            raise StageFailed("M_UNAUTHORIZED", "Invalid registration token")

    return check
