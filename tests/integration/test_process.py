"""Real ``tributary`` processes: start, serve, stop cleanly; embedded database lifecycle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psycopg2

from tests.harness import TributaryProcess, run_cli


def _postgres_processes_for(data_dir: Path) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "postgres" in line and str(data_dir) in line]


def test_serves_versions_errors_metrics_and_stops_cleanly(tmp_path: Path, database_dsn: str) -> None:
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn)
    hs.start()
    try:
        status, body = hs.get("/_matrix/client/versions")
        assert status == 200
        assert "v1.1" in json.loads(body)["versions"]

        status, body = hs.get("/_matrix/client/v3/no/such/endpoint")
        assert status == 404
        assert json.loads(body)["errcode"] == "M_UNRECOGNIZED"

        status, body = hs.get("/metrics", port=hs.metrics_port)
        assert status == 200
        text = body.decode()
        assert 'tributary_build_info{version="0.1.0"} 1.0' in text
        assert 'tributary_http_requests_total{method="GET",servlet="client_versions",status_class="2xx"} 1.0' in text
        assert "process_resident_memory_bytes" in text
    finally:
        code = hs.stop(signal.SIGTERM)
    assert code == 0, hs.output
    assert "stopped" in hs.output


def test_embedded_database_survives_restarts_and_a_crash(world_traversable_tmp: Path) -> None:
    """First start initialises the embedded cluster; a SIGKILLed homeserver leaves
    PostgreSQL running, and the next start takes it over; a clean stop leaves no
    PostgreSQL process behind."""
    hs = TributaryProcess.configure(world_traversable_tmp, database_url=None)
    hs.start(timeout=60)
    assert (hs.data_dir / "postgres" / "PG_VERSION").exists()
    assert (hs.data_dir / "localhost.signing.key").exists()
    key_before = (hs.data_dir / "localhost.signing.key").read_text()

    hs.stop(signal.SIGKILL)
    assert _postgres_processes_for(hs.data_dir), "expected the orphaned cluster to still run"

    hs.start(timeout=60)
    assert hs.get("/_matrix/client/versions")[0] == 200
    assert (hs.data_dir / "localhost.signing.key").read_text() == key_before
    assert "left running by a previous run" in _read_until_now(hs)
    assert hs.stop(signal.SIGINT) == 0, hs.output
    assert _postgres_processes_for(hs.data_dir) == []


def test_unreachable_data_dir_is_refused_clearly_as_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        return  # the check concerns the unprivileged user that root hands PostgreSQL to
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    hs = TributaryProcess.configure(private, database_url=None)
    try:
        hs.start(timeout=30)
    except RuntimeError as e:
        assert "cannot enter" in str(e) and "chmod o+x" in str(e)
    else:  # pragma: no cover - a failure
        hs.stop()
        raise AssertionError("start should have been refused")


def _read_until_now(hs: TributaryProcess) -> str:
    # The process is still running; the lines it has written so far are in its log file.
    text = hs.log_path.read_text(encoding="utf-8", errors="replace")
    hs.output = text
    return text


def test_bad_config_prints_one_line_naming_the_key_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "homeserver.yaml"
    cases = {
        "server_name: example.org\nlisteners:\n  - type: http\n    port: abc\n":
            "config error: listeners[0].port: expected an integer 1-65535, got 'abc'",
        "server_name: example.org\nnot_a_key: 1\n": "config error: not_a_key: unknown key",
        "server_name: example.org\ntls_certificate_path: /nonexistent/cert.pem\ntls_private_key_path: /nonexistent/k\n":
            "config error: tls_certificate_path: file not found: /nonexistent/cert.pem",
        "listeners: []\n": "config error: server_name: is required",
        "server_name: example.org\nworker_replication_secret: s\nworkers:\n  g1: {app: generic}\n":
            "config error: database.url: workers share one PostgreSQL database",
        "server_name: example.org\nworkers:\n  g1: {app: generic}\n  g1: {app: background}\n":
            "'g1' is given twice in the same mapping",
        "server_name: [unclosed\n": "is not valid YAML at line",
    }
    for text, expected in cases.items():
        config.write_text(text)
        result = run_cli("run", "--config", str(config))
        assert result.returncode == 2, (text, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert expected in lines[0]


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = run_cli("run", "--config", str(tmp_path / "absent.yaml"))
    assert result.returncode == 2
    assert "config file not found" in result.stderr


def test_migrate_then_refuse_a_newer_schema(tmp_path: Path, empty_database_dsn: str) -> None:
    hs = TributaryProcess.configure(tmp_path, database_url=empty_database_dsn)
    result = run_cli("migrate", "--config", str(hs.config_path))
    assert result.returncode == 0, result.stderr
    assert "applied schema migration 0001_server_meta" in result.stderr
    assert "the schema is now at version" in result.stderr

    conn = psycopg2.connect(empty_database_dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("INSERT INTO schema_version (version, name, applied_ts) VALUES (9999, 'from_the_future', 0)")
    conn.close()

    result = run_cli("migrate", "--config", str(hs.config_path))
    assert result.returncode == 1
    assert "schema is at version 9999" in result.stderr


def test_generate_config_writes_a_loadable_file_and_never_overwrites(tmp_path: Path) -> None:
    out = tmp_path / "hs.yaml"
    result = run_cli("generate-config", "--server-name", "example.org", "--data-dir", "d", "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert 'server_name: "example.org"' in out.read_text()
    again = run_cli("generate-config", "--server-name", "example.org", "--output", str(out))
    assert again.returncode == 2
    assert "not overwriting" in again.stderr
    bad = run_cli("generate-config", "--server-name", "bad name!")
    assert bad.returncode == 2


def test_version_flag() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == "tributary 0.1.0"


def test_replication_listener_speaks_the_line_protocol(tmp_path: Path, database_dsn: str) -> None:
    """What an operator sees with netcat on the main process's replication port:
    SERVER and PING, then after NAME/PING/REPLICATE one POSITION per stream."""
    import socket

    from tests.harness import free_port

    port = free_port()
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn, server_name="repl.test")
    import yaml

    raw = yaml.safe_load(hs.config_path.read_text())
    raw["listeners"].append({"type": "replication", "port": port})
    hs.config_path.write_text(yaml.safe_dump(raw))
    hs.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            reader = sock.makefile("r", encoding="utf-8", newline="\n")
            assert reader.readline().strip() == "SERVER repl.test"
            assert reader.readline().startswith("PING ")
            sock.sendall(b"NAME netcat\nPING 1\nREPLICATE\n")
            streams = set()
            while len(streams) < 10:
                line = reader.readline().strip()
                if line.startswith("POSITION "):
                    streams.add(line.split()[1])
        assert {"events", "caches", "typing", "receipts", "account_data", "federation"} <= streams
    finally:
        assert hs.stop() == 0, hs.output


def test_tls_listener_gets_a_generated_self_signed_certificate(tmp_path: Path, database_dsn: str) -> None:
    import ssl
    import urllib.request

    import yaml

    from tests.harness import free_port

    tls_port = free_port()
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn, server_name="tls.test")
    raw = yaml.safe_load(hs.config_path.read_text())
    raw["listeners"].append({"type": "http", "port": tls_port, "tls": True, "resources": ["client"]})
    hs.config_path.write_text(yaml.safe_dump(raw))
    hs.start()
    try:
        cert = hs.data_dir / "tls.test.tls.crt"
        assert cert.exists() and (hs.data_dir / "tls.test.tls.key").stat().st_mode & 0o077 == 0
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False  # the certificate names tls.test, we dial 127.0.0.1
        with urllib.request.urlopen(f"https://127.0.0.1:{tls_port}/_matrix/client/versions", context=context) as r:
            assert r.status == 200 and b"v1.1" in r.read()
    finally:
        assert hs.stop() == 0, hs.output


def test_http_connection_limits_over_loopback(tmp_path: Path, database_dsn: str) -> None:
    """A listener capped at 3 connections per address and 3 s for headers: from 127.0.0.1
    (the listener exempts nothing, not even loopback), a fourth connection is closed at once while three keep-alive
    ones stay; closing one lets a new one in; and a client dribbling its headers a byte at a
    time is closed. Waits are generous deadlines; only the outcome is asserted."""
    import itertools
    import socket
    import time

    import yaml

    from tests.harness import free_port

    port = free_port()
    hs = TributaryProcess.configure(tmp_path, database_url=database_dsn)
    raw = yaml.safe_load(hs.config_path.read_text())
    raw["listeners"].append({"type": "http", "port": port, "resources": ["client"], "connection_limits": {
        "max_connections_per_ip": 3, "header_timeout": "3s", "idle_timeout": "5m", "exempt_ranges": []}})
    hs.config_path.write_text(yaml.safe_dump(raw))
    request = b"GET /_matrix/client/versions HTTP/1.1\r\nHost: localhost\r\n\r\n"

    def answered(sock: socket.socket) -> bool:
        """Send a request and read until its answer's headers (False: the server closed)."""
        received = b""
        try:
            sock.sendall(request)
            while b"\r\n\r\n" not in received:
                chunk = sock.recv(65536)
                if not chunk:
                    return False
                received += chunk
        except OSError:
            return False
        return received.startswith(b"HTTP/1.1 200")

    def closed_by_server(sock: socket.socket, deadline: float) -> bool:
        sock.settimeout(1)
        while time.monotonic() < deadline:
            try:
                if not sock.recv(65536):
                    return True
            except socket.timeout:
                continue
            except OSError:  # reset: aborted
                return True
        return False

    hs.start()
    try:
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
        assert all(answered(sock) for sock in held)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as extra:
            assert not answered(extra)
        assert all(answered(sock) for sock in held)  # the three stay open
        held.pop().close()
        deadline = time.monotonic() + 30
        while True:  # the server sees the close on its next read: retry until it frees the slot
            with socket.create_connection(("127.0.0.1", port), timeout=30) as again:
                if answered(again):
                    break
            assert time.monotonic() < deadline, "the closed connection's slot was never freed"
            time.sleep(0.2)
        for sock in held:
            sock.close()

        with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
            deadline = time.monotonic() + 60
            closed = False
            for byte in itertools.cycle(request):  # one byte each half second, until closed
                if time.monotonic() > deadline:
                    break
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                if closed_by_server(slow, time.monotonic() + 0.5):
                    closed = True
                    break
            assert closed, "a client dribbling header bytes was never closed"

        status, body = hs.get("/metrics", port=hs.metrics_port)
        text = body.decode()
        assert 'tributary_http_connections_closed_total{reason="per_ip_cap"}' in text
        assert 'tributary_http_connections_closed_total{reason="per_ip_cap"} 0.0' not in text
        assert 'tributary_http_connections_closed_total{reason="header_timeout"} 0.0' not in text
    finally:
        assert hs.stop() == 0, hs.output
