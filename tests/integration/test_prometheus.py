# tests: docker/prometheus.yml homeserver/handlers/rooms/event_persistence.py replication/metrics.py storage/metrics.py
"""A real Prometheus server scrapes a real main process while users chat.

Prometheus is Debian's ``prometheus`` binary (``.ci/install-observability.sh``
installs it; ``make test`` runs that), started directly on a free loopback
port with its own data directory, never as the packaged system service. Its
scrape config is ``docker/prometheus.yml``'s ``tributary`` job with the
targets replaced by the live process and a 1 s interval. The process has a
replication listener with one connected replication client (this test,
speaking the line protocol over TCP, as a worker would), so RDATA flows.

Workers do not exist yet (issue 9): when they do, add one as a second target
and assert its ``rows_applied`` rose too.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml

from tests.conftest import scratch_database
from tests.harness import REPO_ROOT, TributaryProcess, free_port
from tests.observability import MatrixUser

PROMETHEUS_CONFIG = REPO_ROOT / "docker" / "prometheus.yml"
MESSAGES = 10


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if path is None:
        pytest.fail(
            "the prometheus binary is missing: run `bash .ci/install-observability.sh` "
            "(make test does) or `apt-get install prometheus`",
            pytrace=False,
        )
    return path


@attrs.define
class ReplicationPeer:
    """A replication client on the main process's TCP listener, as a worker would be:
    NAME, PING, REPLICATE, then reads every line and pings every few seconds."""

    sock: socket.socket
    lines: list[str] = attrs.field(factory=list)
    stopped: threading.Event = attrs.field(factory=threading.Event)

    @classmethod
    def connect(cls, port: int) -> ReplicationPeer:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        peer = cls(sock)
        sock.sendall(b"NAME prometheus-test\nPING 1\nREPLICATE\n")
        threading.Thread(target=peer._read, daemon=True).start()
        threading.Thread(target=peer._ping, daemon=True).start()
        return peer

    def _read(self) -> None:
        reader = self.sock.makefile("r", encoding="utf-8", newline="\n")
        try:
            for line in reader:
                self.lines.append(line.rstrip("\n"))
        except OSError:
            pass

    def _ping(self) -> None:
        while not self.stopped.wait(3.0):
            try:
                self.sock.sendall(f"PING {int(time.time() * 1000)}\n".encode())
            except OSError:
                return

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()


@attrs.define
class Prometheus:
    process: subprocess.Popen[str]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float | None:
        """The single value of an instant query, or None while it has no sample."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])


