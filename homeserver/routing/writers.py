"""Single-writer streams: one Protocol per stream write, a local and a remote implementation.

Typing, receipts, presence, to-device messages, account data, device lists of
remote users and invites to rooms this server is not in are each written by one
process (``Layout.writers``). Every process that takes such a write (a client
request, an EDU in an inbound transaction) calls it through the Protocol below;
the composition root picks, once, the handler itself when this process writes
the stream and a ``Remote*`` stand-in that asks the writer over the internal API
otherwise (``build_writers``). The writer serves those calls with the same
handler code a single process runs (``register_writer_operations``), so the
rules (auth, rate limits, idempotency) do not depend on which process a request
reached.

On the wire an operation is ``call/<name>`` with ``{"requester", "args",
"kwargs"}`` (JSON values; the ``Requester`` as an object) and answers
``{"result": ...}``. What this module does not know: the handlers' rules, or
how the internal API authenticates (``internal_api``).
"""

# tests: tests/unit/routing/test_writers.py, tests/integration/test_workers.py

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs

from homeserver.events.canonical import thaw
from homeserver.handlers.accounts.auth import Requester
from homeserver.handlers.writers import InviteWriter, Writers
from homeserver.routing.internal_api import Operation as Serve
from homeserver.routing.layout import Layout
from storage.streams import StreamName

class Caller(Protocol):
    """How a remote writer is reached (``InternalApiClient``)."""

    async def call(self, instance: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]: ...


class OperationRegistry(Protocol):
    """Where a writer serves its operations (``InternalApiServer``)."""

    def register(self, name: str, operation: Serve) -> None: ...


# --- the operations, as data --------------------------------------------------------------


@attrs.frozen
class Operation:
    """``call/<name>``: ``method`` of the ``Writers`` field ``field``, written by ``stream``'s writer."""

    name: str
    stream: StreamName
    field: str
    method: str


OPERATIONS: Final[tuple[Operation, ...]] = (
    # Local users' changes (the client API).
    Operation("typing", StreamName.TYPING, "typing", "set_typing"),
    Operation("receipt", StreamName.RECEIPTS, "receipts", "receipt"),
    Operation("fully_read", StreamName.ACCOUNT_DATA, "fully_read", "set_fully_read"),
    Operation("presence", StreamName.PRESENCE, "presence", "set_status"),
    Operation("to_device", StreamName.TO_DEVICE, "to_device", "send_to_device"),
    Operation("account_data", StreamName.ACCOUNT_DATA, "account_data", "set_global"),
    Operation("room_account_data", StreamName.ACCOUNT_DATA, "account_data", "set_room"),
    Operation("push_rules", StreamName.ACCOUNT_DATA, "account_data", "edit_push_rules"),
    # Invites of local users to rooms this server is not in (a position on the events stream).
    Operation("remote_invite", StreamName.EVENTS, "invites", "record_invite"),
    Operation("remote_invite_rejected", StreamName.EVENTS, "invites", "record_rejection"),
    Operation("remote_knock", StreamName.EVENTS, "invites", "record_knock"),
    # Remote users' changes (EDUs in inbound federation transactions).
    Operation("remote_typing", StreamName.TYPING, "typing", "apply_remote"),
    Operation("remote_receipt", StreamName.RECEIPTS, "receipts", "apply_remote"),
    Operation("remote_presence", StreamName.PRESENCE, "presence", "apply_remote"),
    Operation("remote_to_device", StreamName.TO_DEVICE, "to_device", "apply_remote_to_device"),
    Operation("remote_device_list", StreamName.DEVICE_LISTS, "device_lists", "apply_remote_device_list_update"),
    Operation("remote_signing_key", StreamName.DEVICE_LISTS, "device_lists", "apply_remote_signing_key_update"),
)

# --- remote implementations ----------------------------------------------------------------


class RemoteCall:
    """Calls ``call/<name>`` on one writer process: the transport of every ``Remote*`` writer."""

    def __init__(self, client: Caller, writer: str) -> None:
        self._client = client
        self._writer = writer

    async def __call__(self, name: str, *args: Any, requester: Requester | None = None, **kwargs: Any) -> Any:
        body = {
            "requester": None if requester is None else attrs.asdict(requester),
            "args": [thaw(a) for a in args],
            "kwargs": {key: thaw(value) for key, value in kwargs.items()},
        }
        return (await self._client.call(self._writer, f"call/{name}", body))["result"]


class RemoteTyping:
    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    async def set_typing(self, requester: Requester, room_id: str, user_id: str, typing: bool,
                         timeout_ms: int | None) -> None:
        await self._call("typing", room_id, user_id, typing, timeout_ms, requester=requester)

    async def apply_remote(self, room_id: str, user_id: str, typing: bool) -> bool:
        return bool(await self._call("remote_typing", room_id, user_id, typing))


class RemoteReceipts:
    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    async def receipt(self, requester: Requester, room_id: str, receipt_type: str, event_id: str,
                      thread_id: str | None) -> None:
        await self._call("receipt", room_id, receipt_type, event_id, thread_id, requester=requester)

    async def apply_remote(self, room_id: str, receipt_type: str, user_id: str, event_id: str,
                           data: dict[str, Any]) -> bool:
        return bool(await self._call("remote_receipt", room_id, receipt_type, user_id, event_id, data))


class RemoteFullyRead:
    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    async def set_fully_read(self, requester: Requester, room_id: str, event_id: str) -> None:
        await self._call("fully_read", room_id, event_id, requester=requester)


