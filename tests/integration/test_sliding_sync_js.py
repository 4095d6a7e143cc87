"""An unmodified client library that speaks simplified sliding sync (MSC4186) against Tributary:
matrix-js-sdk 37.5.0 from npm (the newest release whose SlidingSync uses the
``org.matrix.simplified_msc3575`` endpoint and that supports Node 20; installed by
``.ci/install-js-client.sh``), with its Rust crypto. Two users: a room by name with a message,
typing, and an encrypted DM that Bob's client decrypts (to-device room keys, one-time key
counts and device lists all through sliding sync's extensions)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from twisted.internet.threads import deferToThread

from tests.integration.test_client_rooms import ROOM_LIMITS
from tests.integration.test_client_support import running_server

CLIENT_DIR = Path(__file__).resolve().parents[1] / "js_client"


@pytest.mark.timeout(180)
async def test_matrix_js_sdk_syncs_with_sliding_sync(database_dsn: str, tmp_path: Path) -> None:
    assert (CLIENT_DIR / "node_modules" / "matrix-js-sdk").is_dir(), \
        "matrix-js-sdk is not installed: `make services` runs .ci/install-js-client.sh"
    async with running_server(database_dsn, tmp_path, **ROOM_LIMITS) as (_, client):
        users = {}
        for name in ("alice", "bob"):
            registered = await client.register_ok(name)
            users[name] = {key: registered[key] for key in ("user_id", "access_token", "device_id")}
        # In a thread: the server answering the client runs on this process's reactor.
        done = await deferToThread(
            subprocess.run, ["node", str(CLIENT_DIR / "sliding_sync_client.mjs"), client.base_url, json.dumps(users)],
            cwd=CLIENT_DIR, capture_output=True, text=True, timeout=150)
        lines = done.stdout.strip().splitlines()
        assert done.returncode == 0 and lines, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
        seen = json.loads(lines[-1])
        assert seen["lobby_name"] == "Lobby" and seen["lobby_members"] == 2
        assert seen["typing"] is True
        assert seen["dm_encrypted"] is True and seen["dm_type"] == "m.room.encrypted"
        assert seen["dm_body"] == "a secret"
