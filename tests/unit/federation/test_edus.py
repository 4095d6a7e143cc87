"""Inbound EDU checks: an origin speaks only for its own users, malformed EDUs are refused
with ``EduRejected``, and good ones reach the handlers (here, fakes that record calls)."""

from __future__ import annotations

from typing import Any

import pytest

from homeserver.federation.edus import EduHandlers, EduRejected
from tests.twisted_plugin import run_sync

ORIGIN = "remote.example"
BOB = f"@bob:{ORIGIN}"
ALICE = "@alice:local.example"
ROOM = "!room:local.example"


class Recorder:
    """Stands in for the typing, receipts, presence and e2e handlers."""

    def __init__(self, joined: bool = True) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.joined = joined

    async def apply_remote(self, *args: Any) -> bool:
        self.calls.append(("apply_remote", args))
        return self.joined

    async def apply_remote_to_device(self, *args: Any) -> int:
        self.calls.append(("to_device", args))
        return 1

    async def apply_remote_device_list_update(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("device_list", (*args, kwargs["deleted"], kwargs["keys"])))


def _handlers(joined: bool = True) -> tuple[EduHandlers, Recorder]:
    recorder = Recorder(joined)
    return EduHandlers(typing=recorder, receipts=recorder, presence=recorder, to_device=recorder,
                       device_lists=recorder), recorder  # type: ignore[arg-type]


def test_good_edus_reach_their_handlers() -> None:
    edus, recorder = _handlers()
    run_sync(edus.on_typing(ORIGIN, {"room_id": ROOM, "user_id": BOB, "typing": True}))
    run_sync(edus.on_receipt(ORIGIN, {ROOM: {"m.read": {BOB: {"event_ids": ["$a", "$b"], "data": {"ts": 5}}}}}))
    run_sync(edus.on_presence(ORIGIN, {"push": [{"user_id": BOB, "presence": "online", "last_active_ago": 3}]}))
    run_sync(edus.on_direct_to_device(ORIGIN, {"sender": BOB, "type": "m.x", "message_id": "m",
                                               "messages": {ALICE: {"*": {}}}}))
    run_sync(edus.on_device_list_update(ORIGIN, {"user_id": BOB, "device_id": "D", "deleted": True}))
    assert recorder.calls == [
        ("apply_remote", (ROOM, BOB, True)),
        ("apply_remote", (ROOM, "m.read", BOB, "$b", {"ts": 5})),
        ("apply_remote", (BOB, "online", None, 3, False)),
        ("to_device", (BOB, "m.x", "m", {ALICE: {"*": {}}})),
        ("device_list", (BOB, "D", True, None)),
    ]


@pytest.mark.parametrize(
    "method, content",
    [
        ("on_typing", {"room_id": ROOM, "user_id": ALICE, "typing": True}),  # another server's user
        ("on_typing", {"room_id": ROOM, "user_id": BOB, "typing": "yes"}),
        ("on_typing", "junk"),
        ("on_typing", {"room_id": 5, "user_id": BOB, "typing": False}),
        ("on_receipt", {ROOM: {"m.read": {ALICE: {"event_ids": ["$a"]}}}}),
        ("on_receipt", {ROOM: {"m.read": {BOB: {"event_ids": []}}}}),
        ("on_receipt", {ROOM: []}),
        ("on_presence", {"push": "all"}),
        ("on_presence", None),
        ("on_direct_to_device", {"sender": ALICE, "type": "m.x", "message_id": "m", "messages": {}}),
        ("on_direct_to_device", {"sender": BOB, "type": "m.x", "message_id": "m", "messages": []}),
        ("on_device_list_update", {"user_id": ALICE, "device_id": "D"}),
        ("on_device_list_update", {"user_id": BOB, "device_id": "D", "keys": {"user_id": ALICE}}),
        ("on_device_list_update", {"user_id": BOB, "device_id": "x" * 300}),
    ],
)
def test_bad_edus_are_rejected_and_reach_no_handler(method: str, content: Any) -> None:
    edus, recorder = _handlers()
    with pytest.raises(EduRejected):
        run_sync(getattr(edus, method)(ORIGIN, content))
    assert recorder.calls == []


def test_typing_in_a_room_the_user_is_not_joined_to_is_rejected() -> None:
    edus, _ = _handlers(joined=False)
    with pytest.raises(EduRejected, match="not joined"):
        run_sync(edus.on_typing(ORIGIN, {"room_id": ROOM, "user_id": BOB, "typing": True}))


def test_one_bad_presence_update_does_not_spoil_the_others() -> None:
    edus, recorder = _handlers()
    push = [{"user_id": ALICE, "presence": "online"}, {"user_id": BOB, "presence": "busy"},
            {"user_id": BOB, "presence": "unavailable", "last_active_ago": -1},
            {"user_id": BOB, "presence": "offline", "status_msg": "gone", "currently_active": True}]
    run_sync(edus.on_presence(ORIGIN, {"push": push}))
    assert recorder.calls == [("apply_remote", (BOB, "offline", "gone", 0, True))]
