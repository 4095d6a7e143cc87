"""The catch-up report job: connect, read over JDBC, run the transforms, write the outputs; and its CLI.

    python -m spark_jobs.catch_up --config homeserver.yaml --out reports/
    python -m spark_jobs.catch_up --jdbc-url postgresql://user@host/db --out reports/ --master local[2]
    spark-submit --master spark://HOST:7077 ... spark_jobs/catchup_report.py --jdbc-url ... --out ...

This is the thin side of the job: where the connection settings come from
(``homeserver.config`` or ``--jdbc-url``; a Unix-socket database, such as the
embedded one, is reached through ``tunnel.LoopbackTunnel``), how Spark is
started, which reads are pushed down to PostgreSQL (``schemas``), and where
the results go. What the numbers mean is decided in ``transforms``; how they
are shown, in ``report``. Failures the user can fix (bad connection settings,
no JDBC jar, no Java, an empty or unmigrated database) end with one line
saying what is wrong, never a Java stack trace.
"""

# tests: tests/spark/test_catch_up_report.py

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Final, NoReturn
from urllib.parse import parse_qs, unquote, urlsplit

import attrs
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs.catch_up import report as report_files
from spark_jobs.catch_up import schemas, transforms
from spark_jobs.catch_up.tunnel import LoopbackTunnel, TunnelError

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2

DEFAULT_JDBC_JAR: Final = "/usr/share/java/postgresql.jar"
JDBC_DRIVER_CLASS: Final = "org.postgresql.Driver"
DEFAULT_THRESHOLD: Final = "1h"
#: Pending (destination, room) pairs up to this many are broadcast to every replay task.
BROADCAST_PAIRS_LIMIT: Final = 200_000
#: Destinations whose backlog is charted over time.
CHARTED_DESTINATIONS: Final = 8
#: Rows per round trip when Spark reads from PostgreSQL.
FETCH_SIZE: Final = 10_000


class ReportError(Exception):
    """Something the user can fix stopped the report; the message says what."""


# --- where the data comes from -----------------------------------------------------------


@attrs.frozen
class JdbcSource:
    """A PostgreSQL database as Spark's JDBC reader sees it."""

    url: str
    user: str | None
    password: str | None = attrs.field(repr=False)
    #: For messages: where the data is, without credentials.
    description: str

    def reader_options(self) -> dict[str, str]:
        options = {"url": self.url, "driver": JDBC_DRIVER_CLASS, "fetchsize": str(FETCH_SIZE)}
        if self.user:
            options["user"] = self.user
        if self.password:
            options["password"] = self.password
        return options


def jdbc_source_from_url(url: str, stack: ExitStack) -> JdbcSource:
    """A source from a ``jdbc:postgresql:`` or ``postgresql://`` URL.

    A ``postgresql://`` URL whose host is a folder (``?host=/run/postgresql``) names a
    Unix socket: a loopback tunnel to it is opened and closed with ``stack``.
    """
    if url.startswith("jdbc:postgresql:"):
        return JdbcSource(url, None, None, url.split("?", 1)[0])
    if not url.startswith(("postgresql://", "postgres://")):
        raise ReportError(f"--jdbc-url: expected a jdbc:postgresql: or postgresql:// URL, got {url[:80]!r}")
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    try:
        port = parts.port or int(query.get("port", "5432"))
    except ValueError:
        raise ReportError(f"database URL: bad port in {parts.netloc or parts.query!r}") from None
    user = unquote(parts.username) if parts.username else query.get("user")
    password = unquote(parts.password) if parts.password else query.get("password")
    database = unquote(parts.path.lstrip("/")) or query.get("dbname") or user or "postgres"
    host = parts.hostname or query.get("host", "")
    if host.startswith("/") or not host:
        socket_path = Path(host or "/var/run/postgresql") / f".s.PGSQL.{port}"
        tunnel = LoopbackTunnel(socket_path)
        try:
            local_port = tunnel.start()
        except TunnelError as e:
            raise ReportError(str(e)) from e
        stack.callback(tunnel.close)
        return JdbcSource(
            f"jdbc:postgresql://127.0.0.1:{local_port}/{database}",
            user,
            password,
            f"database {database!r} on socket {socket_path} (through a loopback tunnel)",
        )
    netloc = f"[{host}]" if ":" in host else host
    return JdbcSource(
        f"jdbc:postgresql://{netloc}:{port}/{database}", user, password, f"database {database!r} on {netloc}:{port}"
    )


