"""The ``tributary`` command: run, generate-config, migrate, --version.

Exit codes: 0 success, 2 bad usage or configuration, 1 failure at run time.
The reactor is installed here, before anything imports it; configuration
errors are reported as one line naming the key.
"""

# tests: tests/integration/test_process.py

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn

from homeserver import __version__
from homeserver.config import ConfigError, HomeserverConfig, generate_config_text, load_config

logger = logging.getLogger("homeserver.cli")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

DEFAULT_CONFIG_NAME = "homeserver.yaml"


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="tributary", description="Tributary, a Matrix homeserver.")
    parser.add_argument("--version", action="version", version=f"tributary {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    run = commands.add_parser("run", help="run the single-process homeserver in the foreground")
    run.add_argument("--config", type=Path, help=f"config file (default: DATA_DIR/{DEFAULT_CONFIG_NAME}, generated on first run)")
    run.add_argument("--data-dir", type=Path, help="data directory (default: the config's data_dir, else ./data)")

    worker = commands.add_parser("worker", help="run one worker process of the config's worker layout (docs/workers.md)")
    worker.add_argument("--config", type=Path, required=True, help="the shared homeserver.yaml")
    worker.add_argument("--name", required=True, help="the worker's name under 'workers' in the config")

    gen = commands.add_parser("generate-config", help="write a commented config file")
    gen.add_argument("--server-name", required=True, help="the server's name, e.g. example.org")
    gen.add_argument("--data-dir", type=Path, default=Path("data"), help="data directory to put in the config")
    gen.add_argument("--output", type=Path, help="file to write (default: standard output); never overwritten")

    migrate = commands.add_parser("migrate", help="apply pending schema migrations and exit")
    migrate.add_argument("--config", type=Path, required=True)

    # Listed for --help only: main() hands `report catchup ...` to the report's own parser.
    commands.add_parser("report", help="analytics on Spark: `report catchup --help` (docs/spark-reports.md)")
    return parser


def main(argv: list[str] | None = None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        # Reports are plug-ins (the ``tributary.reports`` entry points; spark_jobs/ ships
        # ``catchup``), so the server's code never imports the analytics.
        reports = {ep.name: ep for ep in entry_points(group="tributary.reports")}
        name = argv[1] if len(argv) > 1 else ""
        if name not in reports:
            known = ", ".join(sorted(reports)) or "none installed"
            build_parser().error(f"report: unknown report {name!r} (reports: {known}; tributary report catchup --help)")
        reports[name].load()(argv[2:], prog=f"tributary report {name}")
    args = build_parser().parse_args(argv)
    match args.command:
        case "generate-config":
            code = _generate_config(args)
        case "run":
            code = _run(args)
        case "worker":
            code = _worker(args)
        case "migrate":
            code = _migrate(args)
        case _:  # pragma: no cover - argparse refuses other values
            code = EXIT_USAGE
    raise SystemExit(code)


def _generate_config(args: argparse.Namespace) -> int:
    try:
        text = generate_config_text(args.server_name, str(args.data_dir))
    except ConfigError as e:
        print(f"config error: --server-name: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_OK
    if args.output.exists():
        print(f"error: {args.output} exists; not overwriting it", file=sys.stderr)
        return EXIT_USAGE
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def _load(config_path: Path | None, data_dir: Path | None) -> HomeserverConfig:
    if config_path is None:
        directory = (data_dir or Path("data")).resolve()
        config_path = directory / DEFAULT_CONFIG_NAME
        if not config_path.exists():
            directory.mkdir(parents=True, exist_ok=True)
            config_path.write_text(generate_config_text("localhost", "."), encoding="utf-8")
            print(f"generated {config_path} for server name 'localhost'", file=sys.stderr)
    return load_config(config_path, data_dir_override=data_dir)


def _run(args: argparse.Namespace) -> int:
    try:
        config = _load(args.config, args.data_dir)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return _run_in_reactor(config, "run")


def _worker(args: argparse.Namespace) -> int:
    from homeserver.roles import UnknownRole, load_role

    try:
        config = load_config(args.config)
        if args.name not in config.workers:
            known = ", ".join(sorted(config.workers)) or "none"
            raise ConfigError("workers", f"no worker named {args.name!r} in {args.config} (workers: {known})")
        load_role(config.workers[args.name].app)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except UnknownRole as e:
        print(f"config error: workers.{args.name}.app: {e}", file=sys.stderr)
        return EXIT_USAGE
    return _run_in_reactor(config, "run", instance_name=args.name)


def _migrate(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return _run_in_reactor(config, "migrate")


def _run_in_reactor(config: HomeserverConfig, mode: str, *, instance_name: str = "master") -> int:
    """Start the reactor, run the homeserver (or just its migrations), return the exit code."""
    from homeserver.reactor import install_reactor

    reactor = install_reactor()
    from twisted.internet.defer import Deferred

    from homeserver.app import HomeServer
    from homeserver.logging_setup import setup_logging

    setup_logging(config.log_level, config.log_format)
    hs = HomeServer(config, reactor, instance_name=instance_name)
    outcome = {"code": EXIT_OK}

    async def start() -> None:
        try:
            await hs.start()
        except Exception as e:
            _report_start_failure(e)
            outcome["code"] = EXIT_FAILURE
            reactor.stop()
            return
        if mode == "migrate":
            logger.info("schema is up to date")
            reactor.stop()
            return
        # Everything built at start-up lives as long as the process: keep it out of the
        # garbage collector's full passes, whose pauses otherwise show in request p99.
        import gc

        gc.freeze()

    def on_shutdown() -> Deferred[Any]:
        return Deferred.fromCoroutine(hs.stop())

    reactor.addSystemEventTrigger("before", "shutdown", on_shutdown)
    reactor.callWhenRunning(lambda: Deferred.fromCoroutine(start()))
    reactor.run()
    return outcome["code"]


def _report_start_failure(error: Exception) -> None:
    from storage.database import DatabaseError
    from storage.embedded import EmbeddedPostgresError
    from storage.prepare import SchemaError

    if isinstance(error, (DatabaseError, EmbeddedPostgresError, SchemaError, OSError)):
        logger.error("cannot start: %s", error)
    else:
        logger.exception("cannot start: unexpected error")


if __name__ == "__main__":
    main()
