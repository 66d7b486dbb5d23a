"""The Trio pool against a real PostgreSQL: limits, timeouts, cancellation, broken backends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from psycopg import pq
from psycopg.rows import dict_row

from fenceline.db.connection import TrioConnection, connect
from fenceline.db.pool import Pool, PoolClosed, PoolStats, PoolTimeout, open_pool

IDLE = pq.TransactionStatus.IDLE

Conn = TrioConnection[Any]


async def fetch1(conn: Conn, query: str, params: Any = None) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
async def admin(dsn: str) -> AsyncIterator[Conn]:
    async with await connect(dsn) as conn:
        yield conn


async def test_many_tasks_share_few_connections(dsn: str, admin: Conn) -> None:
    await admin.execute("create table counter (id int primary key, n int not null)")
    await admin.execute("insert into counter values (1, 0)")

    async with open_pool(dsn, max_size=8, name="busy") as pool:

        async def worker() -> None:
            for _ in range(20):
                async with pool.connection() as conn, conn.transaction():
                    await conn.execute("update counter set n = n + 1 where id = 1")

        async with trio.open_nursery() as nursery:
            for _ in range(64):
                nursery.start_soon(worker)
        stats = pool.statistics()

    assert await fetch1(admin, "select n from counter") == 64 * 20
    assert stats.connects <= 8
    assert stats == PoolStats(
        size=stats.connects,
        idle=stats.connects,
        in_use=0,
        waiting=0,
        connects=stats.connects,
        discards=0,
        timeouts=0,
    )


async def test_exhausted_pool_times_out_with_a_clear_message(dsn: str) -> None:
    async with open_pool(dsn, max_size=2, timeout=0.2, name="tiny") as pool:
        async with pool.connection(), pool.connection():
            start = trio.current_time()
            with pytest.raises(PoolTimeout) as info:
                async with pool.connection():
                    pass
            waited = trio.current_time() - start
        message = str(info.value)
        assert message.startswith("pool 'tiny' (max_size=2): no connection free after waiting 0.")
        assert "2 in use" in message
        assert waited >= 0.2
        assert pool.statistics().timeouts == 1
        # The pool still works afterwards.
        async with pool.connection() as conn:
            assert await fetch1(conn, "select 1") == 1


async def test_waiter_gets_the_connection_released_by_another(dsn: str) -> None:
    async with open_pool(dsn, max_size=1, timeout=5) as pool:
        got: list[int] = []

        async def second() -> None:
            async with pool.connection() as conn:
                got.append(conn.info.backend_pid)

        async with trio.open_nursery() as nursery, pool.connection() as conn:
            first_pid = conn.info.backend_pid
            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.statistics().waiting == 1
        assert got == [first_pid]


async def test_cancel_mid_query_leaves_next_checkout_idle(dsn: str, admin: Conn) -> None:
    async with open_pool(dsn, max_size=1) as pool:
        with trio.move_on_after(0.3) as scope:
            async with pool.connection() as conn:
                pid = conn.info.backend_pid
                await conn.execute("select pg_sleep(10)")
        assert scope.cancelled_caught
        async with pool.connection() as conn:
            assert conn.info.backend_pid == pid  # kept, not discarded
            assert conn.pgconn.transaction_status == IDLE
            assert await fetch1(conn, "select 42") == 42
        cur = await admin.execute("select state from pg_stat_activity where pid = %s", (pid,))
        assert await cur.fetchone() == ("idle",)
        assert pool.statistics().discards == 0


async def test_cancel_inside_transaction_in_pool_rolls_back(dsn: str, admin: Conn) -> None:
    await admin.execute("create table t (v int)")
    async with open_pool(dsn, max_size=1) as pool:
        with trio.move_on_after(0.2):
            async with pool.connection() as conn, conn.transaction():
                await conn.execute("insert into t values (1)")
                await conn.execute("select pg_sleep(10)")
        async with pool.connection() as conn:
            assert conn.pgconn.transaction_status == IDLE
    assert await fetch1(admin, "select count(*) from t") == 0


async def test_checkin_rolls_back_a_transaction_left_open(dsn: str, admin: Conn) -> None:
    await admin.execute("create table t (v int)")
    async with open_pool(dsn, max_size=1) as pool:
        async with pool.connection() as conn:
            await conn.execute("begin")
            await conn.execute("insert into t values (1)")
        async with pool.connection() as conn:
            assert conn.pgconn.transaction_status == IDLE
        assert pool.statistics().discards == 0
    assert await fetch1(admin, "select count(*) from t") == 0


async def test_checkin_after_error_in_transaction(dsn: str) -> None:
    async with open_pool(dsn, max_size=1) as pool:
        async with pool.connection() as conn:
            await conn.execute("begin")
            with pytest.raises(psycopg.errors.DivisionByZero):
                await conn.execute("select 1 / 0")
            assert conn.pgconn.transaction_status == pq.TransactionStatus.INERROR
        async with pool.connection() as conn:
            assert await fetch1(conn, "select 1") == 1


async def test_terminated_idle_connections_are_replaced(dsn: str, admin: Conn) -> None:
    async with open_pool(dsn, max_size=7, name="victims") as pool:
        pids: list[int] = []

        async def hold(ready: trio.Event, release: trio.Event) -> None:
            async with pool.connection() as conn:
                pids.append(conn.info.backend_pid)
                ready.set()
                await release.wait()

        release = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(7):
                ready = trio.Event()
                nursery.start_soon(hold, ready, release)
                await ready.wait()
            release.set()
        assert pool.statistics().idle == 7

        # With a timeout, pg_terminate_backend waits until each backend has exited.
        await admin.execute(
            "select pg_terminate_backend(pid, 5000) from unnest(%s::int[]) pid", (pids,)
        )

        for _ in range(10):
            async with pool.connection() as conn:
                assert await fetch1(conn, "select 1") == 1
                assert conn.info.backend_pid not in pids
        stats = pool.statistics()
    assert stats.discards == 7
    assert stats.connects == 8


async def test_health_check_after_idle_period(
    dsn: str, admin: Conn, mock_clock: trio.testing.MockClock
) -> None:
    async with open_pool(dsn, max_size=2, check_after=30, max_idle=300) as pool:
        async with pool.connection() as conn:
            pid = conn.info.backend_pid
        mock_clock.jump(31)
        async with pool.connection() as conn:  # probed, fine, reused
            assert conn.info.backend_pid == pid
        mock_clock.jump(301)
        async with pool.connection() as conn:  # idle too long: closed, a new one opened
            assert conn.info.backend_pid != pid
        stats = pool.statistics()
    assert (stats.connects, stats.discards) == (2, 1)


async def test_close_pool(dsn: str) -> None:
    pool = Pool(dsn, max_size=2)
    async with pool.connection() as kept:
        async with pool.connection() as returned:
            pass
        assert returned.closed is False
        await pool.close()
        assert returned.closed  # idle connections closed at once
        assert not kept.closed  # in-use connections stay usable...
        assert await fetch1(kept, "select 1") == 1
    assert kept.closed  # ...and are closed when returned
    with pytest.raises(PoolClosed):
        async with pool.connection():
            pass
    assert pool.statistics().size == 0


async def test_connect_kwargs_row_factory(dsn: str) -> None:
    kwargs = {"row_factory": dict_row}
    async with open_pool(dsn, max_size=1, connect_kwargs=kwargs) as pool, pool.connection() as conn:
        cur = await conn.execute("select 1 as one")
        assert await cur.fetchone() == {"one": 1}
        assert conn.autocommit


async def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_size"):
        Pool("", max_size=0)
    with pytest.raises(ValueError, match="timeout"):
        Pool("", timeout=0)


async def test_connect_failure_frees_the_slot() -> None:
    pool = Pool("host=127.0.0.1 port=1 dbname=x user=x connect_timeout=2", max_size=1, timeout=1)
    for _ in range(2):
        with pytest.raises(psycopg.OperationalError) as info:
            async with pool.connection():
                pass
        assert not isinstance(info.value, PoolTimeout)
    assert pool.statistics().in_use == 0
