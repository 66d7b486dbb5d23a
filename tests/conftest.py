"""Test harness: a real PostgreSQL, a migrated template, one fresh database per test.

Where the server comes from:
- ``TEST_DATABASE_URL`` when set (CI runs once against the machine's PostgreSQL 15);
- otherwise an embedded PostgreSQL 18 started once for the whole run, from the same
  launcher ``fenceline run`` uses, in a background thread with its own Trio loop.

The template database is built once per run with the real migrator, then every test that
asks for ``dsn`` gets ``CREATE DATABASE ... TEMPLATE`` of it (about 0.1 s) and it is dropped
afterwards. Tests are isolated and could run in parallel.

Fixtures are sync where they are session-scoped (pytest-trio's async fixtures are
function-scoped only) and use plain sync psycopg for the admin work.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from fenceline.db import migrator

if TYPE_CHECKING:
    from fenceline.db.connection import TrioConnection
    from fenceline.db.pool import Pool


def _with_dbname(dsn: str, dbname: str) -> str:
    return make_conninfo(dsn, dbname=dbname)


class _EmbeddedThread:
    """An embedded PostgreSQL kept alive by a Trio loop in a daemon thread."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.dsn: str | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._main, name="embedded-pg", daemon=True)

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(120)
        if self.error is not None:
            raise RuntimeError(f"embedded PostgreSQL did not start: {self.error}")
        assert self.dsn is not None
        return self.dsn

    def stop(self) -> None:
        if self._token is not None and self._scope is not None:
            trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(30)

    def _main(self) -> None:
        from fenceline.db import embedded

        async def serve() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._scope = scope
                async with trio.open_nursery() as nursery:
                    # fsync off: a throwaway server; durability is not what the tests measure.
                    server = await nursery.start(
                        embedded.run_embedded,
                        embedded.EmbeddedSettings(data_dir=self.data_dir, fsync=False),
                    )
                    self.dsn = server.dsn
                    self._ready.set()

        try:
            trio.run(serve)
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()


@pytest.fixture(scope="session")
def server_dsn() -> Iterator[str]:
    """A DSN for the server's maintenance database (``postgres``)."""
    url = os.environ.get("TEST_DATABASE_URL")
    if url:
        yield url
        return
    base = Path(tempfile.mkdtemp(prefix="fenceline-test-pg-"))
    base.chmod(0o755)  # the embedded server may run as another account when we are root
    server = _EmbeddedThread(base / "data")
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def scratch_database(server_dsn: str, prefix: str, template: str | None = None) -> Iterator[str]:
    """Create a database (optionally from ``template``), yield its name, drop it."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    create = sql.SQL("create database {}").format(sql.Identifier(name))
    if template is not None:
        create = sql.SQL("{} template {}").format(create, sql.Identifier(template))
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(create)
    try:
        yield name
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("drop database if exists {} with (force)")
                          .format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def template_db(server_dsn: str) -> Iterator[str]:
    """Name of a database with every migration applied, built once per run."""

    async def apply(name: str) -> None:
        from fenceline.db.connection import connect

        async with await connect(_with_dbname(server_dsn, name)) as conn:
            await migrator.migrate(conn)

    with scratch_database(server_dsn, f"fl_template_{os.getpid()}") as name:
        trio.run(apply, name)
        yield name


@pytest.fixture
def dsn(server_dsn: str, template_db: str) -> Iterator[str]:
    """A DSN to a fresh, fully migrated database of this test's own."""
    with scratch_database(server_dsn, "fl_test", template_db) as name:
        yield _with_dbname(server_dsn, name)


@pytest.fixture
def empty_dsn(server_dsn: str) -> Iterator[str]:
    """A DSN to a fresh database with no migrations applied (for migrator tests)."""
    with scratch_database(server_dsn, "fl_empty") as name:
        yield _with_dbname(server_dsn, name)


@pytest.fixture
async def conn(dsn: str) -> AsyncIterator[TrioConnection[Any]]:
    """A Trio-native autocommit connection to this test's database."""
    from fenceline.db.connection import connect

    async with await connect(dsn) as connection:
        yield connection


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[Pool]:
    from fenceline.db.pool import open_pool

    async with open_pool(dsn, max_size=4, name="test") as p:
        yield p


class Clock:
    """Steers ``fl.now()`` for one connection's session: time moves only when told."""

    def __init__(self, connection: TrioConnection[Any]) -> None:
        self.connection = connection

    async def set(self, when: str) -> None:
        await self.connection.execute("select set_config('fl.testing', 'on', false)")
        await self.connection.execute("select set_config('fl.now', %s, false)", (when,))

    async def advance(self, seconds: float) -> None:
        await self.connection.execute(
            "select set_config('fl.now', (fl.now() + make_interval(secs => %s))::text, false)",
            (seconds,),
        )

    async def now(self) -> Any:
        cur = await self.connection.execute("select fl.now()")
        row = await cur.fetchone()
        assert row is not None
        return row[0]


@pytest.fixture
async def clock(conn: TrioConnection[Any]) -> Clock:
    """``fl.now()`` frozen at 2026-01-01 00:00 UTC on ``conn``; advance it explicitly."""
    c = Clock(conn)
    await c.set("2026-01-01 00:00:00+00")
    return c


def pytest_report_header(config: pytest.Config) -> str:
    url = os.environ.get("TEST_DATABASE_URL")
    if url:
        host = conninfo_to_dict(url).get("host", "?")
        return f"fenceline: PostgreSQL from TEST_DATABASE_URL (host {host})"
    return "fenceline: embedded PostgreSQL 18 (TEST_DATABASE_URL not set)"
