"""pgqueuer adapter: runs inside bench/.venvs/pgqueuer (see bench/peers.py for the pins).

Settings, all from pgqueuer's own documentation (docs/ in github.com/janbjorge/pgqueuer):

- Driver: one asyncpg connection for the worker. docs/guides/deployment.md ("Single Worker
  Process": `asyncpg.connect()` + `AsyncpgDriver` + `PgQueuer`) and
  docs/guides/performance-tuning.md: "Use a dedicated connection for LISTEN ... Always use a
  direct asyncpg connection (not a pool) for the QueueManager"; checklist: "AsyncpgPoolDriver
  for producers; a single connection for QueueManager".
- Worker entry: `pgqueuer.run(factory, ...)`, documented as "Run a worker from *factory*, as
  `pgq run` does, without the CLI", on uvloop like `pgq run` (pgqueuer.adapters.cli.cli
  asyncio_run).
- batch_size 8, max_concurrent_tasks 16: performance-tuning.md "Increase batch_size when jobs
  are short-lived (< 1 s)" and "max_concurrent_tasks must be at least 2 x batch_size;
  PgQueuer enforces this". With the benchmark's total concurrency of 16, 8 is the largest
  batch pgqueuer accepts (its default is 10, which 16 does not allow).
- Everything else at its default: dequeue_timeout 30 s, heartbeat_timeout 30 s, durability
  "durable" (performance-tuning.md "Durability vs. Throughput": durable is the default).
- Schema: `pgq install` then `pgq autovac` (deployment.md checklist: "`pgq autovac` applied
  after installation"). Both are per-table settings, not server settings.
- Bulk enqueue: `Queries.enqueue` with lists ("Scalar args = single insert; lists = batch
  insert") over one asyncpg connection. The one-at-a-time producer uses `AsyncpgPoolDriver`
  (pool of 8): performance-tuning.md "Use AsyncpgPoolDriver for producers".
- Logging is not configured: pgqueuer logs per job only at DEBUG.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import _common

PEER = "pgqueuer"
ENTRYPOINT = "bench_noop"
BATCH_SIZE = 8
SETTINGS: dict[str, Any] = {
    "driver": "asyncpg, one connection (AsyncpgDriver)",
    "entry": "pgqueuer.run(factory) on uvloop, as `pgq run`",
    "batch_size": BATCH_SIZE,
    "max_concurrent_tasks": "= --concurrency (16)",
    "dequeue_timeout_s": 30,
    "heartbeat_timeout_s": 30,
    "durability": "durable (default)",
    "schema": "pgq install + pgq autovac",
    "enqueue": "Queries.enqueue(lists): one INSERT ... unnest for the whole batch",
    "producer": "Queries.enqueue(one job) over AsyncpgPoolDriver, pool of 8",
}
SOURCES = [
    "pgqueuer docs/guides/deployment.md (single worker process, deployment checklist)",
    "pgqueuer docs/guides/performance-tuning.md (batch_size, max_concurrent_tasks >= 2x batch,"
    " dedicated asyncpg connection, durability, pgq autovac)",
]
# Shaped for pgqueuer's own partial indexes (priority, id desc) where queued and (updated, id
# desc) where picked: a plain `exists(... where status = ...)` is planned as a sequential scan,
# which reads past every deleted row left in the table (autovacuum is off on the shared
# server) on each 5 ms probe and takes CPU from the worker being measured.
REMAINING_SQL = (
    "exists(select 1 from (select 1 from pgqueuer where status = 'queued'"
    " order by priority, id desc limit 1) q)"
    " or exists(select 1 from (select 1 from pgqueuer where status = 'picked'"
    " order by updated, id desc limit 1) p)"
)


def run_async(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


async def connect(dsn: str) -> Any:
    import asyncpg

    return await asyncpg.connect(dsn)


async def setup(dsn: str) -> None:
    from pgqueuer import AsyncpgDriver, Queries

    conn = await connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        await queries.optimize_autovacuum()
    finally:
        await conn.close()


async def enqueue(dsn: str, n: int) -> float:
    from pgqueuer import AsyncpgDriver, Queries

    conn = await connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(conn))
        payload = repr(time.time()).encode()
        t0 = time.perf_counter()
        await queries.enqueue([ENTRYPOINT] * n, [payload] * n, [0] * n)
        return time.perf_counter() - t0
    finally:
        await conn.close()


async def work(dsn: str, concurrency: int, records: list[_common.StartRecord]) -> None:
    import pgqueuer
    from pgqueuer import AsyncpgDriver, PgQueuer
    from pgqueuer.models import Job

    @asynccontextmanager
    async def factory() -> AsyncIterator[PgQueuer]:
        conn = await connect(dsn)
        pgq = PgQueuer(AsyncpgDriver(conn))

        @pgq.entrypoint(ENTRYPOINT)
        async def noop(job: Job) -> None:
            started = time.time()
            records.append((job.id, float(job.payload or b"0"), started))

        _common.emit_ready()
        try:
            yield pgq
        finally:
            await conn.close()

    # Without a shutdown event, pgqueuer.run installs its own SIGINT/SIGTERM handlers and
    # drains in-flight jobs before returning, as `pgq run` does.
    await pgqueuer.run(
        factory,
        batch_size=BATCH_SIZE,
        max_concurrent_tasks=concurrency,
        dequeue_timeout=timedelta(seconds=30),
        heartbeat_timeout=timedelta(seconds=30),
    )


async def produce(dsn: str, rate: float, seconds: float) -> dict[str, float]:
    import asyncpg
    from pgqueuer import AsyncpgPoolDriver, Queries

    # performance-tuning.md checklist: "Use AsyncpgPoolDriver for producers".
    pool = await asyncpg.create_pool(
        dsn, min_size=_common.PRODUCER_POOL, max_size=_common.PRODUCER_POOL
    )
    try:
        queries = Queries(AsyncpgPoolDriver(pool))

        async def submit(ts: float) -> None:
            await queries.enqueue(ENTRYPOINT, repr(ts).encode())

        return await _common.paced(rate, seconds, submit)
    finally:
        await pool.close()


def main(argv: list[str] | None = None) -> None:
    args = _common.parse_args(PEER, argv)
    if args.command == "info":
        _common.emit_result(
            peer=PEER,
            versions=_common.installed_versions("pgqueuer", "asyncpg", "uvloop"),
            settings=SETTINGS,
            sources=SOURCES,
            remaining_sql=REMAINING_SQL,
        )
    elif args.command == "setup":
        run_async(setup(args.dsn))
        _common.emit_result(ok=True)
    elif args.command == "enqueue":
        seconds = run_async(enqueue(args.dsn, args.n))
        _common.emit_result(enqueued=args.n, seconds=seconds)
    elif args.command == "work":
        records: list[_common.StartRecord] = []
        run_async(work(args.dsn, args.concurrency, records))
        _common.write_records(args.records, records)
        _common.emit_result(handled=len(records), **_common.self_usage())
    elif args.command == "produce":
        _common.emit_result(**run_async(produce(args.dsn, args.rate, args.seconds)))
    else:  # pragma: no cover - argparse rejects unknown commands
        sys.exit(2)


if __name__ == "__main__":
    main()
