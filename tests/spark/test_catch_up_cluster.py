"""The catch-up report under spark-submit on a real Spark standalone cluster (on loopback).

A master and one worker are started with the launch classes that ship inside
the pyspark package (``bin/spark-class``), and the report is submitted to them
with ``bin/spark-submit spark_jobs/catchup_report.py``, exactly as
docs/spark-reports.md tells an operator to. Every process started here is
stopped by its own process group.
"""

# tests for: spark_jobs/catchup_report.py, spark_jobs/catch_up/job.py

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg2
import pytest
from pyspark.sql import SparkSession

from bench.gen_federation_dataset import DatasetShape, generate_dataset
from storage.database import Database
from tests.twisted_plugin import run_sync

REPO = Path(__file__).resolve().parents[2]
NOW_MS = 1_800_000_000_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def _alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as response:
            return int(json.load(response).get("aliveworkers", 0))
    except OSError:
        return 0


@pytest.fixture
def standalone_master(tmp_path: Path, jdbc_jar: Path) -> Iterator[str]:
    """A Spark standalone master and one 1-core worker on 127.0.0.1; yields the master URL."""
    home = _spark_home()
    env = {**os.environ, "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1"}
    port, ui_port, worker_ui_port = _free_port(), _free_port(), _free_port()
    url = f"spark://127.0.0.1:{port}"
    spark_class = str(home / "bin" / "spark-class")
    logs = tmp_path / "cluster-logs"
    logs.mkdir()
    started: list[subprocess.Popen[bytes]] = []

    def launch(name: str, *args: str) -> None:
        with (logs / f"{name}.log").open("wb") as log:
            started.append(
                subprocess.Popen(
                    [spark_class, *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    try:
        launch("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
               "--webui-port", str(ui_port))
        _wait_for(lambda: _master_up(ui_port), "the Spark master")
        launch("worker", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1",
               "--memory", "1g", "--webui-port", str(worker_ui_port), "--work-dir", str(tmp_path / "work"), url)
        _wait_for(lambda: _alive_workers(ui_port) == 1, "the Spark worker to register")
        yield url
    finally:
        for proc in reversed(started):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _master_up(ui_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2):
            return True
    except OSError:
        return False


def test_report_runs_on_a_standalone_cluster(
    spark: SparkSession,
    standalone_master: str, database: Database, database_dsn: str, jdbc_jar: Path, tmp_path: Path
) -> None:
    """spark-submit to the master: the executors (on the worker) read PostgreSQL and
    write the Parquet tables; the pending PDUs per destination equal SQL's count."""
    run_sync(generate_dataset(database, DatasetShape(destinations=12, rooms=20, events=600, destination_rooms=80,
                                                     down_for_hours=0.25, now_ms=NOW_MS, seed=3)))
    out = tmp_path / "report"
    env = {
        **os.environ,
        "SPARK_HOME": str(_spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run(
        [
            str(_spark_home() / "bin" / "spark-submit"),
            "--master", standalone_master,
            "--jars", str(jdbc_jar),
            "--driver-class-path", str(jdbc_jar),
            "--driver-memory", "1g",
            "--executor-memory", "1g",
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.sql.shuffle.partitions=2",
            # A few hundred rows: interpreted plans and no adaptive re-planning are quicker.
            "--conf", "spark.sql.adaptive.enabled=false",
            "--conf", "spark.sql.codegen.wholeStage=false",
            str(REPO / "spark_jobs" / "catchup_report.py"),
            "--jdbc-url", database_dsn,
            "--out", str(out),
            "--now", str(NOW_MS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"master {standalone_master}" in result.stderr
    assert (out / "report.html").stat().st_size > 0

    conn = psycopg2.connect(database_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(
                """
                SELECT dr.destination, COUNT(*) FROM destination_rooms dr
                JOIN destinations d ON d.destination = dr.destination
                JOIN events e ON e.room_id = dr.room_id AND e.is_local AND NOT e.outlier
                 AND e.stream_ordering > COALESCE(d.last_successful_stream_ordering, 0)
                 AND e.stream_ordering <= dr.stream_ordering
                GROUP BY dr.destination
                """
            )
            expected = dict(cur.fetchall())
    finally:
        conn.close()
    assert expected, "the dataset has no backlog"
    written = spark.read.parquet(str(out / "destinations.parquet")).where("pending_pdus > 0").collect()
    assert {r["destination"]: r["pending_pdus"] for r in written} == expected
