"""Issue 24, as an operator meets it: a second instance on taken ports, ``migrate`` and
``register-user`` that never listen, Ctrl-C with a /sync long-poll open, a second Ctrl-C,
and every command the README shows."""

# tests: homeserver/cli.py, homeserver/port_check.py, homeserver/app.py, README.md

from __future__ import annotations

import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from tests.harness import REPO_ROOT, TributaryProcess, free_port, run_cli


LONG_POLL_WAITING = b"tributary_sync_long_polls_active 1.0"


def _tables(dsn: str) -> list[str]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            return [row[0] for row in cur.fetchall()]
    finally:
        conn.close()


def _post(url: str, body: dict[str, Any], token: str | None = None, timeout: float = 10) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def _get(url: str, token: str, timeout: float = 10) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, json.loads(response.read())


def test_second_instance_on_taken_ports_fails_in_one_line_before_touching_the_database(
        tmp_path: Path, database_dsn: str, empty_database_dsn: str) -> None:
    """A server runs. A second one configured for the same client port but a fresh, empty
    database exits 1 at once with one line naming the address; its database is untouched and
    its data directory has no signing key. ``migrate`` with that config (its port still taken)
    applies every migration, says which, binds nothing and exits 0; run again it has nothing to do."""
    first = TributaryProcess.configure(tmp_path / "first", database_url=database_dsn)
    first.start()
    try:
        second = TributaryProcess.configure(tmp_path / "second", database_url=empty_database_dsn)
        config = yaml.safe_load(second.config_path.read_text())
        config["listeners"][0]["port"] = first.client_port
        second.config_path.write_text(yaml.safe_dump(config))
        started = time.monotonic()
        result = run_cli("run", "--config", str(second.config_path))
        assert result.returncode == 1, result
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines == [f"cannot start: 127.0.0.1:{first.client_port} (listeners[0], http) is already in use"]
        assert time.monotonic() - started < 10
        assert _tables(empty_database_dsn) == []
        assert list(second.data_dir.iterdir()) == []

        # The same config with ``migrate``: its port is still taken, and migrate never listens.
        result = run_cli("migrate", "--config", str(second.config_path))
        assert result.returncode == 0, result.stderr
        summary = re.search(r"applied (\d+) migrations \(([^)]*)\); the schema is now at version (\d+)",
                            result.stderr)
        assert summary is not None, result.stderr
        applied = summary.group(2).split(", ")
        assert applied[0] == "0001_server_meta" and len(applied) == int(summary.group(1)) == int(summary.group(3))
        assert "listening" not in result.stderr and "ready" not in result.stderr
        assert "schema_version" in _tables(empty_database_dsn)
        again = run_cli("migrate", "--config", str(second.config_path))
        assert again.returncode == 0 and "schema is up to date" in again.stderr
        assert first.get("/health")[0] == 200
    finally:
        assert first.stop() == 0


def test_ctrl_c_with_a_sync_long_poll_open_answers_it_at_once_and_exits_0(tmp_path: Path, database_dsn: str) -> None:
    """A client long-polls /sync for five minutes (the longest a server waits). Ctrl-C: the
    long-poll is answered with an empty response (its next_batch is the since token) and the
    process exits 0, with no request cut off at the end of the grace period.

    "At once" is proved by the outcome, not by a stopwatch: the grace period (5 min) and the
    long-poll's own timeout are both far past the deadline of the wait below, so the process
    can only exit within it if the shutdown itself answered the long-poll."""
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn, extra={"shutdown_grace_period": "300s"})
    hs.start()
    registered = _post(f"{hs.base_url}/_matrix/client/v3/register",
                       {"username": "poller", "password": "pw-poller", "auth": {"type": "m.login.dummy"}})
    token = registered["access_token"]
    since = _get(f"{hs.base_url}/_matrix/client/v3/sync", token)[1]["next_batch"]
    answer: dict[str, Any] = {}

    def long_poll() -> None:
        try:
            answer["status"], answer["body"] = _get(
                f"{hs.base_url}/_matrix/client/v3/sync?since={since}&timeout=300000", token, timeout=600)
        except Exception as e:  # reported by the assertions below
            answer["error"] = e

    poller = threading.Thread(target=long_poll, daemon=True)
    poller.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the metrics show the long-poll once it waits
        if LONG_POLL_WAITING in hs.get("/metrics", port=hs.metrics_port)[1]:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the /sync long-poll never started waiting")
    assert hs.process is not None
    hs.process.send_signal(signal.SIGINT)
    try:
        code = hs.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 60 s after SIGINT: the long-poll held the shutdown\n"
                             f"{hs.log_path.read_text()[-3000:]}") from None
    poller.join(timeout=60)
    assert hs.stop() == code == 0, hs.output[-3000:]
    assert "still in flight" not in hs.output, hs.output[-3000:]
    assert answer.get("status") == 200, answer
    assert answer["body"]["next_batch"] == since
    assert not answer["body"].get("rooms", {}).get("join")