class RemotePresence:
    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    async def set_status(self, requester: Requester, user_id: str, state: str, status_msg: str | None) -> None:
        await self._call("presence", user_id, state, status_msg, requester=requester)

    async def apply_remote(self, user_id: str, state: str, status_msg: str | None, last_active_ago: int,
                           currently_active: bool) -> None:
        await self._call("remote_presence", user_id, state, status_msg, last_active_ago, currently_active)


class RemoteToDevice:
    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    async def send_to_device(self, requester: Requester, event_type: str, txn_id: str,
                             body: dict[str, Any]) -> None:
        await self._call("to_device", event_type, txn_id, body, requester=requester)

    async def apply_remote_to_device(self, sender: str, event_type: str, message_id: str,
                                     messages: Mapping[str, Any]) -> int:
        return int(await self._call("remote_to_device", sender, event_type, message_id, messages))


class RemoteDeviceLists:
    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    async def apply_remote_device_list_update(self, user_id: str, device_id: str, *, deleted: bool,
                                              keys: Mapping[str, Any] | None, stream_id: int | None = None,
                                              prev_ids: Sequence[int] = (),
                                              display_name: str | None = None) -> None:
        await self._call("remote_device_list", user_id, device_id, deleted=deleted, keys=keys, stream_id=stream_id,
                         prev_ids=list(prev_ids), display_name=display_name)

    async def apply_remote_signing_key_update(self, user_id: str, master_key: Mapping[str, Any] | None,
                                              self_signing_key: Mapping[str, Any] | None) -> None:
        await self._call("remote_signing_key", user_id, master_key, self_signing_key)


class RemoteAccountData:
    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    async def set_global(self, requester: Requester, user_id: str, data_type: str, content: dict[str, Any]) -> int:
        return int(await self._call("account_data", user_id, data_type, content, requester=requester))

    async def set_room(self, requester: Requester, user_id: str, room_id: str, data_type: str,
                       content: dict[str, Any]) -> int:
        return int(await self._call("room_account_data", user_id, room_id, data_type, content, requester=requester))

    async def edit_push_rules(self, requester: Requester, edit: dict[str, Any]) -> None:
        await self._call("push_rules", edit, requester=requester)


class RemoteInviteWriter:
    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    async def record_invite(self, user_id: str, room_id: str, room_version: str, event_id: str,
                            event: dict[str, Any], invite_state: list[Any]) -> None:
        await self._call("remote_invite", user_id, room_id, room_version, event_id, event, invite_state)

    async def record_rejection(self, user_id: str, room_id: str, room_version: str, event_id: str,
                               event: dict[str, Any]) -> None:
        await self._call("remote_invite_rejected", user_id, room_id, room_version, event_id, event)

    async def record_knock(self, user_id: str, room_id: str, room_version: str, event_id: str,
                           event: dict[str, Any], knock_state: list[Any]) -> None:
        await self._call("remote_knock", user_id, room_id, room_version, event_id, event, knock_state)


# --- choosing, and serving -------------------------------------------------------------------


def build_writers(local: Writers, layout: Layout, client: Caller | None) -> Writers:
    """``local``'s writer where this process writes the stream, a remote stand-in for the writer elsewhere.

    ``client`` is None in a single process, which writes every stream."""

    def remote(stream: StreamName) -> RemoteCall | None:
        if layout.writes(stream):
            return None
        if client is None:
            raise ValueError(f"{layout.instance_name} does not write {stream} and has no internal API client")
        return RemoteCall(client, layout.writers(stream)[0])

    typing, receipts, presence = remote(StreamName.TYPING), remote(StreamName.RECEIPTS), remote(StreamName.PRESENCE)
    to_device, account_data = remote(StreamName.TO_DEVICE), remote(StreamName.ACCOUNT_DATA)
    device_lists = remote(StreamName.DEVICE_LISTS)
    return Writers(
        typing=local.typing if typing is None else RemoteTyping(typing),
        receipts=local.receipts if receipts is None else RemoteReceipts(receipts),
        fully_read=local.fully_read if account_data is None else RemoteFullyRead(account_data),
        presence=local.presence if presence is None else RemotePresence(presence),
        to_device=local.to_device if to_device is None else RemoteToDevice(to_device),
        device_lists=local.device_lists if device_lists is None else RemoteDeviceLists(device_lists),
        account_data=local.account_data if account_data is None else RemoteAccountData(account_data),
        invites=choose_invite_writer(local.invites, layout, client),
    )


def choose_invite_writer(local: InviteWriter, layout: Layout, client: Caller | None) -> InviteWriter:
    """The invite writer alone, for federation's membership handler, built before the rest."""
    if layout.writes(StreamName.EVENTS):
        return local
    if client is None:
        raise ValueError(f"{layout.instance_name} does not write events and has no internal API client")
    return RemoteInviteWriter(RemoteCall(client, layout.writers(StreamName.EVENTS)[0]))


def register_writer_operations(server: OperationRegistry, layout: Layout, local: Writers) -> None:
    """Serve ``call/<name>`` for every operation on a stream this process writes."""
    for op in OPERATIONS:
        if layout.writes(op.stream):
            server.register(f"call/{op.name}", _serve(getattr(getattr(local, op.field), op.method)))


def _serve(local: Callable[..., Awaitable[Any]]) -> Serve:
    async def operation(body: dict[str, Any]) -> dict[str, Any]:
        args = list(body.get("args", []))
        if body.get("requester") is not None:
            args.insert(0, Requester(**body["requester"]))
        return {"result": await local(*args, **body.get("kwargs", {}))}

    return operation
