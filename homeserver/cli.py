"""The ``tributary`` command: run, worker, generate-config, migrate, register-user, report, --version.

Exit codes: 0 success, 2 bad usage or configuration, 1 failure at run time.
The reactor is installed here, before anything imports it; configuration
errors are reported as one line naming the key. ``run`` and ``worker`` check that
every listener can bind before anything else happens (one line naming a taken
address, exit 1); ``migrate`` and ``register-user`` never listen. On SIGINT/SIGTERM
the process stops cleanly; a second signal while stopping ends it at once.
"""

# tests: tests/integration/test_process.py, tests/integration/test_ops_process.py

from __future__ import annotations

import argparse
import atexit
import getpass
import logging
import os
import signal
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn

import attrs

from homeserver import __version__
from homeserver.config import ConfigError, HomeserverConfig, ListenerConfig, generate_config_text, load_config
from homeserver.port_check import first_taken

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
    run.add_argument("--port", type=int, metavar="PORT",
                     help="serve the client API on PORT and metrics on PORT+1000 instead of the config's ports "
                          "(a second instance: `make run PORT=8018` also uses its own data directory)")

    worker = commands.add_parser("worker", help="run one worker process of the config's worker layout (docs/workers.md)")
    worker.add_argument("--config", type=Path, required=True, help="the shared homeserver.yaml")
    worker.add_argument("--name", required=True, help="the worker's name under 'workers' in the config")

    gen = commands.add_parser("generate-config", help="write a commented config file")
    gen.add_argument("--server-name", required=True, help="the server's name, e.g. example.org")
    gen.add_argument("--data-dir", type=Path, default=Path("data"), help="data directory to put in the config")
    gen.add_argument("--output", type=Path, help="file to write (default: standard output); never overwritten")

    migrate = commands.add_parser("migrate", help="apply pending schema migrations and exit (binds no port)")
    migrate.add_argument("--config", type=Path, required=True)

    register = commands.add_parser(
        "register-user", help="create an account (--admin: a server admin) directly in the database, and exit")
    register.add_argument("--config", type=Path, help=f"config file (default: DATA_DIR/{DEFAULT_CONFIG_NAME})")
    register.add_argument("--data-dir", type=Path, help="data directory (default: the config's data_dir, else ./data)")
    register.add_argument("--user", required=True, help="the new user's localpart (or full user ID on this server)")
    register.add_argument("--password-file", type=Path,
                          help="read the password from this file's first line (default: ask on the terminal, "
                               "or read one line from standard input when it is not a terminal)")
    register.add_argument("--admin", action="store_true", help="make the account a server admin (docs/admin.md)")

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
        case "register-user":
            code = _register_user(args)
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


def with_port(config: HomeserverConfig, port: int) -> HomeserverConfig:
    """``run --port``: the first client listener on ``port`` and every metrics listener on
    ``port + 1000``, the rest of the config as it is."""
    if not 1 <= port <= 64535:
        raise ConfigError("--port", f"expected a port from 1 to 64535 (metrics go on PORT+1000), got {port}")
    listeners: list[ListenerConfig] = []
    client_done = False
    for listener in config.listeners:
        if listener.type == "http" and "client" in listener.resources and not client_done:
            listener, client_done = attrs.evolve(listener, port=port), True
        elif listener.type == "metrics":
            listener = attrs.evolve(listener, port=port + 1000)
        listeners.append(listener)
    if not client_done:
        raise ConfigError("--port", "the config has no http listener with the client resource to move")
    return attrs.evolve(config, listeners=tuple(listeners))


def _run(args: argparse.Namespace) -> int:
    try:
        config = _load(args.config, args.data_dir)
        if args.port is not None:
            config = with_port(config, args.port)
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

    async def migrate(hs: Any) -> int:
        applied, version = await hs.migrate()
        if applied:
            logger.info("applied %d migration%s (%s); the schema is now at version %d",
                        len(applied), "" if len(applied) == 1 else "s", ", ".join(applied), version)
        else:
            logger.info("schema is up to date (version %d); nothing to apply", version)
        return EXIT_OK

    return _run_tool(config, migrate)


def _read_password(args: argparse.Namespace) -> str:
    if args.password_file is not None:
        try:
            lines = args.password_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("--password-file", f"cannot read {args.password_file}: {e}") from e
        password = lines[0] if lines else ""
    elif sys.stdin.isatty():
        password = getpass.getpass("Password: ")
        if getpass.getpass("Confirm password: ") != password:
            raise ConfigError("password", "the passwords do not match")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise ConfigError("password", "an account needs a non-empty password")
    return password


