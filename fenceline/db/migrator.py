"""Numbered SQL migrations, applied in order under an advisory lock.

The files live in ``migrations/`` at the repository root and ship in the wheel as the
``fenceline.migrations`` package data. Each is named ``NNNN_description.sql`` and runs as one
script in its own transaction, together with the row that records it, so a failed migration
leaves nothing behind and a crash between two migrations resumes at the next one.

Two migrators at once are safe: both take the same session advisory lock; the second waits,
then finds everything applied. An applied migration whose file has changed since is a loud
error: the database no longer matches the code that claims to describe it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from typing import TYPE_CHECKING, Any

from psycopg import sql

from fenceline.db.locks import NAMESPACE, Lock
from fenceline.errors import FencelineError

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("fenceline.migrate")

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

_BOOKKEEPING = """
create schema if not exists fl;
create table if not exists fl.schema_migrations (
    version    integer primary key,
    name       text not null,
    checksum   text not null,
    applied_at timestamptz not null default now()
);
"""


class MigrationError(FencelineError):
    """The database's migrations and the code's disagree, or a migration failed."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def filename(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


@dataclass(frozen=True)
class Status:
    """How far a database is from the code's migrations."""

    applied: tuple[int, ...]
    pending: tuple[Migration, ...]

    @property
    def current(self) -> bool:
        return not self.pending


def load_migrations(source: Traversable | None = None) -> tuple[Migration, ...]:
    """The migrations in ``source`` (default: those shipped), in order.

    Numbers must be unique; gaps are allowed (work in progress reserves numbers), and
    ``_check`` refuses a pending migration older than one already applied, which is what a
    gap could otherwise hide.
    """
    found: list[Migration] = []
    for entry in (source or resources.files("fenceline.migrations")).iterdir():
        match = _NAME.match(entry.name)
        if match is None:
            continue
        found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    for before, after in itertools.pairwise(found):
        if before.version == after.version:
            raise MigrationError(f"two migrations have number {after.version:04d}: "
                                 f"{before.filename} and {after.filename}")
    return tuple(found)


async def _applied(conn: psycopg.AsyncConnection[Any]) -> dict[int, str]:
    cur = await conn.execute(
        "select to_regclass('fl.schema_migrations') is not null"
    )
    row = await cur.fetchone()
    if row is None or not row[0]:
        return {}
    cur = await conn.execute("select version, checksum from fl.schema_migrations")
    return {int(v): str(c) for v, c in await cur.fetchall()}


def _check(applied: dict[int, str], migrations: tuple[Migration, ...]) -> Status:
    known = {m.version: m for m in migrations}
    for version, checksum in sorted(applied.items()):
        m = known.get(version)
        if m is not None and m.checksum != checksum:
            raise MigrationError(
                f"migration {m.filename} was changed after it was applied "
                f"(database checksum {checksum[:12]}, file {m.checksum[:12]}); "
                "never edit an applied migration: add a new one"
            )
    pending = tuple(m for m in migrations if m.version not in applied)
    newest = max(applied, default=0)
    late = [m.filename for m in pending if m.version < newest]
    if late:
        raise MigrationError(
            f"migration {late[0]} is older than {newest:04d}, which is already applied; "
            "renumber it after the newest applied migration")
    return Status(applied=tuple(sorted(applied)), pending=pending)


async def status(conn: psycopg.AsyncConnection[Any],
                 migrations: tuple[Migration, ...] | None = None) -> Status:
    """Compare the database with the code, without changing anything."""
    return _check(await _applied(conn), migrations or load_migrations())


async def migrate(conn: psycopg.AsyncConnection[Any],
                  migrations: tuple[Migration, ...] | None = None) -> list[Migration]:
    """Apply every pending migration; return those applied by this call.

    ``conn`` must be an autocommit connection used by nobody else meanwhile: the advisory
    lock is held by its session.
    """
    migrations = migrations or load_migrations()
    lock = sql.SQL("select pg_advisory_lock({}, {})").format(NAMESPACE, int(Lock.MIGRATE))
    unlock = sql.SQL("select pg_advisory_unlock({}, {})").format(NAMESPACE, int(Lock.MIGRATE))
    await conn.execute(lock)
    try:
        await conn.execute(_BOOKKEEPING)
        state = _check(await _applied(conn), migrations)
        done: list[Migration] = []
        for m in state.pending:
            try:
                async with conn.transaction():
                    await conn.execute(m.sql.encode())
                    await conn.execute(
                        "insert into fl.schema_migrations (version, name, checksum)"
                        " values (%s, %s, %s)",
                        (m.version, m.name, m.checksum),
                    )
            except Exception as exc:
                raise MigrationError(f"migration {m.filename} failed: {exc}") from exc
            log.info("applied migration", extra={"migration": m.filename})
            done.append(m)
        return done
    finally:
        await conn.execute(unlock)
