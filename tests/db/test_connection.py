"""TrioConnection against a real PostgreSQL: queries, transactions, cancellation, COPY, close.

Cancellation is the point of this module: a Trio cancel scope around a query must cancel it
on the server, and the connection must come back IDLE (or closed), never wedged.
"""

from __future__ import annotations

import contextlib
from contextlib import aclosing
from typing import Any

import anyio
import psycopg
import pytest
import trio
import trio.testing
from psycopg import pq
from psycopg.rows import dict_row

from fenceline.db.connection import ConnectionLock, TrioConnection, connect

IDLE = pq.TransactionStatus.IDLE
INERROR = pq.TransactionStatus.INERROR

Conn = TrioConnection[Any]


async def fetch1(conn: Conn, query: str, params: Any = None) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def backend_state(observer: Conn, pid: int) -> tuple[str | None, str | None]:
    cur = await observer.execute("select state, query from pg_stat_activity where pid = %s", (pid,))
    row = await cur.fetchone()
    return (row[0], row[1]) if row else (None, None)


@pytest.fixture
async def observer(dsn: str) -> Any:
    """A second connection to look at the first one from the server's side."""
    async with await connect(dsn) as other:
        yield other


@pytest.fixture
async def counter_table(conn: Conn) -> str:
    await conn.execute("create table counter (id int primary key, n int not null)")
    await conn.execute("insert into counter values (1, 0)")
    return "counter"


# --- basics --------------------------------------------------------------------------------


async def test_defaults_are_autocommit_and_no_prepared_statements(conn: Conn) -> None:
    assert conn.autocommit
    assert conn.prepare_threshold is None
    assert isinstance(conn.lock, ConnectionLock)
    assert await fetch1(conn, "select 1 + %s", (1,)) == 2
    assert conn.pgconn.transaction_status == IDLE


async def test_row_factory_passes_through(dsn: str) -> None:
    async with await connect(dsn, row_factory=dict_row) as conn:
        cur = await conn.execute("select 1 as a, 'x' as b")
        assert await cur.fetchone() == {"a": 1, "b": "x"}


async def test_class_connect_keeps_psycopg_defaults(dsn: str) -> None:
    async with await TrioConnection.connect(dsn) as conn:
        assert not conn.autocommit
        await conn.execute("select 1")
        assert conn.pgconn.transaction_status == pq.TransactionStatus.INTRANS
    # __aexit__ committed and closed
    assert conn.closed


async def test_connection_refused_is_operational_error() -> None:
    with pytest.raises(psycopg.OperationalError):
        await connect("host=127.0.0.1 port=1 dbname=x user=x connect_timeout=2")


async def test_cancel_scope_aborts_a_hanging_connect() -> None:
    # A TCP listener that accepts but never speaks: libpq waits for the server's answer.
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    start = trio.current_time()
    try:
        with trio.move_on_after(0.2) as scope:
            await connect(f"host=127.0.0.1 port={port} dbname=x user=x")
        assert scope.cancelled_caught
        assert trio.current_time() - start < 2.0
    finally:
        for listener in listeners:
            await listener.aclose()


async def test_connect_timeout_raises_connection_timeout() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    try:
        with pytest.raises(psycopg.errors.ConnectionTimeout):
            # libpq's minimum is 2 s
            await connect(f"host=127.0.0.1 port={port} dbname=x user=x connect_timeout=1")
    finally:
        for listener in listeners:
            await listener.aclose()


async def test_concurrent_tasks_share_one_connection(conn: Conn) -> None:
    # Contended lock: asyncio.Lock fails here under Trio.
    results: list[int] = []

    async def one(i: int) -> None:
        results.append(await fetch1(conn, "select %s::int from pg_sleep(0.01)", (i,)))

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(one, i)
    assert sorted(results) == list(range(10))


async def test_many_tasks_with_own_connections(dsn: str, conn: Conn, counter_table: str) -> None:
    async def worker() -> None:
        async with await connect(dsn) as mine:
            for _ in range(20):
                async with mine.transaction():
                    await mine.execute("update counter set n = n + 1 where id = 1")

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(worker)
    assert await fetch1(conn, "select n from counter") == 400