def jdbc_source_from_config(config_path: Path, stack: ExitStack, say: Progress) -> JdbcSource:
    """The homeserver's database: ``database.url``, or the embedded database in ``data_dir``.

    The embedded database is used where it runs (the homeserver's); when the
    homeserver is stopped it is started for the report and stopped afterwards
    (its lock keeps a homeserver from starting on it meanwhile).
    """
    from homeserver.config import load_config

    config = load_config(config_path)
    if config.database.url is not None:
        return jdbc_source_from_url(config.database.url, stack)

    from storage.embedded import PORT, EmbeddedPostgres, EmbeddedPostgresError, find_binaries

    try:
        embedded = EmbeddedPostgres(config.data_dir, find_binaries(config.database.embedded.binaries))
    except EmbeddedPostgresError as e:
        raise ReportError(str(e)) from e
    socket_dir = parse_qs(urlsplit(embedded.dsn).query)["host"][0]
    if not _accepts_connections(Path(socket_dir) / f".s.PGSQL.{PORT}"):
        if not (embedded.cluster_dir / "PG_VERSION").exists():
            raise ReportError(
                f"{config_path} uses the embedded database, but {embedded.cluster_dir} holds none: "
                "has this homeserver run yet? (or set database.url)"
            )
        say.note(f"the embedded database in {embedded.cluster_dir} is not running: starting it for the report")
        try:
            embedded.start()
        except EmbeddedPostgresError as e:
            raise ReportError(f"cannot start the embedded database: {e}") from e
        stack.callback(embedded.stop)
    source = jdbc_source_from_url(embedded.dsn, stack)
    return attrs.evolve(source, description=f"the embedded database of {config_path} ({source.description})")


