"""Spark fixtures: one local[2] session for the whole test session, with the PostgreSQL JDBC jar.

Nothing here skips: without pyspark, Java or the JDBC jar the tests fail and
say how to get them (``.ci/install-spark.sh`` and ``pip install -e '.[spark]'``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

JDBC_JAR = Path(os.environ.get("TRIBUTARY_JDBC_JAR", "/usr/share/java/postgresql.jar"))


def _require_spark_prerequisites() -> None:
    problems = []
    try:
        import pyspark  # noqa: F401
    except ImportError:
        problems.append("pyspark is not installed (pip install -e '.[spark]')")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        problems.append("no Java runtime (run .ci/install-spark.sh)")
    if not JDBC_JAR.is_file():
        problems.append(f"no PostgreSQL JDBC jar at {JDBC_JAR} (run .ci/install-spark.sh)")
    if problems:
        pytest.fail("Spark tests cannot run: " + "; ".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def jdbc_jar() -> Path:
    _require_spark_prerequisites()
    return JDBC_JAR


@pytest.fixture(scope="session")
def spark(jdbc_jar: Path) -> Iterator[object]:
    """A local[2] SparkSession (typed loosely so this module imports without pyspark)."""
    from spark_jobs.catch_up.job import build_session

    session = build_session(
        master="local[2]",
        jdbc_jar=jdbc_jar,
        driver_memory="1g",
        # A few thousand rows: interpreted plans and no adaptive re-planning are quicker
        # than compiling and re-planning every stage (about half the time on this machine).
        extra_conf={
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.sql.adaptive.enabled": "false",
            "spark.sql.codegen.wholeStage": "false",
        },
    )
    try:
        yield session
    finally:
        session.stop()
