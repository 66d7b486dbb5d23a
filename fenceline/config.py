"""Settings from flags and the environment, validated once.

Every setting is declared exactly once, in ``SETTINGS``: its flag, its environment
variable, its parser, its default and its help text. ``fenceline run --help`` and the
README's settings table are both made from that list (a test checks the README), so the
three can never disagree. A flag wins over the environment, which wins over the default.

Validation happens here and nowhere else: a bad value raises ``ConfigError`` with one
line that names the flag, the variable and what was wrong, before anything is started.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg.conninfo

from fenceline.errors import ConfigError

ROLES = ("api", "scheduler", "worker", "archiver")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "text")


def parse_roles(text: str) -> frozenset[str]:
    roles = [r.strip() for r in text.split(",") if r.strip()]
    if not roles:
        raise ValueError("at least one role is needed")
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown role {', '.join(unknown)} (choose from {','.join(ROLES)})")
    return frozenset(roles)


def parse_database_url(text: str) -> str:
    text = text.strip()
    if not text:
        raise ValueError("must not be empty")
    is_url = "://" in text
    if is_url and not text.startswith(("postgresql://", "postgres://")):
        raise ValueError("must start with postgresql:// or postgres://")
    try:
        parts = psycopg.conninfo.conninfo_to_dict(text)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"not a valid PostgreSQL connection string: {str(exc).strip()}") from None
    if not is_url and not parts:
        raise ValueError("not a valid PostgreSQL connection string")
    for port in str(parts.get("port", "")).split(","):
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"not a valid PostgreSQL connection string: bad port {port!r}")
    return text


def parse_origins(text: str) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in origins:
        if "://" not in origin:
            raise ValueError(f"origin {origin!r} must look like https://example.com")
    return origins


def parse_port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError("must be between 1 and 65535")
    return port


def parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be a whole number of at least 1")
    return value


def parse_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a positive number of seconds")
    return value


def parse_days(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value > 36500:
        raise ValueError("must be a number of days above 0 and at most 36500")
    return value


def parse_module_name(text: str) -> str:
    name = text.strip()
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError("must be a dotted Python module name")
    return name


def parse_choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


@dataclass(frozen=True)
class Setting:
    """One setting: where it comes from and how it is checked."""

    name: str
    flag: str
    env: str
    parse: Callable[[str], Any]
    default: str | None
    help: str
    commands: tuple[str, ...] = ("run",)


SETTINGS: tuple[Setting, ...] = (
    Setting("database_url", "--database-url", "DATABASE_URL", parse_database_url, None,
            "PostgreSQL connection string. Unset: start the embedded PostgreSQL.",
            ("run", "migrate", "bench")),
    Setting("roles", "--roles", "FENCELINE_ROLES", parse_roles, ",".join(ROLES),
            "Comma-separated services to start: api, scheduler, worker, archiver."),
    Setting("api_addr", "--api-addr", "API_ADDR", str, "127.0.0.1",
            "Address the HTTP API listens on."),
    Setting("api_port", "--api-port", "API_PORT", parse_port, "3001",
            "Port the HTTP API listens on."),
    Setting("log_level", "--log-level", "LOG_LEVEL", parse_choice(LOG_LEVELS), "info",
            "debug, info, warning or error.", ("run", "migrate", "bench")),
    Setting("log_format", "--log-format", "LOG_FORMAT", parse_choice(LOG_FORMATS), "auto",
            "json (one object per line), text, or auto: text on a terminal, json otherwise.",
            ("run", "migrate", "bench")),
    Setting("data_dir", "--data-dir", "FENCELINE_DATA_DIR", Path, None,
            "Embedded PostgreSQL data directory (default: per-user data dir; "
            "/var/lib/fenceline/embedded as root).", ("run", "db-url", "migrate", "bench")),
    Setting("embedded_user", "--embedded-user", "FENCELINE_EMBEDDED_USER", str,
            "nobody", "Existing unprivileged account that runs the embedded PostgreSQL "
            "when fenceline runs as root."),
    Setting("pool_size", "--pool-size", "FENCELINE_POOL_SIZE", parse_positive_int, "10",
            "Maximum PostgreSQL connections in the process's pool."),
    Setting("drain_timeout", "--drain-timeout", "FENCELINE_DRAIN_TIMEOUT", parse_seconds, "30",
            "Seconds running handlers get to finish after SIGTERM before they are "
            "cancelled and released."),
    Setting("queue", "--queue", "FENCELINE_QUEUE", str, None,
            "Worker role: the queue to work, by id or org/project/queue path."),
    Setting("concurrency", "--concurrency", "FENCELINE_CONCURRENCY", parse_positive_int, "16",
            "Worker role: handlers run at once."),
    Setting("lease", "--lease", "FENCELINE_LEASE", parse_seconds, "30",
            "Worker role: lease length in seconds; a silent worker's jobs are reclaimed "
            "after it."),
    Setting("handlers", "--handlers", "FENCELINE_HANDLERS", parse_module_name, None,
            "Worker role: a Python module whose HANDLERS dict (job type -> handler) is run "
            "besides the built-in noop, sleep, fail, shell and http."),
    Setting("password_profile", "--password-profile", "FENCELINE_PASSWORD_PROFILE",
            parse_choice(("standard", "minimal")), "standard",
            "API role: argon2id cost. 'minimal' is for tests only: it makes stolen hashes cheap "
            "to crack.", commands=("run",)),
    Setting("api_allowed_origins", "--api-allowed-origins", "API_ALLOWED_ORIGINS", parse_origins,
            "", "API role: comma-separated origins (scheme://host[:port], '*' wildcards) allowed "
            "to open the event websocket; empty = same origin only."),
    Setting("api_prepare", "--api-prepare", "FENCELINE_API_PREPARE",
            parse_choice(("on", "off")), "on",
            "API role: run the API's fixed statements as server-side prepared statements. "
            "'off' for a connection pooler in transaction mode (PgBouncer); on, the API "
            "switches itself off after three vanished statements."),
    Setting("reaper_interval", "--reaper-interval", "FENCELINE_REAPER_INTERVAL", parse_seconds,
            "1", "Scheduler role: seconds between reaper passes (expired leases)."),
    Setting("promoter_interval", "--promoter-interval", "FENCELINE_PROMOTER_INTERVAL",
            parse_seconds, "1", "Scheduler role: seconds between promoter passes (due jobs)."),
    Setting("breaker_interval", "--breaker-interval", "FENCELINE_BREAKER_INTERVAL",
            parse_seconds, "1", "Scheduler role: seconds between circuit-breaker passes."),
    Setting("orphan_interval", "--orphan-interval", "FENCELINE_ORPHAN_INTERVAL",
            parse_seconds, "15", "Scheduler role: seconds between lease-orphan and "
            "worker-liveness passes."),
    Setting("events_retention_days", "--events-retention-days",
            "FENCELINE_EVENTS_RETENTION_DAYS", parse_days, "7",
            "Scheduler role: days the event outbox keeps an event; older ones are deleted "
            "(a reader behind them gets 410 cursor_too_old)."),
)


@dataclass(frozen=True)
class Settings:
    """The validated settings of one process."""

    database_url: str | None = None
    roles: frozenset[str] = field(default_factory=lambda: frozenset(ROLES))
    api_addr: str = "127.0.0.1"
    api_port: int = 3001
    log_level: str = "info"
    log_format: str = "auto"
    data_dir: Path | None = None
    embedded_user: str = "nobody"
    pool_size: int = 10
    drain_timeout: float = 30.0
    queue: str | None = None
    concurrency: int = 16
    lease: float = 30.0
    handlers: str | None = None
    password_profile: str = "standard"
    api_allowed_origins: tuple[str, ...] = ()
    api_prepare: str = "on"
    reaper_interval: float = 1.0
    promoter_interval: float = 1.0
    breaker_interval: float = 1.0
    orphan_interval: float = 15.0
    events_retention_days: float = 7.0

    @property
    def embedded(self) -> bool:
        """True when fenceline must start its own PostgreSQL."""
        return self.database_url is None


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the flags of ``command`` to ``parser``; help names the variable and default."""
    for s in SETTINGS:
        if command not in s.commands:
            continue
        default = f"default: {s.default}" if s.default is not None else "no default"
        parser.add_argument(
            s.flag, dest=s.name, default=None, metavar=s.env,
            help=f"{s.help} [env {s.env}; {default}]",
        )


def load(command: str, args: argparse.Namespace | None = None,
         environ: Mapping[str, str] | None = None) -> Settings:
    """Build ``Settings`` for ``command`` from flags, then environment, then defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in SETTINGS:
        if command not in s.commands:
            continue
        raw = getattr(args, s.name, None) if args is not None else None
        source = s.flag
        if raw is None and s.env in environ and environ[s.env] != "":
            raw, source = environ[s.env], s.env
        if raw is None:
            if s.default is None:
                continue
            raw, source = s.default, f"the default of {s.flag}"
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            detail = str(exc) or "not valid"
            if detail.startswith("invalid literal") or detail.startswith("could not convert"):
                detail = "not a number"
            raise ConfigError(f"{source}={raw!r}: {detail}") from None
    return Settings(**values)
