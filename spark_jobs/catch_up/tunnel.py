"""A loopback TCP port in front of a PostgreSQL Unix socket, for the embedded database.

The embedded database listens only on a Unix socket, and the PostgreSQL JDBC
driver speaks TCP (its Unix-socket support needs a native library we do not
ship). While the report runs, ``LoopbackTunnel`` listens on an ephemeral port
of 127.0.0.1 and relays each connection to the socket. The embedded database
trusts whoever reaches its socket, whose folder only its owner may enter, so
the tunnel must not widen that: it accepts a connection only from a process
of the same user as this one (checked in /proc/net/tcp, Linux only; refused
when it cannot tell), and it closes with the report.
"""

# tests: tests/spark/test_catch_up_report.py

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_BUFFER = 65536


class TunnelError(Exception):
    """The tunnel could not be opened."""


def _proc_tcp_address(host: str, port: int, *, v6: bool) -> str:
    """``host:port`` as /proc/net/tcp (or tcp6, IPv4-mapped) writes it: 32-bit words in host order, hex."""
    packed = socket.inet_pton(socket.AF_INET6, f"::ffff:{host}") if v6 else socket.inet_aton(host)
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The user owning the client end of a loopback TCP connection, or None when unknown.

    The client's socket may be IPv4 or dual-stack IPv6 (Java's default), so both
    tables are searched for its (local, remote) address pair.
    """
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        wanted = (_proc_tcp_address(*peer, v6=v6), _proc_tcp_address(*local, v6=v6))
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and (fields[1], fields[2]) == wanted:
                return int(fields[7])
    return None


class LoopbackTunnel:
    """Relays 127.0.0.1:``port`` to the Unix socket at ``socket_path`` until closed."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.port = 0

    def start(self) -> int:
        """Start listening; return the port."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.socket_path))
        except OSError as e:
            raise TunnelError(f"cannot connect to the database socket {self.socket_path}: {e.strerror or e}") from e
        finally:
            probe.close()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="tunnel-accept", daemon=True).start()
        return self.port

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            for conn in list(self._connections):
                try:
                    conn.close()
                except OSError:
                    pass
            self._connections.clear()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, peer = self._listener.accept()
            except OSError:
                return
            uid = peer_uid(peer, ("127.0.0.1", self.port))
            if uid != os.getuid():
                logger.warning("tunnel: refused a connection from %s:%s (user %s)", peer[0], peer[1], uid)
                client.close()
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(str(self.socket_path))
            except OSError as e:
                logger.warning("tunnel: cannot reach %s: %s", self.socket_path, e)
                client.close()
                upstream.close()
                continue
            with self._lock:
                self._connections.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), name="tunnel-pump", daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(_BUFFER)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                for s in (source, sink):
                    if s in self._connections:
                        self._connections.discard(s)
                        s.close()