def scrape_config(targets: list[tuple[str, str, str]]) -> dict[str, Any]:
    """docker/prometheus.yml, its ``tributary`` job pointed at ``(address, instance name, kind)`` targets."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_CONFIG.read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["tributary"]
    job["scrape_interval"] = "1s"
    job["static_configs"] = [
        {"targets": [address], "labels": {"instance_name": name, "worker_kind": kind}} for address, name, kind in targets
    ]
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["scrape_configs"] = [job]
    return config


@pytest.fixture(scope="module")
def stack(postgres_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TributaryProcess, int, Prometheus]]:
    binary = prometheus_binary()
    tmp = tmp_path_factory.mktemp("prometheus")
    with scratch_database(postgres_template) as dsn:
        hs = TributaryProcess.configure(tmp / "main", database_url=dsn)
        replication_port = free_port()
        raw = yaml.safe_load(hs.config_path.read_text(encoding="utf-8"))
        raw["listeners"].append({"type": "replication", "port": replication_port})
        hs.config_path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        hs.start()
        try:
            config_path = tmp / "prometheus.yml"
            config_path.write_text(
                yaml.safe_dump(scrape_config([(f"127.0.0.1:{hs.metrics_port}", "master", "main")])), encoding="utf-8"
            )
            port = free_port()
            log = tmp / "prometheus.log"
            with open(log, "w", encoding="utf-8") as log_file:
                process = subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config_path}",
                        f"--storage.tsdb.path={tmp / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        "--log.level=warn",
                    ],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            prometheus = Prometheus(process, port, log)
            try:
                _wait_ready(prometheus)
                yield hs, replication_port, prometheus
            finally:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        finally:
            hs.stop()


def _wait_ready(prometheus: Prometheus, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if prometheus.process.poll() is not None:
            pytest.fail(f"prometheus exited with {prometheus.process.returncode}:\n{prometheus.log.read_text()}")
        try:
            with urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    pytest.fail(f"prometheus was not ready within {timeout}s:\n{prometheus.log.read_text()}")


def wait_for(prometheus: Prometheus, expr: str, condition: Any, what: str, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    value: float | None = None
    while time.monotonic() < deadline:
        value = prometheus.value(expr)
        if value is not None and condition(value):
            return value
        time.sleep(0.25)
    targets = prometheus.query('up{job="tributary"}')
    pytest.fail(f"{what}: {expr} is {value} after {timeout}s; targets: {targets}", pytrace=False)


EVENTS = 'sum(tributary_events_persisted_total{job="tributary", origin="local"})'
FACTS = 'sum(tributary_stream_facts_written_total{job="tributary", stream="events"})'
RDATA = 'sum(tributary_replication_commands_sent_total{job="tributary", transport="tcp_server", command="RDATA"})'
ROWS = 'sum(tributary_replication_rows_sent_total{job="tributary", stream="events"})'
CONNECTIONS = 'sum(tributary_replication_connections{job="tributary", transport="tcp_server"})'
SENDS = 'sum(tributary_http_requests_total{job="tributary", servlet="client_room_send", status_class="2xx"})'


def test_prometheus_sees_event_and_replication_counters_rise(stack: tuple[TributaryProcess, int, Prometheus]) -> None:
    """Users chat on the main process while a replication client follows it;
    Prometheus, scraping once a second, sees the events persisted, the stream
    facts, the HTTP sends and the RDATA commands and rows sent all rise."""
    hs, replication_port, prometheus = stack
    wait_for(prometheus, 'up{job="tributary", instance_name="master", worker_kind="main"}', lambda v: v == 1,
             "the main process is scraped")
    peer = ReplicationPeer.connect(replication_port)
    try:
        wait_for(prometheus, CONNECTIONS, lambda v: v == 1, "Prometheus sees the replication connection")
        before = {expr: wait_for(prometheus, expr, lambda v: v >= 0, "a first sample") for expr in
                  (EVENTS, FACTS, RDATA, ROWS, SENDS)}

        alice = MatrixUser.register(hs.base_url, "alice")
        room = alice.create_room()
        for i in range(MESSAGES):
            alice.send(room, f"message {i}")

        # createRoom persists several events of its own; the sends persist MESSAGES more.
        wait_for(prometheus, EVENTS, lambda v: v >= before[EVENTS] + MESSAGES + 3, "events persisted")
        wait_for(prometheus, FACTS, lambda v: v >= before[FACTS] + MESSAGES + 3, "events stream facts written")
        wait_for(prometheus, SENDS, lambda v: v == before[SENDS] + MESSAGES, "client sends answered 2xx")
        wait_for(prometheus, RDATA, lambda v: v >= before[RDATA] + MESSAGES, "RDATA commands sent")
        wait_for(prometheus, ROWS, lambda v: v >= before[ROWS] + MESSAGES, "events rows sent over replication")
        # PromQL over the scraped series works as the dashboard uses it.
        rate = prometheus.query('sum by (origin) (rate(tributary_events_persisted_total{job="tributary"}[1m]))')
        assert {r["metric"]["origin"] for r in rate} == {"local", "remote"}
        # What the replication client saw: the rows Prometheus counted.
        assert sum(1 for line in peer.lines if line.startswith("RDATA events ")) >= MESSAGES
    finally:
        peer.close()
