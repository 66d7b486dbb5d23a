"""Fixtures for the SQL-level engine tests: sync psycopg, a steerable clock, factories.

Every test gets its own freshly migrated database (the root ``dsn`` fixture) and an
``Engine``: connections on which ``fl.now()`` is frozen and moves only when the test says so,
jitter is off, and small factories for organisations, queues, workers and jobs. Tests call the
``fl.*`` functions with plain SQL through it, as any client would.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

START = datetime(2026, 1, 1, tzinfo=UTC)
MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"

Row = dict[str, Any]

# Every table of the engine, for "nothing changed" checks.
TABLES = (
    "organizations",
    "projects",
    "retry_policies",
    "queues",
    "queue_state",
    "workers",
    "worker_queues",
    "jobs",
    "attempts",
    "attempt_logs",
    "leases",
    "dead_letters",
    "fence_violations",
    "events",
)


class Engine:
    """One test database: connections with a frozen clock, and helpers to drive ``fl.*``."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.now = START
        self._conns: list[psycopg.Connection[Row]] = []
        self.conn = self.connect()

    # -- connections and time -------------------------------------------------------------

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Row]:
        """A new connection whose fl.now() is the engine's current time."""
        conn = psycopg.connect(self.dsn, autocommit=autocommit, row_factory=dict_row)
        conn.execute(
            "select set_config('fl.testing', 'on', false), set_config('fl.jitter', 'off', false),"
            " set_config('fl.now', %s, false)",
            (self.now.isoformat(),),
        )
        if not autocommit:
            conn.commit()
        self._conns.append(conn)
        return conn

    def set_now(self, when: datetime) -> None:
        """Move fl.now() on every idle connection of this engine."""
        self.now = when
        for conn in self._conns:
            if conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                continue
            conn.execute("select set_config('fl.now', %s, false)", (when.isoformat(),))

    def advance(self, seconds: float) -> datetime:
        self.set_now(self.now + timedelta(seconds=seconds))
        return self.now

    def close(self) -> None:
        for conn in self._conns:
            conn.close()

    # -- plain queries ----------------------------------------------------------------------

    def rows(self, query: str, params: Any = None) -> list[Row]:
        return self.conn.execute(query, params).fetchall()

    def row(self, query: str, params: Any = None) -> Row:
        found = self.conn.execute(query, params).fetchone()
        assert found is not None, query
        return found

    def val(self, query: str, params: Any = None) -> Any:
        found = self.conn.execute(query, params).fetchone()
        assert found is not None, query
        return next(iter(found.values()))

    def job(self, job_id: int) -> Row:
        return self.row("select * from fl.jobs where id = %s", (job_id,))

    def snapshot(self) -> dict[str, Any]:
        """A fingerprint of every engine table (row count and a hash of the rows)."""
        out: dict[str, Any] = {}
        for table in TABLES:
            q = sql.SQL(
                "select count(*) as n, md5(coalesce(string_agg(t::text, '|' order by t::text), ''))"
                " as h from fl.{} t"
            ).format(sql.Identifier(table))
            out[table] = tuple(self.conn.execute(q).fetchone().values())  # type: ignore[union-attr]
        out["fl_queue_seq"] = self.val("select last_value from fl.jobs_id_seq")
        return out

    # -- factories ---------------------------------------------------------------------------

    def make_queue(self, *, policy: dict[str, Any] | None = None, **queue: Any) -> uuid.UUID:
        """An organisation, a project, a retry policy and a queue; returns the queue id."""
        org = self.val("insert into fl.organizations (name) values ('acme') returning id")
        project = self.val(
            "insert into fl.projects (org_id, name) values (%s, %s) returning id",
            (org, f"p-{uuid.uuid4().hex[:8]}"),
        )
        pol = {"base_delay_ms": 1000, "max_delay_ms": 3_600_000} | (policy or {})
        cols = sql.SQL(", ").join(sql.Identifier(k) for k in pol)
        vals = sql.SQL(", ").join(sql.Placeholder() for _ in pol)
        policy_id = self.val(
            sql.SQL(
                "insert into fl.retry_policies (project_id, name, {}) values (%s, 'default', {})"
                " returning id"
            ).format(cols, vals),
            (project, *pol.values()),
        )
        queue = {"name": f"q-{uuid.uuid4().hex[:8]}"} | queue
        qcols = sql.SQL(", ").join(sql.Identifier(k) for k in queue)
        qvals = sql.SQL(", ").join(sql.Placeholder() for _ in queue)
        return self.val(  # type: ignore[no-any-return]
            sql.SQL(
                "insert into fl.queues (project_id, retry_policy_id, {}) values (%s, %s, {})"
                " returning id"
            ).format(qcols, qvals),
            (project, policy_id, *queue.values()),
        )

    def worker(
        self,
        queues: list[uuid.UUID] | uuid.UUID,
        handlers: list[str] | None = None,
        concurrency: int = 16,
    ) -> uuid.UUID:
        qs = queues if isinstance(queues, list) else [queues]
        return self.val(  # type: ignore[no-any-return]
            "select fl.register_worker(%s, %s, 'test-host', 4242, %s)", (qs, handlers, concurrency)
        )

    def submit(self, queue: uuid.UUID, type_: str = "t", payload: Any = None, **kw: Any) -> int:
        r = self.submit_row(queue, type_, payload, **kw)
        assert r["outcome"] == "ok", r
        return r["job_id"]  # type: ignore[no-any-return]

    def submit_row(self, queue: uuid.UUID, type_: str = "t", payload: Any = None, **kw: Any) -> Row:
        args = {
            "p_queue": queue,
            "p_type": type_,
            "p_payload": psycopg.types.json.Jsonb(payload if payload is not None else {}),
        }
        args |= {f"p_{k}": v for k, v in kw.items()}
        names = sql.SQL(", ").join(
            sql.SQL("{} => {}").format(sql.Identifier(k), sql.Placeholder(k)) for k in args
        )
        return self.row(sql.SQL("select * from fl.submit({})").format(names), args)

    def claim_rows(
        self,
        queue: uuid.UUID,
        worker: uuid.UUID,
        types: list[str] | None = None,
        n: int = 1,
        lease: str = "30 seconds",
        conn: psycopg.Connection[Row] | None = None,
    ) -> list[Row]:
        c = conn or self.conn
        return c.execute(
            "select * from fl.claim(%s, %s, %s, %s, %s::interval)", (queue, worker, types, n, lease)
        ).fetchall()

    def claim(
        self,
        queue: uuid.UUID,
        worker: uuid.UUID,
        types: list[str] | None = None,
        n: int = 1,
        lease: str = "30 seconds",
        conn: psycopg.Connection[Row] | None = None,
    ) -> list[Row]:
        """The jobs claimed (outcome ok); an empty list when the gate said no."""
        return [
            r for r in self.claim_rows(queue, worker, types, n, lease, conn) if r["outcome"] == "ok"
        ]

    def claim_one(self, queue: uuid.UUID, worker: uuid.UUID, **kw: Any) -> Row:
        got = self.claim(queue, worker, **kw)
        assert len(got) == 1, got
        return got[0]

    def complete(
        self,
        worker: uuid.UUID,
        held: list[tuple[int, int]],
        results: list[Any] | None = None,
        conn: psycopg.Connection[Row] | None = None,
    ) -> list[str]:
        c = conn or self.conn
        res = None if results is None else [psycopg.types.json.Jsonb(r) for r in results]
        rows = c.execute(
            "select * from fl.complete(%s, %s::bigint[], %s::bigint[], %s::jsonb[])",
            (worker, [h[0] for h in held], [h[1] for h in held], res),
        ).fetchall()
        return [r["outcome"] for r in rows]

    def fail(
        self,
        worker: uuid.UUID,
        job_id: int,
        fence: int,
        kind: str = "retryable",
        message: str | None = "boom",
        error_class: str | None = None,
    ) -> Row:
        return self.row(
            "select * from fl.fail(%s, %s, %s, %s, %s, %s)",
            (worker, job_id, fence, kind, message, error_class),
        )

    def snooze(self, worker: uuid.UUID, job_id: int, fence: int, seconds: float) -> Row:
        return self.row("select * from fl.snooze(%s, %s, %s, %s)", (worker, job_id, fence, seconds))

    def extend(
        self,
        worker: uuid.UUID,
        held: list[tuple[int, int]],
        lease: str = "30 seconds",
        conn: psycopg.Connection[Row] | None = None,
    ) -> list[Row]:
        c = conn or self.conn
        return c.execute(
            "select * from fl.extend_leases(%s, %s::bigint[], %s::bigint[], %s::interval)",
            (worker, [h[0] for h in held], [h[1] for h in held], lease),
        ).fetchall()

    def release(self, worker: uuid.UUID, held: list[tuple[int, int]]) -> list[str]:
        rows = self.rows(
            "select * from fl.release(%s, %s::bigint[], %s::bigint[])",
            (worker, [h[0] for h in held], [h[1] for h in held]),
        )
        return [r["outcome"] for r in rows]

    def reap(self, limit: int = 100, conn: psycopg.Connection[Row] | None = None) -> list[Row]:
        c = conn or self.conn
        return c.execute("select * from fl.reap(%s)", (limit,)).fetchall()

    def cancel(self, job_id: int) -> Row:
        return self.row("select * from fl.cancel(%s)", (job_id,))

    def violations(self, job_id: int | None = None) -> list[Row]:
        if job_id is None:
            return self.rows("select * from fl.fence_violations order by id")
        return self.rows(
            "select * from fl.fence_violations where job_id = %s order by id", (job_id,)
        )

    def in_flight(self, queue: uuid.UUID) -> int:
        return self.val("select count(*) from fl.leases where queue_id = %s", (queue,))  # type: ignore[no-any-return]


