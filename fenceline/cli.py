"""The ``fenceline`` command.

Every failure a user can cause ends as one line on stderr and a non-zero exit code:
2 for a usage or configuration mistake, 1 for a runtime failure (database unreachable,
a migration that failed). Nothing is changed before the input has been validated.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import psycopg
import trio

from fenceline import __version__, config, logs
from fenceline.errors import ConfigError, FencelineError, find_exception

log = logging.getLogger("fenceline.cli")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

MIGRATE_CONNECT_TIMEOUT = 10.0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _cmd_run(settings: config.Settings, args: argparse.Namespace) -> int:
    from fenceline import supervisor

    try:
        trio.run(supervisor.run, settings)
    except BaseExceptionGroup as group:
        # A ConfigError from inside the nursery tree is still the operator's to fix.
        config_error = find_exception(group, ConfigError)
        if config_error is None:
            raise
        raise config_error from None
    return EXIT_OK


def _embedded_dsn(settings: config.Settings) -> str | None:
    from fenceline.db import embedded

    return embedded.read_running_dsn(settings.data_dir or embedded.default_data_dir())


def _cmd_migrate(settings: config.Settings, args: argparse.Namespace) -> int:
    from fenceline.db import migrator
    from fenceline.db.connection import connect

    dsn = settings.database_url or _embedded_dsn(settings)
    if dsn is None:
        raise ConfigError("DATABASE_URL is not set and no embedded PostgreSQL is running "
                          "(fenceline run starts one and migrates it on start)")

    async def migrate() -> list[migrator.Migration]:
        with trio.fail_after(MIGRATE_CONNECT_TIMEOUT):
            conn = await connect(dsn)
        async with conn:
            return await migrator.migrate(conn)

    try:
        applied = trio.run(migrate)
    except trio.TooSlowError:
        print(f"fenceline migrate: database did not answer within "
              f"{MIGRATE_CONNECT_TIMEOUT:g}s", file=sys.stderr)
        return EXIT_FAILURE
    except psycopg.OperationalError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"fenceline migrate: cannot reach the database: {first}", file=sys.stderr)
        return EXIT_FAILURE
    if applied:
        print(f"applied {len(applied)} migration(s): "
              + ", ".join(m.filename for m in applied))
    else:
        print("database is up to date")
    return EXIT_OK


def _cmd_db_url(settings: config.Settings, args: argparse.Namespace) -> int:
    dsn = _embedded_dsn(settings)
    if dsn is None:
        print("fenceline db-url: no embedded PostgreSQL is running for this data dir",
              file=sys.stderr)
        return EXIT_FAILURE
    print(dsn)
    return EXIT_OK


def _cmd_bench(settings: config.Settings, args: argparse.Namespace) -> int:
    from fenceline import benchmark

    dsn = settings.database_url or _embedded_dsn(settings)
    if dsn is None:
        raise ConfigError("DATABASE_URL is not set and no embedded PostgreSQL is running")
    for name in ("jobs", "concurrency", "latency_jobs"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not args.rate > 0:
        raise ConfigError("--rate must be positive")
    print(f"fenceline bench: {args.jobs} noop jobs at concurrency {args.concurrency}, then "
          f"{args.latency_jobs} jobs at {args.rate:g}/s (scratch queue, removed afterwards)")
    result = trio.run(lambda: benchmark.run_bench(
        dsn, jobs=args.jobs, concurrency=args.concurrency, latency_jobs=args.latency_jobs,
        rate=args.rate))
    benchmark.report(result)
    return EXIT_OK


def _cmd_version(settings: config.Settings, args: argparse.Namespace) -> int:
    print(f"fenceline {__version__}")
    return EXIT_OK


COMMANDS: dict[str, tuple[Callable[[config.Settings, argparse.Namespace], int], str]] = {
    "run": (_cmd_run, "run the services chosen by --roles until SIGTERM"),
    "migrate": (_cmd_migrate, "apply pending database migrations and exit"),
    "db-url": (_cmd_db_url, "print the DSN of the running embedded PostgreSQL"),
    "bench": (_cmd_bench, "measure burn-down and latency against this database"),
    "version": (_cmd_version, "print the version"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fenceline", description="A PostgreSQL-backed job scheduler.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    for name, (_, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        config.add_arguments(cmd, name)
        if name == "bench":
            cmd.add_argument("--jobs", type=int, default=20_000, help="burn-down jobs")
            cmd.add_argument("--concurrency", type=int, default=16, help="handler slots")
            cmd.add_argument("--latency-jobs", type=int, default=200,
                             help="jobs submitted one at a time for latency")
            cmd.add_argument("--rate", type=float, default=50.0,
                             help="latency jobs per second")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = config.load(args.command, args)
        logs.configure(settings.log_level, settings.log_format)
        run, _ = COMMANDS[args.command]
        return run(settings, args)
    except ConfigError as exc:
        print(f"fenceline {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FencelineError as exc:
        print(f"fenceline {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
