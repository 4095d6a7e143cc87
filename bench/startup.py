"""Start-up figures: first-ever start (initdb included), cold start on existing
data, and the process's RSS once it answers. Run by hand:

    .venv/bin/python bench/startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def start_and_measure(data_dir: Path, port: int) -> tuple[float, int]:
    config = data_dir / "homeserver.yaml"
    if not config.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        config.write_text(
            f"server_name: localhost\ndata_dir: .\nlisteners:\n  - type: http\n    port: {port}\n"
        )
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "homeserver.cli", "run", "--config", str(config)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/_matrix/client/versions"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"tributary exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            break
        except OSError:
            time.sleep(0.005)
    elapsed = time.monotonic() - started
    rss_kib = int(Path(f"/proc/{proc.pid}/status").read_text().split("VmRSS:")[1].split()[0])
    proc.send_signal(signal.SIGTERM)
    if proc.wait(30) != 0:
        raise SystemExit(f"tributary exited with {proc.returncode} on SIGTERM")
    return elapsed, rss_kib * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--port", type=int, default=18008)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tributary-bench-", dir="/tmp"))
    base.chmod(0o755)
    try:
        first, rss_first = start_and_measure(base / "data", args.port)
        cold, rss = [], []
        for _ in range(args.runs):
            t, r = start_and_measure(base / "data", args.port)
            cold.append(t)
            rss.append(r)
        print(f"first-ever start (initdb, migrations, key) to first /versions: {first:.2f} s")
        print(f"cold start on existing data to first /versions: median {statistics.median(cold):.2f} s "
              f"(min {min(cold):.2f}, max {max(cold):.2f}, {args.runs} runs)")
        print(f"RSS after start: {statistics.median(rss) / 2**20:.1f} MiB (first start {rss_first / 2**20:.1f} MiB)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
