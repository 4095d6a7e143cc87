"""The embedded PostgreSQL's postmaster is SIGKILLed while a client sends: the homeserver
notices, restarts it and goes on, and every send it acknowledged before, during or after the
outage is in the room afterwards (docs/admin.md, "Outages")."""

# tests: storage/embedded_supervisor.py, storage/embedded.py

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.harness import TributaryProcess


def _call(hs: TributaryProcess, method: str, path: str, body: dict[str, Any] | None = None,
          token: str | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{hs.base_url}{path}", method=method, data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _log(hs: TributaryProcess) -> str:
    return hs.log_path.read_text(encoding="utf-8", errors="replace")


def _postmaster_pid(hs: TributaryProcess) -> int:
    return int((hs.data_dir / "postgres" / "postmaster.pid").read_text().split("\n", 1)[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_embedded_postgres_is_restarted_and_nothing_acknowledged_is_lost(
        world_traversable_tmp: Path) -> None:
    hs = TributaryProcess.configure(world_traversable_tmp, database_url=None)
    hs.start(timeout=90)
    try:
        status, registered = _call(hs, "POST", "/_matrix/client/v3/register",
                                   {"username": "sender", "password": "pw-sender", "auth": {"type": "m.login.dummy"}})
        assert status == 200, registered
        token = registered["access_token"]
        status, created = _call(hs, "POST", "/_matrix/client/v3/createRoom", {}, token)
        assert status == 200, created
        room = created["room_id"]
        acknowledged: list[str] = []
        answers: dict[int, int] = {}

        def send(n: int) -> None:
            status, body = _call(hs, "PUT", f"/_matrix/client/v3/rooms/{room}/send/m.room.message/t{n}",
                                 {"msgtype": "m.text", "body": f"message {n}"}, token)
            answers[status] = answers.get(status, 0) + 1
            if status == 200:
                acknowledged.append(body["event_id"])

        for n in range(10):
            send(n)
        assert len(acknowledged) == 10
        killed = _postmaster_pid(hs)
        os.kill(killed, signal.SIGKILL)

        # Keep sending until ten more are acknowledged after the kill, within a generous deadline.
        n, deadline = 10, time.monotonic() + 90
        while len(acknowledged) < 20 and time.monotonic() < deadline:
            send(n)
            n += 1
            time.sleep(0.05)
        assert len(acknowledged) >= 20, f"no recovery: answers {answers}\n{_log(hs)[-4000:]}"
        assert set(answers) <= {200, 503}, answers  # the outage is a 503 with Retry-After, never a 500
        assert not _alive(killed) and _alive(_postmaster_pid(hs)) and _postmaster_pid(hs) != killed
        log = _log(hs)
        assert "embedded PostgreSQL has died; restarting it" in log
        assert "embedded PostgreSQL restarted" in log

        # Every acknowledged send is in the room, once.
        status, history = _call(hs, "GET", f"/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=1000",
                                None, token)
        assert status == 200
        seen = [e["event_id"] for e in history["chunk"] if e["type"] == "m.room.message"]
        assert sorted(set(acknowledged)) == sorted(set(acknowledged) & set(seen))
        assert len(seen) == len(set(seen))
        assert hs.process is not None and hs.process.poll() is None
    finally:
        code = hs.stop(signal.SIGINT)
    assert code == 0, hs.output
