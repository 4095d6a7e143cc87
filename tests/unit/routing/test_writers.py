"""Single-writer routing: each write goes to the handler here or to the stream's writer, chosen
once from the layout, and the writer serves exactly the operations of the streams it writes.

A remote write and the writer's serving of it are joined in memory (a fake caller that
hands the body to the registered operation), so the round trip is checked without HTTP;
tests/integration/test_workers.py does the same over the real internal API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from homeserver.handlers.accounts.auth import Requester
from homeserver.routing.internal_api import Operation
from homeserver.routing.layout import Layout
from homeserver.handlers.writers import Writers
from homeserver.routing.writers import (
    OPERATIONS,
    RemoteTyping,
    build_writers,
    choose_invite_writer,
    register_writer_operations,
)
from storage.streams import StreamName
from tests.unit.routing.test_layout import layout

ALICE = Requester(user_id="@alice:example.org", device_id="DEV", access_token_id=7)


class Recorder:
    """A local handler of every single-writer write: records the calls it got."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    async def _record(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((name, args, kwargs))
        return {"apply_remote_to_device": 3, "set_global": 11, "set_room": 12}.get(name, True)

    async def set_typing(self, *args: Any) -> None:
        await self._record("set_typing", *args)

    async def apply_remote(self, *args: Any) -> Any:
        return await self._record("apply_remote", *args)

    async def receipt(self, *args: Any) -> None:
        await self._record("receipt", *args)

    async def set_fully_read(self, *args: Any) -> None:
        await self._record("set_fully_read", *args)

    async def set_status(self, *args: Any) -> None:
        await self._record("set_status", *args)

    async def send_to_device(self, *args: Any) -> None:
        await self._record("send_to_device", *args)

    async def apply_remote_to_device(self, *args: Any) -> int:
        return int(await self._record("apply_remote_to_device", *args))

    async def apply_remote_device_list_update(self, *args: Any, **kwargs: Any) -> None:
        await self._record("apply_remote_device_list_update", *args, **kwargs)

    async def apply_remote_signing_key_update(self, *args: Any, **kwargs: Any) -> None:
        await self._record("apply_remote_signing_key_update", *args, **kwargs)

    async def set_global(self, *args: Any) -> int:
        return int(await self._record("set_global", *args))

    async def set_room(self, *args: Any) -> int:
        return int(await self._record("set_room", *args))

    async def edit_push_rules(self, *args: Any) -> None:
        await self._record("edit_push_rules", *args)

    async def record_invite(self, *args: Any) -> None:
        await self._record("record_invite", *args)

    async def record_rejection(self, *args: Any) -> None:
        await self._record("record_rejection", *args)

    async def record_knock(self, *args: Any) -> None:
        await self._record("record_knock", *args)


def local_writers(recorder: Recorder) -> Writers:
    return Writers(typing=recorder, receipts=recorder, fully_read=recorder, presence=recorder,  # type: ignore[arg-type]
                   to_device=recorder, device_lists=recorder, account_data=recorder, invites=recorder)


