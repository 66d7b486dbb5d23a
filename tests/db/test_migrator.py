"""Migrations: applied once, in order, each atomically; tampering is loud; racing is safe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fenceline.db import migrator
from fenceline.db.connection import connect

SHIPPED = migrator.load_migrations()


async def applied_versions(dsn: str) -> list[int]:
    async with await connect(dsn) as conn:
        cur = await conn.execute("select version from fl.schema_migrations order by version")
        return [row[0] for row in await cur.fetchall()]


async def test_fresh_database_gets_every_migration_once(empty_dsn: str) -> None:
    async with await connect(empty_dsn) as conn:
        first = await migrator.migrate(conn)
        second = await migrator.migrate(conn)
        state = await migrator.status(conn)
    assert [m.version for m in first] == [m.version for m in SHIPPED]
    assert second == []
    assert state.current
    assert await applied_versions(empty_dsn) == [m.version for m in SHIPPED]


async def test_status_reports_pending_without_changing_anything(empty_dsn: str) -> None:
    async with await connect(empty_dsn) as conn:
        state = await migrator.status(conn)
        cur = await conn.execute("select to_regnamespace('fl') is null")
        row = await cur.fetchone()
    assert not state.current
    assert [m.version for m in state.pending] == [m.version for m in SHIPPED]
    assert row is not None and row[0], "status() must not create the schema"


async def test_a_changed_applied_migration_is_a_loud_error(dsn: str) -> None:
    tampered = (migrator.Migration(1, SHIPPED[0].name, SHIPPED[0].sql + "\n-- edited\n"),
                *SHIPPED[1:])
    async with await connect(dsn) as conn:
        with pytest.raises(migrator.MigrationError, match="changed after it was applied"):
            await migrator.migrate(conn, tampered)
        with pytest.raises(migrator.MigrationError, match=r"0001_base\.sql"):
            await migrator.status(conn, tampered)


async def test_a_failing_migration_leaves_nothing_behind(empty_dsn: str) -> None:
    broken = migrator.Migration(
        len(SHIPPED) + 1, "broken",
        "create table fl.half_done (id int); select 1/0;",
    )
    async with await connect(empty_dsn) as conn:
        with pytest.raises(migrator.MigrationError, match=r"broken\.sql failed"):
            await migrator.migrate(conn, (*SHIPPED, broken))
        cur = await conn.execute("select to_regclass('fl.half_done') is null")
        row = await cur.fetchone()
        # The lock was released: the same connection can migrate again at once.
        again = await migrator.migrate(conn)
    assert row is not None and row[0]
    assert again == []
    assert await applied_versions(empty_dsn) == [m.version for m in SHIPPED]


def test_migration_numbers_must_be_unique(tmp_path: Path) -> None:
    (tmp_path / "0001_a.sql").write_text("select 1;")
    (tmp_path / "0002_b.sql").write_text("select 1;")
    (tmp_path / "0002_c.sql").write_text("select 1;")
    with pytest.raises(migrator.MigrationError, match=r"two migrations have number 0002"):
        migrator.load_migrations(tmp_path)  # type: ignore[arg-type]


async def test_a_migration_older_than_the_newest_applied_is_refused(
        empty_dsn: str, tmp_path: Path) -> None:
    from fenceline.db.connection import connect

    (tmp_path / "0001_a.sql").write_text("create table fl.a (x int);")
    (tmp_path / "0003_c.sql").write_text("create table fl.c (x int);")
    async with await connect(empty_dsn) as conn:
        done = await migrator.migrate(conn, migrator.load_migrations(tmp_path))  # type: ignore[arg-type]
        assert [m.version for m in done] == [1, 3]   # a gap is fine
        (tmp_path / "0002_b.sql").write_text("create table fl.b (x int);")
        with pytest.raises(migrator.MigrationError, match=r"0002_b\.sql is older than 0003"):
            await migrator.migrate(conn, migrator.load_migrations(tmp_path))  # type: ignore[arg-type]
        cur = await conn.execute("select to_regclass('fl.b') is null")
        assert await cur.fetchone() == (True,)


def test_two_migrate_processes_at_once_both_succeed(empty_dsn: str) -> None:
    env = {**os.environ, "DATABASE_URL": empty_dsn, "LOG_FORMAT": "json"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "fenceline", "migrate"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results: list[tuple[int, Any, Any]] = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        results.append((p.returncode, out, err))
    assert [r[0] for r in results] == [0, 0], results
    outputs = sorted(r[1].strip() for r in results)
    # One of them did the work, the other waited on the lock and found nothing to do.
    assert outputs[0].startswith("applied ")
    assert outputs[1] == "database is up to date"
    with psycopg.connect(empty_dsn) as conn:
        count = conn.execute("select count(*) from fl.schema_migrations").fetchone()
    assert count is not None and count[0] == len(SHIPPED)
