"""Run a real Synapse for the interop check: generated config, self-signed TLS, clean stop.

This module owns Synapse's configuration for a loopback federation test and its
process lifetime. It knows nothing about Matrix scenarios (``run_interop.py``)
and never imports Synapse: Synapse runs in its own virtual environment, driven
through its command line.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.harness import free_port

# Generous limits: the check registers, joins and sends from one address, fast.
_RATE_UNLIMITED: dict[str, Any] = {"per_second": 1000, "burst_count": 1000}

# The options the interop check sets on top of Synapse's generated config. Kept in one
# place so the docs (docs/federation.md, "Testing against another homeserver") can list them.
LOOPBACK_OPTIONS: dict[str, Any] = {
    "report_stats": False,
    "enable_registration": True,
    "enable_registration_without_verification": True,
    # Our peer is a Tributary on 127.0.0.1 with a self-signed certificate.
    "federation_verify_certificates": False,
    "ip_range_blacklist": [],
    "ip_range_whitelist": ["127.0.0.0/8", "::1/128"],
    # Ask each server for its own keys; no matrix.org notary.
    "trusted_key_servers": [],
    "suppress_key_server_warning": True,
    # The room directory both ways: anyone may publish, and other servers may read the list.
    "allow_public_rooms_over_federation": True,
    "room_list_publication_rules": [{"action": "allow"}],
    "rc_message": _RATE_UNLIMITED,
    "rc_registration": _RATE_UNLIMITED,
    "rc_login": {"address": _RATE_UNLIMITED, "account": _RATE_UNLIMITED, "failed_attempts": _RATE_UNLIMITED},
    "rc_joins": {"local": _RATE_UNLIMITED, "remote": _RATE_UNLIMITED},
    "rc_joins_per_room": _RATE_UNLIMITED,
    "rc_invites": {"per_room": _RATE_UNLIMITED, "per_user": _RATE_UNLIMITED, "per_issuer": _RATE_UNLIMITED},
    "rc_room_creation": _RATE_UNLIMITED,
    # Quicker retries when a first attempt to reach the peer fails.
    "federation": {"destination_min_retry_interval": "1s", "destination_max_retry_interval": "5s"},
}


def write_self_signed_certificate(host: str, cert_path: Path, key_path: Path) -> None:
    """A one-year self-signed certificate for ``host`` (and 127.0.0.1), PEM, key unencrypted."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )


@attrs.define
class SynapseProcess:
    """One ``synapse.app.homeserver`` child process: server name ``localhost:FPORT`` for its
    TLS federation listener on FPORT, a plain client listener on ``client_port``, SQLite."""

    python: Path
    directory: Path
    federation_port: int
    client_port: int
    process: subprocess.Popen[str] | None = None

    @property
    def server_name(self) -> str:
        return f"localhost:{self.federation_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def config_path(self) -> Path:
        return self.directory / "homeserver.yaml"

    @property
    def log_path(self) -> Path:
        """Synapse's own log (its generated log config writes ``homeserver.log`` in its data dir)."""
        return self.directory / "homeserver.log"

    @property
    def console_path(self) -> Path:
        """Whatever the process wrote to stdout/stderr (start-up errors land here)."""
        return self.directory / "console.log"

    def version(self) -> str:
        result = subprocess.run(
            [str(self.python), "-c", "import importlib.metadata as m; print(m.version('matrix-synapse'))"],
            capture_output=True, text=True, check=True, timeout=120,
        )
        return result.stdout.strip()

    @classmethod
    def configure(cls, python: Path, directory: Path, *, extra: dict[str, Any] | None = None) -> SynapseProcess:
        """Generate Synapse's config in ``directory``, then set the loopback options on it (and
        ``extra``, top-level options a caller such as a bench sets on top)."""
        directory.mkdir(parents=True, exist_ok=True)
        process = cls(python, directory, free_port(), free_port())
        subprocess.run(
            [str(python), "-m", "synapse.app.homeserver", "--server-name", process.server_name,
             "--config-path", str(process.config_path), "--data-directory", str(directory),
             "--generate-config", "--report-stats=no"],
            cwd=directory, capture_output=True, text=True, check=True, timeout=300,
        )
        cert_path, key_path = directory / "tls.crt", directory / "tls.key"
        write_self_signed_certificate("localhost", cert_path, key_path)
        config = yaml.safe_load(process.config_path.read_text(encoding="utf-8"))
        config.update(LOOPBACK_OPTIONS)
        config.update(extra or {})
        config["listeners"] = [
            {"port": process.federation_port, "tls": True, "type": "http", "bind_addresses": ["127.0.0.1"],
             "x_forwarded": False, "resources": [{"names": ["federation"], "compress": False}]},
            {"port": process.client_port, "tls": False, "type": "http", "bind_addresses": ["127.0.0.1"],
             "x_forwarded": False, "resources": [{"names": ["client"], "compress": False}]},
        ]
        config["tls_certificate_path"] = str(cert_path)
        config["tls_private_key_path"] = str(key_path)
        config["database"] = {"name": "sqlite3", "args": {"database": str(directory / "homeserver.db")}}
        config["pid_file"] = str(directory / "homeserver.pid")
        process.config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        process._log_to_file()
        return process

    def _log_to_file(self) -> None:
        """Point the generated log config at ``log_path`` at INFO (it already writes a file; make sure)."""
        config = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
        log_config_path = Path(config["log_config"])
        log_config = yaml.safe_load(log_config_path.read_text(encoding="utf-8"))
        log_config["handlers"]["file"]["filename"] = str(self.log_path)
        log_config["root"]["handlers"] = ["file"]
        log_config["root"]["level"] = "INFO"
        log_config_path.write_text(yaml.safe_dump(log_config, sort_keys=False), encoding="utf-8")

    def background_updates_done(self) -> bool:
        """Whether Synapse has run its database's start-up background updates (about a minute of
        index building after a first start, which loads the machine meanwhile): its log says so."""
        return self.log_path.exists() and "No more background updates to do" in self.log_path.read_text(
            encoding="utf-8", errors="replace")

    def start(self, *, timeout: float = 180.0) -> float:
        """Start Synapse and wait until its client API answers; return the seconds it took."""
        started = time.monotonic()
        with self.console_path.open("a", encoding="utf-8") as console:
            self.process = subprocess.Popen(
                [str(self.python), "-m", "synapse.app.homeserver", "--config-path", str(self.config_path)],
                cwd=self.directory, stdout=console, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"synapse exited with {self.process.returncode} during start; see {self.console_path} "
                    f"and {self.log_path}:\n{self.console_path.read_text(encoding='utf-8', errors='replace')[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/_matrix/client/versions", timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"synapse did not answer within {timeout}s; see {self.console_path} and {self.log_path}")

    def stop(self, *, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait, SIGKILL if it lingers; return the exit code (None if never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return int(self.process.returncode)