def _register_user(args: argparse.Namespace) -> int:
    from homeserver.admin.accounts import AccountExists, create_account

    try:
        config = _load(args.config, args.data_dir)
        from homeserver.events.validation import check_localpart
        from storage.kernel.errors import MatrixError

        localpart = args.user.lower()
        if localpart.startswith("@"):
            localpart, _, server = localpart[1:].partition(":")
            if server != config.server_name.lower():
                raise ConfigError("--user", f"{args.user!r} is not a user of this server ({config.server_name})")
        try:
            check_localpart(localpart, config.server_name)
        except MatrixError as e:
            raise ConfigError("--user", f"{args.user!r}: {e.error}") from None
        password = _read_password(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE

    async def register(hs: Any) -> int:
        async def create(db: Any) -> str:
            return await create_account(db, hs.reactor, config, localpart, password, admin=args.admin)

        try:
            user_id = await hs.with_database(create)
        except AccountExists as e:
            logger.error("cannot register: %s", e)
            return EXIT_FAILURE
        print(f"registered {user_id}{' (server admin)' if args.admin else ''}")
        return EXIT_OK

    return _run_tool(config, register)


def _run_tool(config: HomeserverConfig, tool: Any) -> int:
    """Run ``await tool(hs)`` in the reactor for a command that never listens; return its exit code."""
    from homeserver.reactor import install_reactor

    reactor = install_reactor()
    from twisted.internet.defer import Deferred

    from homeserver.app import HomeServer
    from homeserver.logging_setup import setup_logging

    setup_logging(config.log_level, config.log_format)
    hs = HomeServer(config, reactor)
    outcome = {"code": EXIT_OK}

    async def run() -> None:
        try:
            outcome["code"] = await tool(hs)
        except Exception as e:
            _report_start_failure(e)
            outcome["code"] = EXIT_FAILURE
        finally:
            reactor.stop()

    reactor.callWhenRunning(lambda: Deferred.fromCoroutine(run()))
    reactor.run(installSignalHandlers=False)
    return outcome["code"]


def _run_in_reactor(config: HomeserverConfig, mode: str, *, instance_name: str = "master") -> int:
    """Start the reactor, run the homeserver, return the exit code."""
    listeners = config.listeners if instance_name == "master" else config.workers[instance_name].listeners
    taken = first_taken(listeners, prefix="listeners" if instance_name == "master" else f"workers.{instance_name}.listeners")
    if taken is not None:
        # Before the database, the embedded PostgreSQL or the signing key: nothing has changed.
        print(f"cannot start: {taken.describe()}", file=sys.stderr)
        return EXIT_FAILURE
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
        # Everything built at start-up lives as long as the process: keep it out of the
        # garbage collector's full passes, whose pauses otherwise show in request p99.
        import gc

        gc.freeze()

    def on_shutdown() -> Deferred[Any]:
        _stop_at_once_on_second_signal()
        return Deferred.fromCoroutine(hs.stop())

    reactor.addSystemEventTrigger("before", "shutdown", on_shutdown)
    reactor.callWhenRunning(lambda: Deferred.fromCoroutine(start()))
    reactor.run()
    # Twisted put back the handlers from before run(); a signal now, during exit, ends it quietly too.
    _stop_at_once_on_second_signal()
    # The interpreter's finalisation puts a Python handler back to the default (a signal then
    # killed the process: exit status -2 seen), but leaves an ignored signal ignored; by then
    # the exit is only moments away.
    atexit.register(_ignore_signals_while_exiting)
    if hs.fatal_error is not None:
        print(f"stopped: {hs.fatal_error}", file=sys.stderr)
        return EXIT_FAILURE
    return outcome["code"]


def _ignore_signals_while_exiting() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def _stop_at_once_on_second_signal() -> None:
    """While stopping, SIGINT or SIGTERM again means "now": exit without the clean-up
    (Twisted's own handler would try to stop the stopping reactor and log ReactorNotRunning)."""

    def now(signum: int, frame: object) -> None:
        os.write(2, b"stopping now, without waiting for the clean-up\n")
        os._exit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, now)


def _report_start_failure(error: Exception) -> None:
    from twisted.internet.error import CannotListenError

    from storage.database import DatabaseError
    from storage.embedded import EmbeddedPostgresError
    from storage.prepare import SchemaError

    if isinstance(error, CannotListenError):
        # Taken between the check and the bind (another process was quicker).
        host = error.interface or "0.0.0.0"
        logger.error("cannot start: %s:%s is already in use (%s)", host, error.port, error.socketError)
    elif isinstance(error, ConfigError):
        logger.error("cannot start: config error: %s", error)
    elif isinstance(error, (DatabaseError, EmbeddedPostgresError, SchemaError, OSError)):
        logger.error("cannot start: %s", error)
    else:
        logger.exception("cannot start: unexpected error")


if __name__ == "__main__":
    main()