class Processes:
    """Several processes' operation registries, and a caller that reaches them in memory."""

    def __init__(self) -> None:
        self.operations: dict[str, dict[str, Operation]] = {}
        self.sent: list[tuple[str, str, Mapping[str, Any]]] = []

    def registry(self, instance: str) -> Any:
        ops = self.operations.setdefault(instance, {})

        class Registry:
            def register(self, name: str, operation: Operation) -> None:
                assert name not in ops, f"{name} registered twice on {instance}"
                ops[name] = operation

        return Registry()

    async def call(self, instance: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.sent.append((instance, name, body))
        return await self.operations[instance][name](dict(body))


async def test_a_single_process_writes_everything_itself() -> None:
    recorder = Recorder()
    local = local_writers(recorder)
    # The main process of a layout that gives it every stream but typing writes all but typing.
    main = layout("master")
    chosen = build_writers(local, main, Processes())
    assert chosen.typing is not recorder and isinstance(chosen.typing, RemoteTyping)
    assert chosen.receipts is recorder and chosen.presence is recorder and chosen.invites is not recorder


def test_without_an_internal_api_a_process_must_write_every_stream() -> None:
    with pytest.raises(ValueError, match="does not write typing"):
        build_writers(local_writers(Recorder()), layout("master"), None)
    with pytest.raises(ValueError, match="does not write events"):
        choose_invite_writer(Recorder(), layout("master"), None)


async def test_remote_writes_reach_the_writer_with_the_same_arguments() -> None:
    """g1 writes typing; p1 writes events (invites go to the first events writer); the main process
    writes the rest. A write on the main process for each reaches the right process's handler."""
    processes = Processes()
    handlers = {name: Recorder() for name in ("master", "g1", "p1")}
    for name, recorder in handlers.items():
        register_writer_operations(processes.registry(name), layout(name), local_writers(recorder))
    on_main = build_writers(local_writers(handlers["master"]), layout("master"), processes)

    await on_main.typing.set_typing(ALICE, "!r:example.org", ALICE.user_id, True, 30_000)
    assert await on_main.typing.apply_remote("!r:example.org", "@bob:remote.example", False) is True
    await on_main.invites.record_invite(ALICE.user_id, "!r:remote.example", "10", "$e", {"type": "m.room.member"}, [])
    await on_main.invites.record_knock(ALICE.user_id, "!k:remote.example", "7", "$k", {"type": "m.room.member"}, [])
    assert await on_main.account_data.set_global(ALICE, ALICE.user_id, "m.x", {"a": 1}) == 11

    assert handlers["g1"].calls == [
        ("set_typing", (ALICE, "!r:example.org", ALICE.user_id, True, 30_000), {}),
        ("apply_remote", ("!r:example.org", "@bob:remote.example", False), {}),
    ]
    assert handlers["p1"].calls == [
        ("record_invite", (ALICE.user_id, "!r:remote.example", "10", "$e", {"type": "m.room.member"}, []), {}),
        ("record_knock", (ALICE.user_id, "!k:remote.example", "7", "$k", {"type": "m.room.member"}, []), {}),
    ]
    assert handlers["master"].calls == [("set_global", (ALICE, ALICE.user_id, "m.x", {"a": 1}), {})]
    assert [(instance, name) for instance, name, _ in processes.sent] == [
        ("g1", "call/typing"), ("g1", "call/remote_typing"), ("p1", "call/remote_invite"), ("p1", "call/remote_knock"),
    ]


async def test_keyword_arguments_survive_the_trip() -> None:
    processes = Processes()
    master, g1 = Recorder(), Recorder()
    register_writer_operations(processes.registry("master"), layout("master"), local_writers(master))
    register_writer_operations(processes.registry("g1"), layout("g1"), local_writers(g1))
    on_g1 = build_writers(local_writers(g1), layout("g1"), processes)
    await on_g1.device_lists.apply_remote_device_list_update("@bob:remote.example", "D", deleted=True, keys=None,
                                                             stream_id=7, prev_ids=[5], display_name="phone")
    await on_g1.device_lists.apply_remote_signing_key_update("@bob:remote.example", {"usage": ["master"]}, None)
    assert master.calls == [("apply_remote_device_list_update", ("@bob:remote.example", "D"),
                             {"deleted": True, "keys": None, "stream_id": 7, "prev_ids": [5],
                              "display_name": "phone"}),
                            ("apply_remote_signing_key_update", ("@bob:remote.example", {"usage": ["master"]}, None),
                             {})]


def test_each_writer_serves_exactly_the_operations_of_its_streams() -> None:
    processes = Processes()
    for name in ("master", "g1", "p1", "p2", "fs1"):
        register_writer_operations(processes.registry(name), layout(name), local_writers(Recorder()))
    served = {name: set(ops) for name, ops in processes.operations.items()}
    typing_ops = {f"call/{op.name}" for op in OPERATIONS if op.stream == StreamName.TYPING}
    events_ops = {f"call/{op.name}" for op in OPERATIONS if op.stream == StreamName.EVENTS}
    assert served["g1"] == typing_ops
    assert served["p1"] == served["p2"] == events_ops
    assert served.get("fs1", set()) == set()
    every = {f"call/{op.name}" for op in OPERATIONS}
    assert served["master"] == every - typing_ops - events_ops
