"""Start real ``tributary`` processes for tests: generated config, free ports, clean stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent

# Federation settings for servers on one machine: reach loopback, accept self-signed certificates.
LOOPBACK_FEDERATION: dict[str, Any] = {"verify_certificates": False, "ip_range_whitelist": ["127.0.0.0/8"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.define
class TributaryProcess:
    """One ``tributary run`` child process and the ports it listens on."""

    config_path: Path
    data_dir: Path
    client_port: int
    metrics_port: int
    process: subprocess.Popen[str] | None = None
    output: str = ""
    federation_port: int | None = None

    @classmethod
    def configure_federating(cls, tmp_path: Path, *, database_url: str | None,
                             extra: dict[str, Any] | None = None) -> TributaryProcess:
        """A process that federates on loopback: server name ``localhost:PORT`` for a TLS
        federation listener on PORT (self-signed certificate), loopback whitelisted and
        certificates not verified, as two test servers on one machine need."""
        port = free_port()
        process = cls.configure(tmp_path, database_url=database_url, server_name=f"localhost:{port}",
                                extra={"federation": dict(LOOPBACK_FEDERATION), **(extra or {})})
        config = yaml.safe_load(process.config_path.read_text(encoding="utf-8"))
        config["listeners"].append({"type": "http", "port": port, "tls": True, "resources": ["federation", "keys"]})
        process.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        process.federation_port = port
        return process

    @property
    def server_name(self) -> str:
        config = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
        return str(config["server_name"])

    @classmethod
    def configure(cls, tmp_path: Path, *, database_url: str | None, server_name: str = "localhost",
                  extra: dict[str, Any] | None = None) -> TributaryProcess:
        data_dir = tmp_path / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        client_port, metrics_port = free_port(), free_port()
        config: dict[str, Any] = {
            "server_name": server_name,
            "data_dir": str(data_dir),
            "listeners": [
                {"type": "http", "port": client_port, "resources": ["client", "health"]},
                {"type": "metrics", "port": metrics_port},
            ],
            "log_level": "INFO",
            "enable_registration": True,
            # Tests register and log in many users from one address, fast.
            "rc_registration": {"per_second": 1000, "burst_count": 1000},
            "rc_message": {"per_second": 10000, "burst_count": 10000},
            "rc_login": {
                "address": {"per_second": 1000, "burst_count": 1000},
                "account": {"per_second": 1000, "burst_count": 1000},
                "failed_attempts": {"per_second": 1000, "burst_count": 1000},
            },
            "rc_joins": {"local": {"per_second": 1000, "burst_count": 1000},
                         "remote": {"per_second": 1000, "burst_count": 1000}},
            "rc_invites": {"per_room": {"per_second": 1000, "burst_count": 1000},
                           "per_user": {"per_second": 1000, "burst_count": 1000},
                           "per_issuer": {"per_second": 1000, "burst_count": 1000}},
            "bcrypt_rounds": 4,
        }
        if database_url is not None:
            config["database"] = {"url": database_url}
        config.update(extra or {})
        config_path = tmp_path / "homeserver.yaml"
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return cls(config_path, data_dir, client_port, metrics_port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, *, timeout: float = 30.0) -> float:
        """Start the process and wait until /health answers; return the seconds it took."""
        started = time.monotonic()
        # The log goes to a file, not a pipe: a chatty process must never block on a full pipe.
        with self.log_path.open("a", encoding="utf-8") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "homeserver.cli", "run", "--config", str(self.config_path)],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.output = self.log_path.read_text(encoding="utf-8", errors="replace")
                raise RuntimeError(f"tributary exited with {self.process.returncode} during start:\n{self.output}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"tributary did not become healthy within {timeout}s:\n{self.output}")

    def stop(self, sig: int = signal.SIGTERM, *, timeout: float = 30.0) -> int:
        """Signal the process, wait for it, keep its output; return its exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.output = self.log_path.read_text(encoding="utf-8", errors="replace")
        return int(self.process.returncode)

    @property
    def log_path(self) -> Path:
        """Everything the process wrote (every start appends to it)."""
        return self.config_path.parent / "tributary.log"

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.stop(signal.SIGKILL)

    def get(self, path: str, *, port: int | None = None) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{port or self.client_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "homeserver.cli", *args],
        cwd=cwd or REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