# --- transactions --------------------------------------------------------------------------


async def test_transaction_commit_rollback_and_savepoints(conn: Conn) -> None:
    await conn.execute("create table t (v text)")
    async with conn.transaction():
        await conn.execute("insert into t values ('committed')")
    async with conn.transaction():
        await conn.execute("insert into t values ('rolled back')")
        raise psycopg.Rollback
    async with conn.transaction():
        await conn.execute("insert into t values ('outer')")
        with contextlib.suppress(psycopg.errors.UniqueViolation):
            async with conn.transaction():
                await conn.execute("insert into t values ('inner, rolled back')")
                await conn.execute("create unique index on t ((1))")  # fails: 2 rows
        async with conn.transaction():
            await conn.execute("insert into t values ('inner, kept')")
        async with conn.transaction(force_rollback=True):
            await conn.execute("insert into t values ('forced rollback')")
    cur = await conn.execute("select v from t order by v")
    assert [r[0] for r in await cur.fetchall()] == ["committed", "inner, kept", "outer"]
    assert conn.pgconn.transaction_status == IDLE


async def test_cancelled_transaction_body_rolls_back(conn: Conn) -> None:
    await conn.execute("create table t (v int)")
    with trio.CancelScope() as scope:
        async with conn.transaction():
            await conn.execute("insert into t values (1)")
            scope.cancel()
            await trio.lowlevel.checkpoint()
    # The ROLLBACK ran although the scope was cancelled (cleanup mode).
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select count(*) from t") == 0


async def test_cancel_landing_on_commit(conn: Conn) -> None:
    # A deferred constraint trigger makes COMMIT itself slow, so the deadline hits it.
    await conn.execute("create table t (v int)")
    await conn.execute(
        "create function slow() returns trigger language plpgsql as"
        " $$ begin perform pg_sleep(10); return null; end $$"
    )
    await conn.execute(
        "create constraint trigger slow after insert on t deferrable initially deferred"
        " for each row execute function slow()"
    )
    with trio.move_on_after(0.3) as scope:
        async with conn.transaction():
            await conn.execute("insert into t values (1)")
    assert scope.cancelled_caught
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select count(*) from t") == 0


# --- cancellation of running queries -------------------------------------------------------


async def test_cancel_running_query_cancels_it_on_the_server(conn: Conn, observer: Conn) -> None:
    pid = conn.info.backend_pid
    start = trio.current_time()
    with trio.move_on_after(0.3) as scope:
        await conn.execute("select pg_sleep(10)")
    elapsed = trio.current_time() - start
    assert scope.cancelled_caught
    assert elapsed < 3.0, f"took {elapsed:.2f} s to give up a 0.3 s scope"
    assert conn.pgconn.transaction_status == IDLE
    state, query = await backend_state(observer, pid)
    assert state == "idle", (state, query)
    assert await fetch1(conn, "select 42") == 42


async def test_cancel_inside_transaction_releases_row_lock(
    conn: Conn, observer: Conn, counter_table: str
) -> None:
    with trio.move_on_after(0.3) as scope:
        async with conn.transaction():
            await conn.execute("update counter set n = 100 where id = 1")
            await conn.execute("select pg_sleep(10)")
    assert scope.cancelled_caught
    assert conn.pgconn.transaction_status == IDLE
    state, query = await backend_state(observer, conn.info.backend_pid)
    assert (state, query) == ("idle", "ROLLBACK")
    # Another session can take the row lock at once.
    await observer.execute("set lock_timeout = '2s'")
    await observer.execute("update counter set n = n + 1 where id = 1")
    assert await fetch1(conn, "select n from counter") == 1