def _accepts_connections(socket_path: Path) -> bool:
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(socket_path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


# --- progress -----------------------------------------------------------------------------


class Progress:
    """Console progress: one line per stage with what it read and how long it took."""

    def __init__(self, stream: IO[str] | None = None, prefix: str = "catch-up report") -> None:
        self._stream = stream
        self._prefix = prefix
        self.timings: dict[str, float] = {}

    def note(self, message: str) -> None:
        if self._stream is not None:
            print(f"{self._prefix}: {message}", file=self._stream, flush=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[dict[str, str]]:
        """Time a stage; the caller may put a ``result`` text in the yielded dict."""
        self.note(f"[{len(self.timings) + 1}] {name} ...")
        started = time.monotonic()
        outcome: dict[str, str] = {}
        yield outcome
        elapsed = self.timings[name] = time.monotonic() - started
        self.note(f"[{len(self.timings)}] {name}: {outcome.get('result', 'done')} ({elapsed:.1f}s)")


# --- Spark --------------------------------------------------------------------------------


_LOG4J2_PROPERTIES: Final = """\
# Errors only. org.apache.spark is named so that pyspark sees its level as configured
# (otherwise it sets WARN for itself and announces it on the console).
rootLogger.level = error
rootLogger.appenderRef.console.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
appender.console.layout.alwaysWriteExceptions = false
logger.spark.name = org.apache.spark
logger.spark.level = error
"""


def _is_loopback_master(master: str) -> bool:
    return master.startswith("local") or any(
        master.startswith(f"spark://{h}") for h in ("127.", "localhost", "[::1]")
    )


def build_session(
    *,
    master: str | None,
    jdbc_jar: Path,
    driver_memory: str = "2g",
    extra_conf: Mapping[str, str] | None = None,
    app_name: str = "tributary-catch-up-report",
) -> SparkSession:
    """Start (or join, under spark-submit) the Spark session, with the JDBC jar on its classpath.

    ``master`` None keeps spark-submit's master, or uses ``local[*]`` when run
    directly. The driver binds to loopback for local masters (set before the JVM
    starts, as is the driver's memory).
    """
    under_spark_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    if not under_spark_submit:
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            raise ReportError("cannot start Spark: no Java runtime (install default-jre-headless; .ci/install-spark.sh does)")
        master = master or "local[*]"
        if _is_loopback_master(master):
            os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    log_config: Path | None = None
    if not under_spark_submit:
        # Our progress lines are the console output: Spark's own INFO/WARN chatter
        # at start-up (and stack traces of errors we explain) stay out of it.
        handle, name = tempfile.mkstemp(prefix="tributary-log4j2-", suffix=".properties")
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(_LOG4J2_PROPERTIES)
        log_config = Path(name)
        builder = builder.config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={log_config.as_uri()}")
    conf = {
        "spark.driver.memory": driver_memory,
        "spark.jars": str(jdbc_jar),
        "spark.driver.extraClassPath": str(jdbc_jar),
        "spark.sql.shuffle.partitions": "16",
        "spark.sql.adaptive.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        **(extra_conf or {}),
    }
    for key, value in conf.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as e:  # the launcher's own errors (no Java, a bad master) are plain Python ones
        raise ReportError(f"cannot start Spark{f' on {master}' if master else ''}: {_first_line(e)}") from e
    finally:
        if log_config is not None:
            log_config.unlink(missing_ok=True)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def check_jdbc_driver(spark: SparkSession, jdbc_jar: Path) -> None:
    """Fail clearly when the PostgreSQL JDBC driver is not on Spark's classpath."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        jvm.org.apache.spark.util.Utils.classForName(JDBC_DRIVER_CLASS, True, False)
    except Exception as e:
        raise ReportError(
            f"the PostgreSQL JDBC driver ({JDBC_DRIVER_CLASS}) is not on Spark's classpath; "
            f"pass --jdbc-jar (tried {jdbc_jar}), or under spark-submit --jars JAR --driver-class-path JAR"
        ) from e


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _java_root_cause(error: BaseException) -> tuple[str, str] | None:
    """(class name, message) of the innermost Java exception behind a PySpark error."""
    java = getattr(error, "java_exception", None) or getattr(error, "_origin", None)
    if java is None:
        return None
    try:
        while java.getCause() is not None and java.getCause() != java:
            java = java.getCause()
        return str(java.getClass().getName()), str(java.getMessage() or "").strip()
    except Exception:  # the gateway is gone: nothing more to learn
        return None


_CONNECTION_ERRORS: Final = (
    "org.postgresql.util.PSQLException",
    "java.net.ConnectException",
    "java.net.SocketException",
    "java.net.UnknownHostException",
    "java.net.SocketTimeoutException",
    "java.io.EOFException",
)


def explain_spark_error(error: BaseException, source: JdbcSource) -> str:
    """One line for a failure inside Spark, naming the database where it is about the database."""
    root = _java_root_cause(error)
    if root is None:
        return _first_line(error)
    name, message = root
    first = message.splitlines()[0] if message else name
    if name in _CONNECTION_ERRORS:
        return f"cannot read {source.description}: {first}"
    if name == "java.lang.ClassNotFoundException" and "postgresql" in message.lower():
        return f"the PostgreSQL JDBC driver is not on Spark's classpath ({first}); pass --jdbc-jar"
    return f"{name.rsplit('.', 1)[-1]}: {first}"


@contextmanager
def _spark_errors(source: JdbcSource) -> Iterator[None]:
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]
    from pyspark.errors import PySparkException

    try:
        yield
    except (Py4JError, PySparkException) as e:
        raise ReportError(explain_spark_error(e, source)) from e


# --- reading --------------------------------------------------------------------------------


def read_query(spark: SparkSession, source: JdbcSource, query: str) -> DataFrame:
    """A pushed-down query: PostgreSQL runs it, Spark reads its (small) result."""
    return spark.read.format("jdbc").options(**source.reader_options()).option("query", query).load()


def read_table(
    spark: SparkSession,
    source: JdbcSource,
    table: str,
    *,
    partition_column: str | None = None,
    lower: int = 0,
    upper: int = 0,
    partitions: int = 1,
) -> DataFrame:
    """A table or ``(subquery) AS name``, split into ``partitions`` ranges of ``partition_column``."""
    reader = spark.read.format("jdbc").options(**source.reader_options()).option("dbtable", table)
    partitions = max(1, min(partitions, upper - lower))
    if partition_column is not None and partitions > 1:
        reader = (
            reader.option("partitionColumn", partition_column)
            .option("lowerBound", str(lower))
            .option("upperBound", str(upper))
            .option("numPartitions", str(partitions))
        )
    return reader.load()


# --- the report -------------------------------------------------------------------------------


@attrs.frozen
class ReportSettings:
    out_dir: Path
    now_ms: int
    catch_up_threshold_ms: int = 3_600_000
    partitions: int = 8
    top: int = 20
    #: Width of the backlog-over-time buckets; None picks one from the backlog's age.
    bucket_ms: int | None = None
    broadcast_pairs_limit: int = BROADCAST_PAIRS_LIMIT


@attrs.frozen
class ReportOutcome:
    files: Mapping[str, Path]
    totals: report_files.Totals
    replayed_events: int
    pending_pairs: int


def run_report(spark: SparkSession, source: JdbcSource, settings: ReportSettings, say: Progress) -> ReportOutcome:
    """Read, replay, aggregate and write the whole report into ``settings.out_dir``."""
    with _spark_errors(source):
        return _run_report(spark, source, settings, say)


def _run_report(spark: SparkSession, source: JdbcSource, settings: ReportSettings, say: Progress) -> ReportOutcome:
    out = settings.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)

    with say.stage("checking the database") as stage:
        missing = read_query(spark, source, schemas.MISSING_TABLES_QUERY).first()
        if missing is not None and missing["missing"]:
            raise ReportError(
                f"{source.description} is not a migrated Tributary database (missing tables: "
                f"{missing['missing'].replace(',', ', ')}); run `tributary migrate` or check the URL"
            )
        has_catch_up_from = bool(missing is not None and missing["has_catch_up_from"])
        overview = read_query(spark, source, schemas.OVERVIEW_QUERY).first()
        assert overview is not None
        if not overview["destinations"] or not overview["has_events"]:
            raise ReportError(
                f"{source.description} is empty ({overview['destinations']} destinations, "
                f"{'some' if overview['has_events'] else 'no'} events): nothing to report"
            )
        server_name = str(overview["server_name"] or "(unknown server)")
        stage["result"] = (
            f"server {server_name}, {overview['destinations']:,} destinations, "
            f"{overview['destination_rooms']:,} destination_rooms rows"
        )

    # Read lazily: what Spark reads is materialised (and cached) by the first action that needs it.
    destination_stats = read_query(spark, source, schemas.DESTINATION_STATS_QUERY).cache()
    extremities = read_query(spark, source, schemas.LOCAL_EXTREMITIES_QUERY).cache()

    with say.stage("finding pending rooms (aggregated in PostgreSQL)") as stage:
        bounds = read_query(spark, source, schemas.pending_bounds_query(has_catch_up_from)).first()
        assert bounds is not None
        pairs = int(bounds["pairs"])
        after = int(bounds["min_acked"] or 0)
        upto = int(bounds["max_stream_ordering"] or 0)
        pending_rooms = read_table(
            spark, source, schemas.pending_rooms_table(has_catch_up_from),
            partition_column="stream_ordering", lower=after + 1, upper=upto + 1,
            partitions=min(settings.partitions, max(1, pairs // 50_000)),
        ).cache()
        stage["result"] = f"{pairs:,} (destination, room) pairs, their events in ({after:,}, {upto:,}]"

    with say.stage("replaying the events stream") as stage:
        event_bounds = read_query(spark, source, schemas.events_range_bounds_query(after, upto)).first()
        assert event_bounds is not None
        event_count = int(event_bounds["events"])
        lo, hi = int(event_bounds["lo"] or 0), int(event_bounds["hi"] or 0)
        events = read_table(
            spark, source, schemas.events_range_table(after, upto),
            partition_column="stream_ordering", lower=lo, upper=hi + 1,
            partitions=settings.partitions if event_count > 100_000 else 1,
        )
        pending = transforms.pending_events(
            events, pending_rooms, broadcast_rooms=pairs <= settings.broadcast_pairs_limit
        ).persist(StorageLevel.MEMORY_AND_DISK)
        pending_count = pending.count()
        stage["result"] = (
            f"{event_count:,} local events read in stream order ({lo:,}..{hi:,}), "
            f"{pending_count:,} (destination, pending PDU) pairs"
        )

    with say.stage("computing per-destination catch-up") as stage:
        backlog = transforms.destination_backlog(pending)
        cost = transforms.catch_up_cost(pending_rooms, extremities)
        destinations = transforms.destinations_report(
            destination_stats, backlog, cost,
            now_ms=settings.now_ms, catch_up_threshold_ms=settings.catch_up_threshold_ms,
        ).cache()
        destinations.write.mode("overwrite").parquet(_file_uri(out / "destinations.parquet"))
        rows = [r.asDict() for r in destinations.collect()]
        stage["result"] = f"{len(rows):,} destinations, {sum(1 for r in rows if r['pending_rooms']):,} with pending rooms"

    with say.stage("computing backlog over time") as stage:
        oldest = min((r["oldest_pending_ts"] for r in rows if r["oldest_pending_ts"] is not None), default=None)
        span = settings.now_ms - oldest if oldest is not None else 0
        bucket_ms = settings.bucket_ms or transforms.choose_bucket_ms(span)
        origin_ms = (oldest // bucket_ms) * bucket_ms if oldest is not None else settings.now_ms
        over_time = transforms.backlog_over_time(pending, origin_ms=origin_ms, bucket_ms=bucket_ms)
        over_time.write.mode("overwrite").parquet(_file_uri(out / "backlog_over_time.parquet"))
        charted = [r["destination"] for r in rows if r["pending_pdus"] > 0][:CHARTED_DESTINATIONS]
        series: dict[str, list[tuple[int, int]]] = {d: [] for d in charted}
        written = spark.read.parquet(_file_uri(out / "backlog_over_time.parquet"))
        for r in written.where(F.col("destination").isin(charted)).orderBy("destination", "bucket_end_ts").collect():
            series[r["destination"]].append((int(r["bucket_end_ts"]), int(r["backlog_pdus"])))
        stage["result"] = f"{bucket_ms // 60_000}-minute buckets, {len(charted)} destinations charted"

    with say.stage("computing stream writer lag") as stage:
        lag = transforms.writer_lag(read_table(spark, source, schemas.STREAM_POSITIONS_TABLE))
        lag.write.mode("overwrite").parquet(_file_uri(out / "writer_lag.parquet"))
        # Read back what was written: a handful of rows, and no second read of the database.
        writers = [
            (str(r["stream_name"]), str(r["instance_name"]), int(r["position"]), int(r["furthest_position"]), int(r["lag"]))
            for r in spark.read.parquet(_file_uri(out / "writer_lag.parquet")).orderBy("stream_name", "instance_name").collect()
        ]
        stage["result"] = f"{len(writers)} writers"

    with say.stage("writing charts, CSV and HTML") as stage:
        totals = _totals(rows)
        columns = [f.name for f in schemas.DESTINATIONS_SCHEMA.fields]
        report_files.write_destinations_csv(rows, columns, out / "destinations.csv")
        data = report_files.ReportData(
            server_name=server_name,
            source=source.description,
            now_ms=settings.now_ms,
            catch_up_threshold_ms=settings.catch_up_threshold_ms,
            totals=totals,
            top=rows[: settings.top],
            backlog_series=series,
            writers=writers,
            timings=dict(say.timings),
            replayed_events=event_count,
        )
        files = report_files.write_report(data, out)
        stage["result"] = f"{out / 'report.html'}"

    for df in (destination_stats, pending_rooms, extremities, pending, destinations):
        df.unpersist()
    return ReportOutcome(
        files={
            **files,
            "destinations_csv": out / "destinations.csv",
            "destinations": out / "destinations.parquet",
            "backlog_over_time": out / "backlog_over_time.parquet",
            "writer_lag": out / "writer_lag.parquet",
        },
        totals=totals,
        replayed_events=event_count,
        pending_pairs=pairs,
    )


def _file_uri(path: Path) -> str:
    """An explicit local path, so a cluster whose default filesystem is HDFS still writes here."""
    return path.as_uri()


def _totals(rows: Sequence[Mapping[str, Any]]) -> report_files.Totals:
    ages = [float(r["oldest_pending_age_s"]) for r in rows if r["oldest_pending_age_s"] is not None]
    return report_files.Totals(
        destinations=len(rows),
        in_catch_up=sum(1 for r in rows if r["in_catch_up"]),
        backing_off=sum(1 for r in rows if r["backing_off"]),
        pending_rooms=sum(int(r["pending_rooms"]) for r in rows),
        pending_pdus=sum(int(r["pending_pdus"]) for r in rows),
        catch_up_transactions=sum(int(r["catch_up_transactions"]) for r in rows),
        catch_up_pdus=sum(int(r["catch_up_pdus"]) for r in rows),
        naive_transactions=sum(int(r["naive_transactions"]) for r in rows),
        naive_pdus=sum(int(r["naive_pdus"]) for r in rows),
        oldest_pending_age_s=max(ages, default=None),
    )


# --- command line -----------------------------------------------------------------------------


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser(prog: str = "python -m spark_jobs.catch_up") -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog=prog,
        description="Federation catch-up report: per-destination backlog, catch-up cost and stream writer lag.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", type=Path, help="homeserver.yaml: use its database (or its embedded one)")
    where.add_argument("--jdbc-url", help="jdbc:postgresql://HOST:PORT/DB or postgresql://USER[:PASSWORD]@HOST[:PORT]/DB")
    parser.add_argument("--out", type=Path, required=True, help="folder for the Parquet tables, CSV, charts and report.html")
    parser.add_argument("--jdbc-jar", type=Path, default=Path(DEFAULT_JDBC_JAR), help=f"PostgreSQL JDBC driver (default {DEFAULT_JDBC_JAR})")
    parser.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    parser.add_argument("--driver-memory", default="2g", help="the driver JVM's heap (default 2g)")
    parser.add_argument(
        "--catch-up-threshold", default=DEFAULT_THRESHOLD,
        help=f"a retry interval past this puts a destination in catch-up (default {DEFAULT_THRESHOLD})",
    )
    parser.add_argument("--now", help="the report's 'now': ISO-8601 time or epoch milliseconds (default: the current time)")
    parser.add_argument("--bucket", help="width of the backlog-over-time buckets, e.g. 15m (default: from the backlog's age)")
    parser.add_argument("--partitions", type=int, default=8, help="JDBC read partitions for the events replay (default 8)")
    parser.add_argument("--top", type=int, default=20, help="destinations listed on the page (default 20)")
    parser.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark setting (repeatable)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def _parse_now(text: str | None) -> int:
    if text is None:
        return int(time.time() * 1000)
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(f"--now: expected an ISO-8601 time or epoch milliseconds, got {text!r}") from None
    if moment.tzinfo is None:
        raise ReportError(f"--now: give a time zone (e.g. {text}Z), got {text!r}")
    return int(moment.timestamp() * 1000)


def _duration_ms(option: str, text: str) -> int:
    from homeserver.config import ConfigError, parse_duration

    try:
        value = parse_duration(option, text)
    except ConfigError as e:
        raise ReportError(f"{option}: {e.message}") from None
    if value.total_seconds() <= 0:
        raise ReportError(f"{option}: expected a positive duration, got {text!r}")
    return int(value.total_seconds() * 1000)


def _spark_conf(pairs: Sequence[str]) -> dict[str, str]:
    conf = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("spark."):
            raise ReportError(f"--spark-conf: expected spark.KEY=VALUE, got {pair!r}")
        conf[key] = value
    return conf


def run(args: argparse.Namespace) -> int:
    from homeserver.config import ConfigError

    say = Progress(None if args.quiet else sys.stderr)
    try:
        settings = ReportSettings(
            out_dir=args.out,
            now_ms=_parse_now(args.now),
            catch_up_threshold_ms=_duration_ms("--catch-up-threshold", args.catch_up_threshold),
            partitions=max(1, args.partitions),
            top=max(1, args.top),
            bucket_ms=_duration_ms("--bucket", args.bucket) if args.bucket else None,
        )
        extra_conf = _spark_conf(args.spark_conf)
        if not args.jdbc_jar.is_file():
            raise ReportError(
                f"PostgreSQL JDBC driver not found at {args.jdbc_jar}: install libpostgresql-jdbc-java "
                "(.ci/install-spark.sh does) or pass --jdbc-jar PATH"
            )
        with ExitStack() as stack:
            if args.config is not None:
                source = jdbc_source_from_config(args.config, stack, say)
            else:
                source = jdbc_source_from_url(args.jdbc_url, stack)
            with say.stage("starting Spark") as stage:
                spark = build_session(
                    master=args.master, jdbc_jar=args.jdbc_jar.resolve(),
                    driver_memory=args.driver_memory, extra_conf=extra_conf,
                )
                stack.callback(spark.stop)
                check_jdbc_driver(spark, args.jdbc_jar)
                stage["result"] = f"master {spark.sparkContext.master}, Spark {spark.version}"
            outcome = run_report(spark, source, settings, say)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ReportError as e:
        print(f"catch-up report: {e}", file=sys.stderr)
        return EXIT_FAILURE
    t = outcome.totals
    print(
        f"{t.destinations:,} destinations, {t.in_catch_up:,} in catch-up, {t.backing_off:,} backing off; "
        f"{t.pending_rooms:,} pending rooms, {t.pending_pdus:,} pending PDUs; catch-up "
        f"{t.catch_up_transactions:,} transactions vs naive {t.naive_transactions:,}"
    )
    print(f"report: {outcome.files['html']}")
    return EXIT_OK


def main(argv: list[str] | None = None, prog: str = "python -m spark_jobs.catch_up") -> NoReturn:
    raise SystemExit(run(build_parser(prog).parse_args(argv)))