def _fallback_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """Only for running this directory without the root harness: a database from migrations/."""
    import os

    admin = os.environ.get("TEST_DATABASE_URL", "host=127.0.0.1 user=postgres dbname=postgres")
    name = f"fl_engine_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin, dbname=name)
    try:
        with psycopg.connect(dsn) as c:
            for path in sorted(MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.sql")):
                with c.transaction():
                    c.execute(path.read_text())  # type: ignore[call-overload]
        yield dsn
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
            )


@pytest.fixture
def engine_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    try:
        yield request.getfixturevalue("dsn")
    except pytest.FixtureLookupError:
        yield from _fallback_dsn(request)


@pytest.fixture
def eng(engine_dsn: str) -> Iterator[Engine]:
    engine = Engine(engine_dsn)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def module_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """One migrated database shared by a module's tests (for tests that change nothing)."""
    try:
        server = request.getfixturevalue("server_dsn")
        template = request.getfixturevalue("template_db")
    except pytest.FixtureLookupError:
        yield from _fallback_dsn(request)
        return
    name = f"fl_engine_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as c:
        c.execute(
            sql.SQL("create database {} template {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    try:
        yield make_conninfo(server, dbname=name)
    finally:
        with psycopg.connect(server, autocommit=True) as c:
            c.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
            )


@pytest.fixture(scope="module")
def module_eng(module_dsn: str) -> Iterator[Engine]:
    engine = Engine(module_dsn)
    try:
        yield engine
    finally:
        engine.close()


class raises_sqlstate:
    """``with raises_sqlstate('FL001'):`` the block raises a database error with that code."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.error: psycopg.Error | None = None

    def __enter__(self) -> raises_sqlstate:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc is None:
            pytest.fail(f"expected SQLSTATE {self.code}, nothing was raised")
        if not isinstance(exc, psycopg.Error):
            return False
        if exc.sqlstate != self.code:
            pytest.fail(f"expected SQLSTATE {self.code}, got {exc.sqlstate}: {exc}")
        self.error = exc
        return True
