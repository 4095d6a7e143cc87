"""Device-list updates that outlive a destination's downtime and a crash of the sender (issue 29).

Two real Tributary processes: Alice on A shares a room with Bob on B, and B caches Alice's device
list. B is stopped and A backs off from it, across a restart of A; Alice logs in a new device and
uploads its keys. When B comes back, its stored copy of Alice's list gains the new device without Alice changing anything
else. Then the same with A (its in-process sender) SIGKILLed after the change and started again
before B returns: the change is read from the device_lists stream above B's position. Last,
Alice's cross-signing keys, set up while B is down and A is killed, reach B the same way
(``m.signing_key_update``).
"""

# tests: federation_sender/core.py, federation_sender/sender.py, federation_sender/device_lists.py,
#        storage/stores/federation_sender.py

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import attrs
import pytest

from tests.conftest import scratch_database
from tests.harness import TributaryProcess
from tests.integration.test_client_e2e import cross_signing_keys, signed_keys
from tests.integration.test_client_support import Client
from tests.integration.test_federation_sender import Alice, Tributary, configure
from tests.twisted_plugin import eventually, run_sync


@attrs.define
class Servers:
    a: Tributary
    b: Tributary
    alice: Alice
    alice_id: str

    def b_devices(self) -> set[str]:
        """Alice's devices as B stores them (its cache, not a query to A)."""
        rows = self.b.query("SELECT device_id FROM remote_devices WHERE user_id = %s", self.alice_id)
        return {r[0] for r in rows}

    async def new_device(self, name: str) -> str:
        """Alice logs in a new device and uploads its keys: two changes on the device_lists stream."""
        response = await self.a.client.login("alice_dl", device_id=name)
        assert response.status == 200, response
        token = str(response.body["access_token"])
        keys = signed_keys(self.alice_id, name)
        upload = await self.a.client.request("POST", "keys/upload", {"device_keys": keys}, token=token)
        assert upload.status == 200, upload
        return name


@pytest.fixture(scope="module")
def servers(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("devlists")
    with scratch_database(postgres_template) as dsn_a, scratch_database(postgres_template) as dsn_b:
        proc_a, name_a = configure(tmp / "a", dsn_a)
        proc_b, name_b = configure(tmp / "b", dsn_b)
        a = Tributary(proc_a, name_a, Client(proc_a.base_url), dsn_a)
        b = Tributary(proc_b, name_b, Client(proc_b.base_url), dsn_b)
        proc_a.start()
        proc_b.start()
        try:
            async def set_up() -> Servers:
                alice = await Alice.register(a, "alice_dl")
                bob = await Alice.register(b, "bob_dl")
                room = await alice.create_room()
                await bob.call("POST", f"join/{quote(room, safe='')}?server_name={quote(name_a)}", {})
                alice_id = str((await alice.call("GET", "account/whoami"))["user_id"])
                s = Servers(a, b, alice, alice_id)
                await s.new_device("FIRST")
                await eventually(lambda: "FIRST" in s.b_devices(), timeout=30, what="B caches Alice's list")
                return s

            yield run_sync(set_up())
        finally:
            for proc in (proc_b, proc_a):
                if proc.process is not None and proc.process.poll() is None:
                    proc.stop()


def backoff(s: Servers) -> int:
    rows = s.a.query("SELECT retry_interval FROM destinations WHERE destination = %s", s.b.server_name)
    return int(rows[0][0] or 0) if rows else 0


def sigkill(process: TributaryProcess) -> None:
    assert process.process is not None
    process.process.send_signal(signal.SIGKILL)
    process.process.wait()


@pytest.mark.timeout(120)
async def test_a_device_added_while_the_destination_is_down_reaches_it_when_it_is_back(servers: Servers) -> None:
    """B is down and A backs off from it, across a clean restart of A (the backoff comes back from
    the database, with nothing queued in memory); Alice adds a device meanwhile."""
    s = servers
    assert s.b.process.stop() == 0, s.b.process.output[-3000:]
    room = str((await s.alice.call("GET", "joined_rooms"))["joined_rooms"][0])
    await s.alice.send(room, "B is down")
    await eventually(lambda: backoff(s) > 0, timeout=30, what="A backs off from B")
    assert s.a.process.stop() == 0, s.a.process.output[-3000:]
    s.a.process.start()
    await s.new_device("WHILE_DOWN")
    s.b.process.start()
    await eventually(lambda: "WHILE_DOWN" in s.b_devices(), timeout=30, what="B learns of the new device")
    newest = s.a.query("SELECT MAX(stream_id) FROM device_lists_stream")
    await eventually(lambda: s.a.query("SELECT device_lists_position FROM destinations WHERE destination = %s",
                                       s.b.server_name) == newest, timeout=10, what="A's position for B moves on")


@pytest.mark.timeout(120)
async def test_a_device_change_outlives_a_sigkill_of_the_sender_before_delivery(servers: Servers) -> None:
    s = servers
    assert s.b.process.stop() == 0, s.b.process.output[-3000:]
    await s.new_device("BEFORE_KILL")
    await eventually(lambda: backoff(s) > 0, timeout=30, what="A failed to reach B")
    sigkill(s.a.process)  # the change is committed, never delivered
    s.a.process.start()
    s.b.process.start()
    await eventually(lambda: "BEFORE_KILL" in s.b_devices(), timeout=30, what="B learns of the device after A's crash")


@pytest.mark.timeout(120)
async def test_cross_signing_keys_set_up_while_the_destination_is_down_outlive_a_sigkill(servers: Servers) -> None:
    s = servers

    def b_master_key() -> str | None:
        rows = s.b.query("SELECT key_json FROM e2e_cross_signing_keys WHERE user_id = %s AND key_type = 'master'",
                         s.alice_id)
        return str(rows[0][0]) if rows else None

    assert b_master_key() is None
    assert s.b.process.stop() == 0, s.b.process.output[-3000:]
    room = str((await s.alice.call("GET", "joined_rooms"))["joined_rooms"][0])
    await s.alice.send(room, "B is down again")
    await eventually(lambda: backoff(s) > 0, timeout=30, what="A backs off from B")
    keys, _ = cross_signing_keys(s.alice_id)
    await s.alice.call("POST", "keys/device_signing/upload", {
        "master_key": keys["master"], "self_signing_key": keys["self_signing"],
        "user_signing_key": keys["user_signing"]})
    sigkill(s.a.process)  # the keys are stored, the update never delivered
    s.a.process.start()
    s.b.process.start()
    await eventually(lambda: b_master_key() is not None, timeout=30, what="B learns Alice's master key")
    assert f'"{next(iter(keys["master"]["keys"]))}"' in str(b_master_key())
    rows = s.b.query("SELECT key_type FROM e2e_cross_signing_keys WHERE user_id = %s ORDER BY key_type", s.alice_id)
    assert rows == [("master",), ("self_signing",)], "the user-signing key stays with its owner's server"
