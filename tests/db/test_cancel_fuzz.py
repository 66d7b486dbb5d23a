"""Randomized cancellation fuzz for TrioConnection.

Four connections each run a seeded random sequence of operations: transactions, nested
transactions, pipelines, streams, COPY in and out, notifications, executemany and plain
queries. Every operation runs under a random 0-20 ms deadline, so it is cut at a random point:
before sending, while the server works, while results stream back, inside cleanup. After each
one the connection must be IDLE, out of pipeline mode and able to run ``select 1``; at the end
no backend of the test database may be busy.

This test is what found the problems the module comment of fenceline/db/connection.py lists.
Re-run it harder on every psycopg upgrade::

    FUZZ_OPS=1000 FUZZ_SEEDS=1,2,3 pytest tests/db/test_cancel_fuzz.py -s

(``FUZZ_OPS`` is per connection; the default, 4 x 100 operations, takes a few seconds.)
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import trio
from psycopg import pq

from fenceline.db.connection import TrioConnection, connect

Conn = TrioConnection[Any]
Op = Callable[[Conn, random.Random], Awaitable[None]]

OPS_PER_CONNECTION = int(os.environ.get("FUZZ_OPS", "100"))
SEEDS = [int(seed) for seed in os.environ.get("FUZZ_SEEDS", "1").split(",")]
CONNECTIONS = 4
MAX_DEADLINE = 0.020


async def op_query(conn: Conn, rng: random.Random) -> None:
    await conn.execute("select pg_sleep(%s)", (rng.choice([0, 0.002, 0.01, 0.03]),))


async def op_tx(conn: Conn, rng: random.Random) -> None:
    async with conn.transaction():
        await conn.execute("insert into fuzz (v) values (%s)", (rng.randrange(1000),))
        await conn.execute("update fuzz set v = v + 1 where id = (select max(id) from fuzz)")
        if rng.random() < 0.5:
            await conn.execute("select pg_sleep(0.005)")


async def op_nested_tx(conn: Conn, rng: random.Random) -> None:
    async with conn.transaction():
        await conn.execute("insert into fuzz (v) values (1)")
        async with conn.transaction():
            await conn.execute("insert into fuzz (v) values (2)")
            if rng.random() < 0.3:
                raise psycopg.Rollback
        try:
            async with conn.transaction():
                await conn.execute("select 1 / %s", (rng.choice([0, 1]),))
        except psycopg.errors.DivisionByZero:
            pass
        await conn.execute("select pg_sleep(0.002)")


async def op_pipeline(conn: Conn, rng: random.Random) -> None:
    async with conn.pipeline():
        for i in range(rng.randrange(1, 200)):
            await conn.execute("insert into fuzz (v, t) values (%s, %s)", (i, "p"))
        cur = await conn.execute("select count(*) from fuzz")
        await cur.fetchone()


async def op_tx_pipeline(conn: Conn, rng: random.Random) -> None:
    async with conn.transaction(), conn.pipeline():
        for i in range(rng.randrange(1, 50)):
            await conn.execute("insert into fuzz (v) values (%s)", (i,))


async def op_stream(conn: Conn, rng: random.Random) -> None:
    cur = conn.cursor()
    query = "select g, repeat('x', 50) from generate_series(1, %s) g"
    async with aclosing(cur.stream(query, (rng.choice([10, 1000, 100000]),))) as rows:
        async for _ in rows:
            pass


async def op_copy_in(conn: Conn, rng: random.Random) -> None:
    async with conn.cursor().copy("copy fuzz (v, t) from stdin") as copy:
        for i in range(rng.choice([1, 100, 5000, 50000])):
            await copy.write_row((i, "copy"))


async def op_copy_in_tx(conn: Conn, rng: random.Random) -> None:
    async with conn.transaction(), conn.cursor().copy("copy fuzz (v) from stdin") as copy:
        for i in range(rng.choice([10, 5000])):
            await copy.write_row((i,))


async def op_copy_out(conn: Conn, rng: random.Random) -> None:
    query = "copy (select g, repeat('y', 40) from generate_series(1, %s) g) to stdout"
    async with conn.cursor().copy(query, (rng.choice([10, 10000, 200000]),)) as copy:
        async for _ in copy:
            pass


async def op_notifies(conn: Conn, rng: random.Random) -> None:
    await conn.execute("listen fuzz")
    await conn.execute("select pg_notify('fuzz', %s)", (str(rng.random()),))
    async with aclosing(conn.notifies(timeout=rng.choice([0, 0.005, 0.05]))) as gen:
        async for _ in gen:
            pass


async def op_executemany(conn: Conn, rng: random.Random) -> None:
    rows = [(i, "many") for i in range(rng.choice([1, 50, 2000]))]
    await conn.cursor().executemany("insert into fuzz (v, t) values (%s, %s)", rows)


OPS: dict[str, Op] = {
    "query": op_query,
    "tx": op_tx,
    "nested_tx": op_nested_tx,
    "pipeline": op_pipeline,
    "tx_pipeline": op_tx_pipeline,
    "stream": op_stream,
    "copy_in": op_copy_in,
    "copy_in_tx": op_copy_in_tx,
    "copy_out": op_copy_out,
    "notifies": op_notifies,
    "executemany": op_executemany,
}


@dataclass
class Tally:
    ops: Counter[str] = field(default_factory=Counter)
    cancelled: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


async def check_clean(conn: Conn) -> str | None:
    """Why ``conn`` is not clean after an operation, or None."""
    if conn.closed:
        return "connection closed"
    status = conn.pgconn.transaction_status
    if status != pq.TransactionStatus.IDLE:
        return f"transaction status {pq.TransactionStatus(status).name}"
    if conn.pgconn.pipeline_status != pq.PipelineStatus.OFF or conn._pipeline is not None:
        return "still in pipeline mode"
    try:
        with trio.fail_after(5):
            cur = await conn.execute("select 1")
            if await cur.fetchone() != (1,):
                return "select 1 returned something else"
    except Exception as ex:
        return f"select 1 failed: {type(ex).__name__}: {ex}"
    return None


async def run_connection(dsn: str, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    conn = await connect(dsn)
    try:
        for i in range(OPS_PER_CONNECTION):
            name = rng.choice(sorted(OPS))
            deadline = rng.uniform(0, MAX_DEADLINE)
            tally.ops[name] += 1
            error: BaseException | None = None
            with trio.move_on_after(deadline) as scope:
                try:
                    await OPS[name](conn, rng)
                except psycopg.Error as ex:
                    # A cancel may surface as an error (e.g. QueryCanceled from a COPY the
                    # server had already aborted); what matters is the state afterwards.
                    error = ex
            if scope.cancelled_caught:
                tally.cancelled[name] += 1
            if error is not None:
                tally.errors[f"{name}: {type(error).__name__}"] += 1
            if (why := await check_clean(conn)) is not None:
                tally.failures.append(f"seed {seed} op {i} {name} (error: {error!r}): {why}")
                await conn.close()
                conn = await connect(dsn)
    finally:
        await conn.close()


@pytest.mark.parametrize("seed", SEEDS)
async def test_cancellation_fuzz(dsn: str, seed: int) -> None:
    async with await connect(dsn) as admin:
        await admin.execute("create table fuzz (id serial primary key, v int, t text)")

        tally = Tally()
        async with trio.open_nursery() as nursery:
            for n in range(CONNECTIONS):
                nursery.start_soon(run_connection, dsn, seed * 100 + n, tally)

        cur = await admin.execute(
            "select pid, state, query from pg_stat_activity"
            " where datname = current_database() and pid <> pg_backend_pid()"
            " and state is distinct from 'idle'"
        )
        busy = await cur.fetchall()

    total, cancelled = sum(tally.ops.values()), sum(tally.cancelled.values())
    print(
        f"\nfuzz seed {seed}: {total} ops, {cancelled} cancelled ({cancelled / total:.0%}),"
        f" {len(tally.failures)} failures; by op (cancelled/run): "
        + ", ".join(f"{k} {tally.cancelled[k]}/{v}" for k, v in sorted(tally.ops.items()))
        + f"; errors raised by ops: {dict(tally.errors)}"
    )
    assert tally.failures == []
    assert busy == []
    assert cancelled > total // 4, "the deadlines should cut a good share of the operations"