def test_run_port_moves_the_listeners_and_a_second_ctrl_c_stops_at_once_and_quietly(
        tmp_path: Path, database_dsn: str) -> None:
    """``tributary run --port P`` (what ``make run PORT=P`` passes) serves the client API on P
    and metrics on P+1000, whatever the config says. Then two SIGINTs in a row: the process
    exits without Twisted's ReactorNotRunning at CRITICAL or any traceback."""
    port = free_port()
    while port + 1000 > 65535 or not _free(port + 1000):
        port = free_port()
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn)
    with hs.log_path.open("a") as log:
        process = subprocess.Popen([sys.executable, "-m", "homeserver.cli", "run", "--config", str(hs.config_path),
                                    "--port", str(port)], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1000}/metrics", timeout=5) as response:
            assert response.status == 200
        assert _free(hs.client_port) and _free(hs.metrics_port)
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        code = process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = hs.log_path.read_text()
    assert code in (0, 128 + signal.SIGINT), output[-3000:]
    assert "ReactorNotRunning" not in output and "CRITICAL" not in output and "Traceback" not in output


def _free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


# --- the README's commands -----------------------------------------------------------------

README_COMMANDS = ("run", "worker", "generate-config", "migrate", "register-user", "report")


def test_the_readme_lists_every_command_and_each_runs(tmp_path: Path, empty_database_dsn: str,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subcommand is in the README's command list, and the cheap ones run as shown there:
    the installed ``tributary`` script, --help of each, generate-config, migrate, register-user
    (and its refusals)."""
    from homeserver.cli import main

    readme = (REPO_ROOT / "README.md").read_text()
    listed = set(re.findall(r"^tributary ([a-z-]+)", readme, flags=re.MULTILINE))
    assert set(README_COMMANDS) <= listed, listed
    script = Path(sys.executable).parent / "tributary"
    usage = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0, usage.stderr
    for command in README_COMMANDS:
        assert command in usage.stdout

    def run(*argv: str, stdin: str = "") -> int:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        with pytest.raises(SystemExit) as exited:
            main(list(argv))
        return int(exited.value.code or 0)

    for command in README_COMMANDS[:-1]:
        assert run(command, "--help") == 0, command
    assert run("report", "catchup", "--help") == 0
    assert run("register-user", "--data-dir", str(tmp_path / "x"), "--user", "Not Valid!", stdin="pw\n") == 2
    assert "--user" in capsys.readouterr().err
    assert run("register-user", "--data-dir", str(tmp_path / "x"), "--user", "nopassword", stdin="\n") == 2
    assert "non-empty password" in capsys.readouterr().err

    config = tmp_path / "homeserver.yaml"
    generated = run_cli("generate-config", "--server-name", "example.org", "--data-dir", str(tmp_path / "data"),
                        "--output", str(config))
    assert generated.returncode == 0, generated.stderr
    text = yaml.safe_load(config.read_text())
    text["database"] = {"url": empty_database_dsn}
    text["bcrypt_rounds"] = 4
    config.write_text(yaml.safe_dump(text))
    created = subprocess.run([sys.executable, "-m", "homeserver.cli", "register-user", "--config", str(config),
                              "--user", "root", "--admin"], input="a long passphrase\n", capture_output=True,
                             text=True, cwd=REPO_ROOT, timeout=60)
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip() == "registered @root:example.org (server admin)"
    again = subprocess.run([sys.executable, "-m", "homeserver.cli", "register-user", "--config", str(config),
                            "--user", "root"], input="x\n", capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert again.returncode == 1 and "already exists" in again.stderr
