"""Start real ``tributary`` processes for tests: generated config, free ports, clean stop."""

from __future__ import annotations

import atexit
import os
import shutil
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


# Every child process started here, so none outlives the test run: a test that fails (or times
# out) before its own clean-up would otherwise leave a server running and holding its ports.
_CHILDREN: set[subprocess.Popen[str]] = set()


@atexit.register
def _kill_children() -> None:
    for child in list(_CHILDREN):
        if child.poll() is None:
            child.kill()
            child.wait()


# Ports handed out by free_port in this test process. A test takes all its ports before any
# process binds them, and the kernel may give a just-released port to the next bind(0): without
# this set two listeners of one test could be handed the same port (and a probe of the second
# would be answered by the first).
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never the same one twice in this test process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


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
    # A worker of the config's layout (``tributary worker --name``) instead of the main process;
    # ``client_port`` is then the worker's listener that serves /health.
    worker_name: str | None = None

    def worker(self, name: str, health_port: int) -> TributaryProcess:
        """The worker ``name`` of this process's config, whose /health is on ``health_port``."""
        return TributaryProcess(self.config_path, self.data_dir, health_port, 0, worker_name=name)

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
            command = ["worker", "--name", self.worker_name] if self.worker_name else ["run"]
            self.process = subprocess.Popen(
                [sys.executable, "-m", "homeserver.cli", *command, "--config", str(self.config_path)],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        _CHILDREN.add(self.process)
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
        _CHILDREN.discard(self.process)
        self.output = self.log_path.read_text(encoding="utf-8", errors="replace")
        return int(self.process.returncode)

    @property
    def log_path(self) -> Path:
        """Everything the process wrote (every start appends to it)."""
        name = f"tributary-{self.worker_name}.log" if self.worker_name else "tributary.log"
        return self.config_path.parent / name

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


def configure_workers(
    tmp_path: Path, database_url: str, redis_url: str, *, persisters: int = 2, senders: int = 1,
    extra: dict[str, Any] | None = None, stream_writers: dict[str, list[str]] | None = None,
    background: bool = False,
) -> tuple[TributaryProcess, dict[str, TributaryProcess], int]:
    """A worker layout on loopback (docs/workers.md): the main process (federating, with a
    replication listener), ``persisters`` event persisters ``p1``..., a generic worker ``g1``
    with a client listener, ``senders`` federation senders ``fs1``..., and (``background``) a
    background worker ``bg1``, over Redis.
    Returns the main process, the workers by name (not started) and g1's client port."""
    main = TributaryProcess.configure_federating(tmp_path, database_url=database_url, extra=extra)
    config = yaml.safe_load(main.config_path.read_text(encoding="utf-8"))
    persister_names = [f"p{i}" for i in range(1, persisters + 1)]
    sender_names = [f"fs{i}" for i in range(1, senders + 1)]
    names = [*persister_names, "g1", *sender_names, *(["bg1"] if background else [])]
    internal = {name: free_port() for name in ("master", *names)}
    generic_client = free_port()
    config["listeners"].append({"type": "http", "port": internal["master"], "resources": ["replication"]})
    config.update({
        "redis": {"enabled": True, "url": redis_url},
        "worker_replication_secret": "a shared secret",
        "instance_map": {name: {"host": "127.0.0.1", "port": port} for name, port in internal.items()},
        "stream_writers": {"events": persister_names or ["master"], **(stream_writers or {})},
    })
    if sender_names:
        config.update({"send_federation": False, "federation_sender_instances": sender_names})

    def listeners(name: str, *more: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"type": "http", "port": internal[name], "resources": ["replication", "health"]}, *more]

    workers: dict[str, Any] = {name: {"app": "event_persister", "listeners": listeners(name)} for name in persister_names}
    workers["g1"] = {"app": "generic", "listeners": listeners(
        "g1", {"type": "http", "port": generic_client, "resources": ["client", "health"]},
        {"type": "metrics", "port": free_port()})}
    workers.update({name: {"app": "federation_sender", "listeners": listeners(name)} for name in sender_names})
    if background:
        workers["bg1"] = {"app": "background", "listeners": listeners("bg1")}
    config["workers"] = workers
    main.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return main, {name: main.worker(name, internal[name]) for name in names}, generic_client


@attrs.define
class Nginx:
    """A real nginx (Debian's) running ``docker/nginx.conf`` with its upstreams pointed at
    local processes: the routing operators deploy, tested as it is."""

    directory: Path
    port: int
    process: subprocess.Popen[str] | None = None

    @classmethod
    def for_workers(cls, directory: Path, *, main_port: int, generic_port: int,
                    media_port: int | None = None) -> Nginx:
        """``media_port``: the media_repository worker's client listener (the main process's when None)."""
        directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        text = (REPO_ROOT / "docker" / "nginx.conf").read_text(encoding="utf-8")
        replacements = {
            "server main:8008;": f"server 127.0.0.1:{main_port};",
            "server generic1:8008;": f"server 127.0.0.1:{generic_port};",
            "server media1:8008;": f"server 127.0.0.1:{media_port or main_port};",
            "listen 8080;": f"listen 127.0.0.1:{port};",
            "pid /tmp/nginx.pid;": f"pid {directory}/nginx.pid;",
            "access_log /dev/stdout;": f"access_log {directory}/access.log;",
            "error_log /dev/stderr warn;": f"error_log {directory}/error.log warn;",
        }
        for old, new in replacements.items():
            if old not in text:
                raise AssertionError(f"docker/nginx.conf no longer has {old!r}: update tests/harness.py")
            text = text.replace(old, new)
        (directory / "nginx.conf").write_text(text, encoding="utf-8")
        return cls(directory, port)

    def start(self, timeout: float = 10.0) -> None:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(binary).exists():
            raise RuntimeError("nginx is not installed; `make test` installs it (.ci/install-observability.sh)")
        self.process = subprocess.Popen(
            [binary, "-p", str(self.directory), "-c", str(self.directory / "nginx.conf"),
             "-e", str(self.directory / "error.log"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True,
        )
        _CHILDREN.add(self.process)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.directory / 'error.log').read_text(errors='replace')}")
            # nginx writes its pid file once its listening sockets are open: a port that answers
            # before then belongs to some other process.
            with socket.socket() as probe:
                if (self.directory / "nginx.pid").exists() and probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("nginx did not start listening")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        if self.process is not None:
            _CHILDREN.discard(self.process)


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "homeserver.cli", *args],
        cwd=cwd or REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