async def test_cancelled_stream_leaves_connection_idle(conn: Conn, observer: Conn) -> None:
    seen = 0
    with trio.CancelScope() as scope:
        async with aclosing(conn.cursor().stream("select generate_series(1, 10000000)")) as rows:
            async for _ in rows:
                seen += 1
                if seen == 1000:
                    scope.cancel()  # the server is still producing rows
                    await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert seen == 1000
    assert conn.pgconn.transaction_status == IDLE
    assert (await backend_state(observer, conn.info.backend_pid))[0] == "idle"
    assert await fetch1(conn, "select 42") == 42


async def test_query_in_cancelled_scope_leaves_connection_usable(conn: Conn) -> None:
    # The query is sent, then cancelled on the server at its first wait.
    with trio.CancelScope() as scope:
        scope.cancel()
        await conn.execute("select pg_sleep(10)")
    assert scope.cancelled_caught
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select 1") == 1


async def test_a_lost_cancel_request_is_sent_again(conn: Conn,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL ignores a cancel request that arrives before the backend has started the
    command (seen under load: the query then ran its full 10 s and the connection was
    abandoned). Lose the first request on purpose: the second one must end the query."""
    real = TrioConnection._cancel_now
    sent: list[float] = []

    async def lossy(self: TrioConnection[Any], *, limit: float | None) -> None:
        sent.append(trio.current_time())
        if len(sent) > 1:
            await real(self, limit=limit)

    monkeypatch.setattr(TrioConnection, "_cancel_now", lossy)
    began = trio.current_time()
    with trio.move_on_after(0.2):
        await conn.execute("select pg_sleep(10)")
    assert len(sent) == 2
    assert trio.current_time() - began < 3
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select 1") == 1


async def test_query_in_except_block_of_cancelled_task_runs(conn: Conn) -> None:
    """Cleanup mode: code handling an exception in a cancelled scope can still talk."""
    await conn.execute("create table log (v text)")
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled:
            await conn.execute("insert into log values ('cleanup ran')")
            raise
    assert await fetch1(conn, "select v from log") == "cleanup ran"


async def test_anyio_cancel_scope_cancels_query(conn: Conn) -> None:
    with anyio.move_on_after(0.2) as scope:
        await conn.execute("select pg_sleep(10)")
    assert scope.cancelled_caught
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select 42") == 42


async def test_server_side_cursor(conn: Conn) -> None:
    async with conn.transaction(), conn.cursor("big") as cur:
        await cur.execute("select generate_series(1, 1000)")
        assert len(await cur.fetchmany(100)) == 100
        assert len(await cur.fetchall()) == 900
    assert conn.pgconn.transaction_status == IDLE


# --- pipeline, executemany, COPY -----------------------------------------------------------


async def test_pipeline_and_executemany(conn: Conn) -> None:
    await conn.execute("create table t (v int)")
    async with conn.pipeline():
        for i in range(500):
            await conn.execute("insert into t values (%s)", (i,))
    await conn.cursor().executemany("insert into t values (%s)", [(i,) for i in range(1000)])
    assert await fetch1(conn, "select count(*) from t") == 1500
    assert conn.pgconn.pipeline_status == pq.PipelineStatus.OFF


async def test_copy_in_and_out(conn: Conn) -> None:
    await conn.execute("create table t (a int, b text)")
    cur = conn.cursor()
    async with cur.copy("copy t from stdin") as copy:
        for i in range(20000):
            await copy.write_row((i, f"row {i}"))
    assert cur.rowcount == 20000
    rows = 0
    async with cur.copy("copy t to stdout") as copy:
        async for _ in copy.rows():
            rows += 1
    assert rows == 20000
    assert conn.pgconn.transaction_status == IDLE


async def test_cancelled_copy_in_loads_nothing(conn: Conn) -> None:
    await conn.execute("create table t (a int)")
    with trio.CancelScope() as scope:
        async with conn.cursor().copy("copy t from stdin") as copy:
            for i in range(50000):
                await copy.write_row((i,))
                if i == 30000:
                    scope.cancel()
                    await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select count(*) from t") == 0


async def test_long_copy_loop_is_cancellable(conn: Conn) -> None:
    """write_row mostly fills libpq's buffer without waiting: the flushes must be cancel points."""
    await conn.execute("create table t (a int, b text)")
    start = trio.current_time()
    with trio.move_on_after(0.1) as scope:
        async with conn.cursor().copy("copy t from stdin") as copy:
            for i in range(10_000_000):
                await copy.write_row((i, "some text to make the rows a bit wider"))
    assert scope.cancelled_caught
    assert trio.current_time() - start < 3.0
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select count(*) from t") == 0


async def test_copy_out_left_unread_is_ended(conn: Conn) -> None:
    async with conn.cursor().copy("copy (select generate_series(1, 100000)) to stdout") as copy:
        await copy.read()  # one block, then leave
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select 42") == 42


async def test_cancel_right_after_copy_started_aborts_it(conn: Conn) -> None:
    """Rule 6: Cancelled before the Copy object exists (psycopg leaves it ACTIVE)."""
    await conn.execute("create table t (a int)")
    with trio.CancelScope() as scope:
        # The scope is cancelled before the block body, right as the COPY starts.
        async with conn.cursor().copy("copy t from stdin") as copy:
            scope.cancel()
            await copy.write_row((1,))
            await trio.lowlevel.checkpoint()
    assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(conn, "select count(*) from t") == 0


# --- notifications and close ---------------------------------------------------------------


async def test_notifies_timeout_and_delivery(conn: Conn, observer: Conn) -> None:
    await conn.execute("listen ch")
    got = [n async for n in conn.notifies(timeout=0.05)]
    assert got == []
    await observer.execute("select pg_notify('ch', 'hello')")
    async with aclosing(conn.notifies(timeout=5, stop_after=1)) as gen:
        got = [n async for n in gen]
    assert [(n.channel, n.payload) for n in got] == [("ch", "hello")]


async def test_notify_received_while_busy_is_delivered_later(conn: Conn, observer: Conn) -> None:
    await conn.execute("listen ch")
    await observer.execute("select pg_notify('ch', 'early')")
    await fetch1(conn, "select pg_sleep(0.05)")
    async with aclosing(conn.notifies(timeout=5, stop_after=1)) as gen:
        assert [n.payload async for n in gen] == ["early"]


async def test_close_wakes_task_blocked_in_notifies(conn: Conn) -> None:
    await conn.execute("listen ch")
    raised: list[BaseException] = []

    async def listen() -> None:
        try:
            async with aclosing(conn.notifies()) as gen:
                async for _ in gen:
                    pass
        except psycopg.OperationalError as ex:
            raised.append(ex)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(listen)
        await trio.testing.wait_all_tasks_blocked()
        await conn.close()
    assert len(raised) == 1
    assert conn.closed


async def test_cancel_scope_around_notifies(conn: Conn) -> None:
    await conn.execute("listen ch")
    with trio.move_on_after(0.05) as scope:
        async with aclosing(conn.notifies()) as gen:
            async for _ in gen:
                pass
    assert scope.cancelled_caught
    assert await fetch1(conn, "select 1") == 1


async def test_terminated_backend_raises_operational_error(conn: Conn, observer: Conn) -> None:
    await observer.execute("select pg_terminate_backend(%s)", (conn.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        await conn.execute("select 1")
    assert conn.closed and conn.broken


# --- the lock ------------------------------------------------------------------------------


async def test_lock_is_fifo_and_ownerless() -> None:
    lock = ConnectionLock()
    order: list[int] = []
    await lock.acquire()  # no checkpoint when free

    async def waiter(i: int) -> None:
        async with lock:
            order.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(waiter, i)
            await trio.testing.wait_all_tasks_blocked()
        assert lock.locked()
        nursery.start_soon(trio.to_thread.run_sync, lambda: None)  # unrelated work
        lock.release()  # released by a task that is not a waiter: allowed
    assert order == [0, 1, 2]
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()


async def test_lock_free_path_has_no_checkpoint() -> None:
    lock = ConnectionLock()
    with trio.CancelScope() as scope:
        scope.cancel()
        await lock.acquire()  # would raise Cancelled if it were a checkpoint
        lock.release()
    assert not scope.cancelled_caught
