"""User-interactive auth: session bookkeeping and the 401 rounds, with a fake clock and fake checkers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from homeserver.handlers.accounts.ui_auth import (
    LOGIN_DUMMY,
    LOGIN_PASSWORD,
    StageFailed,
    UiaRequired,
    UiaSessions,
    UserInteractiveAuth,
    check_dummy,
)
from storage.kernel.errors import MatrixError


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def check_password(auth: Mapping[str, Any], user_id: str | None) -> None:
    if auth.get("password") != "secret":
        raise StageFailed("M_FORBIDDEN", "Invalid password")


def make(lifetime: float = 600) -> tuple[UserInteractiveAuth, UiaSessions, FakeClock]:
    clock = FakeClock()
    sessions = UiaSessions(lifetime=lifetime, max_sessions=100)
    uia = UserInteractiveAuth(sessions, {LOGIN_DUMMY: check_dummy, LOGIN_PASSWORD: check_password}, clock)
    return uia, sessions, clock


DUMMY = ((LOGIN_DUMMY,),)
PASSWORD = ((LOGIN_PASSWORD,),)


async def _required(uia: UserInteractiveAuth, auth: object, **kwargs: Any) -> UiaRequired:
    with pytest.raises(UiaRequired) as caught:
        await uia.check(auth, **kwargs)
    return caught.value


async def test_first_request_gets_flows_params_and_session_without_errcode() -> None:
    uia, _, _ = make()
    required = await _required(uia, None, operation="register", flows=DUMMY, user_id=None)
    assert required.status == 401
    body = required.to_json()
    assert body == {"flows": [{"stages": ["m.login.dummy"]}], "params": {}, "session": body["session"]}
    assert isinstance(body["session"], str) and len(body["session"]) >= 16


async def test_dummy_stage_with_the_session_completes() -> None:
    uia, _, _ = make()
    session_id = (await _required(uia, None, operation="register", flows=DUMMY, user_id=None)).session.session_id
    session = await uia.check(
        {"type": LOGIN_DUMMY, "session": session_id}, operation="register", flows=DUMMY, user_id=None
    )
    assert session.session_id == session_id and session.completed == [LOGIN_DUMMY]


async def test_dummy_stage_without_a_session_completes_at_once() -> None:
    """matrix-nio sends ``auth: {type: m.login.dummy}`` in its very first request."""
    uia, sessions, _ = make()
    session = await uia.check({"type": LOGIN_DUMMY}, operation="register", flows=DUMMY, user_id=None)
    assert session.completed == [LOGIN_DUMMY]
    assert len(sessions) == 1


async def test_failed_stage_is_401_with_errcode_and_may_be_retried() -> None:
    uia, _, _ = make()
    first = await _required(uia, None, operation="pw", flows=PASSWORD, user_id="@a:hs")
    sid = first.session.session_id
    failed = await _required(
        uia, {"type": LOGIN_PASSWORD, "password": "wrong", "session": sid}, operation="pw", flows=PASSWORD, user_id="@a:hs"
    )
    body = failed.to_json()
    assert (body["errcode"], body["error"], body["session"]) == ("M_FORBIDDEN", "Invalid password", sid)
    assert "completed" not in body and body["flows"] == [{"stages": ["m.login.password"]}]
    session = await uia.check(
        {"type": LOGIN_PASSWORD, "password": "secret", "session": sid}, operation="pw", flows=PASSWORD, user_id="@a:hs"
    )
    assert session.session_id == sid


async def test_multi_stage_flow_reports_completed_stages() -> None:
    uia, _, _ = make()
    flows = ((LOGIN_DUMMY, LOGIN_PASSWORD),)
    after_first = await _required(uia, {"type": LOGIN_DUMMY}, operation="op", flows=flows, user_id="@a:hs")
    assert after_first.to_json()["completed"] == [LOGIN_DUMMY]
    assert "errcode" not in after_first.to_json()
    sid = after_first.session.session_id
    done = await uia.check(
        {"type": LOGIN_PASSWORD, "password": "secret", "session": sid}, operation="op", flows=flows, user_id="@a:hs"
    )
    assert done.completed == [LOGIN_DUMMY, LOGIN_PASSWORD]


async def test_completed_session_returns_again_and_keeps_its_result() -> None:
    """Spec: completed stages cannot be retried; the server answers with the result."""
    uia, _, _ = make()
    session = await uia.check({"type": LOGIN_DUMMY}, operation="register", flows=DUMMY, user_id=None)
    session.set_result({"user_id": "@x:hs"})
    again = await uia.check(
        {"type": LOGIN_DUMMY, "session": session.session_id}, operation="register", flows=DUMMY, user_id=None
    )
    assert again is session and again.has_result and again.result == {"user_id": "@x:hs"}
    # Also with an auth dict holding only the session.
    assert await uia.check({"session": session.session_id}, operation="register", flows=DUMMY, user_id=None) is session


async def test_sessions_are_bound_to_operation_and_user() -> None:
    uia, _, _ = make()
    sid = (await _required(uia, None, operation="delete:[A]", flows=PASSWORD, user_id="@a:hs")).session.session_id
    for operation, user_id in [("delete:[B]", "@a:hs"), ("delete:[A]", "@mallory:hs")]:
        with pytest.raises(MatrixError) as caught:
            await uia.check(
                {"type": LOGIN_PASSWORD, "password": "secret", "session": sid},
                operation=operation,
                flows=PASSWORD,
                user_id=user_id,
            )
        assert (caught.value.status, caught.value.errcode) == (403, "M_FORBIDDEN")


@pytest.mark.parametrize(
    ("auth", "status", "errcode"),
    [
        ("a string", 400, "M_BAD_JSON"),
        ({"type": LOGIN_DUMMY, "session": 5}, 400, "M_BAD_JSON"),
        ({"type": ["m.login.dummy"]}, 400, "M_BAD_JSON"),
        ({"type": LOGIN_DUMMY, "session": "no-such-session"}, 400, "M_UNKNOWN"),
        ({"type": "m.login.recaptcha"}, 401, "M_UNRECOGNIZED"),
        ({"type": LOGIN_PASSWORD}, 401, "M_UNRECOGNIZED"),  # offered nowhere in the flows
    ],
)
async def test_malformed_auth(auth: object, status: int, errcode: str) -> None:
    uia, _, _ = make()
    with pytest.raises(MatrixError) as caught:
        await uia.check(auth, operation="register", flows=DUMMY, user_id=None)
    assert (caught.value.status, caught.value.to_json()["errcode"]) == (status, errcode)


async def test_sessions_expire() -> None:
    uia, _, clock = make(lifetime=60)
    sid = (await _required(uia, None, operation="register", flows=DUMMY, user_id=None)).session.session_id
    clock.now += 61
    with pytest.raises(MatrixError) as caught:
        await uia.check({"type": LOGIN_DUMMY, "session": sid}, operation="register", flows=DUMMY, user_id=None)
    assert caught.value.errcode == "M_UNKNOWN"


def test_session_store_is_bounded_oldest_first() -> None:
    sessions = UiaSessions(lifetime=600, max_sessions=3)
    created = [sessions.create("op", None, now=float(i)) for i in range(5)]
    assert len(sessions) == 3
    assert sessions.get(created[0].session_id, now=5) is None
    assert sessions.get(created[4].session_id, now=5) is created[4]


async def test_a_session_keeps_the_params_of_its_first_request_that_gave_any() -> None:
    uia, _, _ = make()
    first = await _required(uia, None, operation="register", flows=DUMMY, user_id=None)
    assert first.session.params is None
    sid = first.session.session_id
    await _required(uia, {"session": sid}, operation="register", flows=DUMMY, user_id=None, params={"username": "a"})
    session = await uia.check(
        {"type": LOGIN_DUMMY, "session": sid}, operation="register", flows=DUMMY, user_id=None, params={"username": "b"}
    )
    assert session.params == {"username": "a"}
    created = await _required(uia, None, operation="register", flows=DUMMY, user_id=None, params={"username": "c"})
    assert created.session.params == {"username": "c"}


async def test_existing_finds_only_a_live_session_of_the_same_operation_and_user() -> None:
    uia, _, clock = make(lifetime=10)
    sid = (await _required(uia, None, operation="register", flows=DUMMY, user_id=None)).session.session_id
    found = uia.existing({"session": sid}, operation="register", user_id=None)
    assert found is not None and found.session_id == sid
    assert uia.existing({"session": sid}, operation="change_password", user_id=None) is None
    assert uia.existing({"session": sid}, operation="register", user_id="@a:hs") is None
    for odd in (None, "x", {"session": 5}, {"session": "unknown"}, {}):
        assert uia.existing(odd, operation="register", user_id=None) is None
    clock.now += 11
    assert uia.existing({"session": sid}, operation="register", user_id=None) is None
