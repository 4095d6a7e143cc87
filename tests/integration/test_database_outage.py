"""A real process whose real PostgreSQL dies and comes back.

The test starts a PostgreSQL cluster of its own (the embedded database's code, in a folder of
the test's), points a ``tributary run`` at it by URL, and SIGKILLs the postmaster while the
server serves: what an operator sees when the database host dies.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from storage.embedded import EmbeddedPostgres, EmbeddedPostgresError, find_binaries
from tests.harness import TributaryProcess

T = TypeVar("T")

#: Every wait is a deadline, generous for a busy machine; nothing asserts how fast.
DEADLINE = 60.0


def _call(hs: TributaryProcess, method: str, path: str, body: dict[str, Any] | None = None,
          token: str | None = None, *, port: int | None = None) -> tuple[int, Any, dict[str, str]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port or hs.client_port}{path}", method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            raw, status, headers = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read(), e.code, dict(e.headers)
    try:
        parsed: Any = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    return status, parsed, headers


def _until(what: str, check: Callable[[], T | None]) -> T:
    deadline = time.monotonic() + DEADLINE
    while True:
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE}s: {what}")
        time.sleep(0.1)


def _kill_postmaster(pg: EmbeddedPostgres) -> None:
    pid = int((pg.cluster_dir / "postmaster.pid").read_text().splitlines()[0])
    os.kill(pid, signal.SIGKILL)
    _until("the postmaster is gone", lambda: None if _alive(pid) else True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of an exited child still answers signal 0: it is gone all the same.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _restart(pg: EmbeddedPostgres) -> None:
    """Start the killed cluster again at the same address (its backends, orphaned by the
    postmaster's death, may take a moment to exit and free the shared memory)."""
    pg.stop()  # releases the ownership lock; the postmaster is already gone

    def started() -> bool | None:
        try:
            pg.start()
        except EmbeddedPostgresError:
            return None
        return True

    _until("the cluster starts again", started)


def test_a_database_outage_is_503_with_retry_after_and_the_server_recovers_by_itself(
        world_traversable_tmp: Path) -> None:
    """Messages are sent and acknowledged. The postmaster is SIGKILLed: sends and /sync
    answer 503 with Retry-After (never 500), /health is 503 while /health/live stays 200, the
    log says once that the database is unreachable and has no traceback per request. The
    cluster comes back at the same address: /health turns 200, sends work again, and every
    message acknowledged before the outage is still in the room."""
    pg = EmbeddedPostgres(world_traversable_tmp / "pg", find_binaries())
    dsn = pg.start()
    hs = TributaryProcess.configure(world_traversable_tmp / "hs", database_url=dsn)
    try:
        hs.start(timeout=DEADLINE)
        status, answer, _ = _call(hs, "POST", "/_matrix/client/v3/register",
                                  {"username": "alice", "password": "correct horse",
                                   "auth": {"type": "m.login.dummy"}})
        assert status == 200, answer
        token = answer["access_token"]
        status, answer, _ = _call(hs, "POST", "/_matrix/client/v3/createRoom", {}, token)
        assert status == 200, answer
        room = urllib.parse.quote(answer["room_id"])

        def send(txn: str) -> tuple[int, Any, dict[str, str]]:
            return _call(hs, "PUT", f"/_matrix/client/v3/rooms/{room}/send/m.room.message/{txn}",
                         {"msgtype": "m.text", "body": txn}, token)

        acknowledged = []
        for i in range(10):
            status, answer, _ = send(f"before-{i}")
            assert status == 200, answer
            acknowledged.append(answer["event_id"])
        assert _call(hs, "GET", "/health")[0] == 200
        log_before = hs.log_path.read_text(errors="replace")

        _kill_postmaster(pg)

        # Every send answers (no hang) and, once the pool has noticed, with a clear 503.
        def refused() -> tuple[int, Any, dict[str, str]] | None:
            result = send(f"during-{time.monotonic_ns()}")
            assert result[0] in (200, 503), result  # never a 500
            return result if result[0] == 503 else None

        status, answer, headers = _until("a send answers 503", refused)
        assert answer["errcode"] == "M_UNKNOWN" and "database" in answer["error"], answer
        assert int(headers["Retry-After"]) >= 1
        failed = 1
        for i in range(20):
            status, answer, headers = send(f"outage-{i}")
            assert status == 503 and "Retry-After" in headers, (status, answer)
            failed += 1
        status, answer, headers = _call(hs, "GET", "/_matrix/client/v3/sync?timeout=0", token=token)
        assert status == 503 and "Retry-After" in headers, (status, answer)
        _until("/health answers 503", lambda: True if _call(hs, "GET", "/health")[0] == 503 else None)
        assert _call(hs, "GET", "/health/ready")[0] == 503
        assert _call(hs, "GET", "/health/live")[0] == 200
        status, body, _ = _call(hs, "GET", "/metrics", port=hs.metrics_port)
        assert "tributary_storage_database_up 0.0" in body

        _restart(pg)

        _until("/health answers 200", lambda: True if _call(hs, "GET", "/health")[0] == 200 else None)
        status, answer, _ = send("after")
        assert status == 200, answer
        acknowledged.append(answer["event_id"])
        status, answer, _ = _call(hs, "GET", f"/_matrix/client/v3/rooms/{room}/messages?dir=b&limit=100",
                                  token=token)
        assert status == 200, answer
        in_room = {event["event_id"] for event in answer["chunk"]}
        assert set(acknowledged) <= in_room
        status, body, _ = _call(hs, "GET", "/metrics", port=hs.metrics_port)
        assert "tributary_storage_database_up 1.0" in body

        outage_log = hs.log_path.read_text(errors="replace")[len(log_before):]
        assert outage_log.count("Traceback") == 0, outage_log[-5000:]
        assert outage_log.count("requests fail with 503 until it is back") == 1, outage_log[-5000:]
        assert outage_log.count("the database is reachable again") == 1, outage_log[-5000:]
        # A few lines for the outage (its warning; a stream position that could not be saved
        # as it began), not one per request; and no error.
        warnings = [line for line in outage_log.splitlines() if " WARNING " in line]
        assert len(warnings) < 5 < failed, warnings
        assert " ERROR " not in outage_log, outage_log[-5000:]
    finally:
        hs.stop()
        pg.stop()
