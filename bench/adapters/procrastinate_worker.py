"""procrastinate adapter: runs inside bench/.venvs/procrastinate (see bench/peers.py for pins).

Settings, all from procrastinate's own documentation (docs/ in
github.com/procrastinate-org/procrastinate):

- Connector: `PsycopgConnector` (docs/howto/basics/connector.md: the asynchronous psycopg 3
  connector; "the PsycopgConnector can handle all the parameters from the
  psycopg_pool.AsyncConnectionPool()"), psycopg installed with its binary extra.
- Pool size = concurrency + 1, kept open (min_size = max_size = 17): docs/discussions.md,
  "Mind the size of your PostgreSQL pool": "The shorter your average job execution time,
  the more your pool will need to contain as many connections as your concurrency (plus
  one)". The LISTEN connection is outside the pool.
- Worker: `app.run_worker_async(concurrency=16)` (docs/howto/basics/worker.md: "identically,
  use the code way"; docs/howto/concurrency.md: `concurrency=`), every other option at its
  default: listen_notify on, fetch_job_polling_interval 5 s, delete_jobs "never" (the
  default of docs/howto/production/delete_finished_jobs.md), the worker's own SIGINT/SIGTERM
  handlers for a graceful stop.
- Schema: `app.schema_manager.apply_schema_async()` (what `procrastinate schema --apply`
  runs).
- Bulk enqueue: `Task.batch_defer_async` (docs/howto/basics/batch_defer.md): one call, one
  statement for the whole batch.
- Logging is not configured, so the library's per-job INFO lines are not emitted (the CLI
  would log two lines per job at its default INFO level).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import _common

PEER = "procrastinate"
TASK_NAME = "bench_noop"
SETTINGS: dict[str, Any] = {
    "connector": "PsycopgConnector (psycopg 3 + psycopg_pool.AsyncConnectionPool)",
    "pool_min_size": "= --concurrency + 1 (17)",
    "pool_max_size": "= --concurrency + 1 (17)",
    "concurrency": "= --concurrency (16)",
    "listen_notify": True,
    "fetch_job_polling_interval_s": 5.0,
    "delete_jobs": "never (default)",
    "schema": "schema_manager.apply_schema_async()",
    "enqueue": "Task.batch_defer_async: one statement for the whole batch",
    "producer": "Task.defer_async(one job) over the connector's pool of 8",
}
SOURCES = [
    "procrastinate docs/howto/basics/connector.md (PsycopgConnector, pool arguments)",
    "procrastinate docs/discussions.md 'Mind the size of your PostgreSQL pool'"
    " (pool = concurrency + 1 for short jobs)",
    "procrastinate docs/howto/concurrency.md, docs/howto/basics/worker.md",
    "procrastinate docs/howto/basics/batch_defer.md",
]
# Shaped for procrastinate's partial index on (id, lock) where status is todo or doing: a plain
# `exists(...)` is planned as a sequential scan over every finished job, on each 5 ms probe.
REMAINING_SQL = (
    "exists(select 1 from (select 1 from procrastinate_jobs"
    " where status = any(array['todo', 'doing']::procrastinate_job_status[])"
    " order by id, lock limit 1) q)"
)


def make_app(dsn: str, pool_size: int, records: list[_common.StartRecord] | None = None) -> Any:
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=dsn, min_size=pool_size, max_size=pool_size
        )
    )

    @app.task(name=TASK_NAME, pass_context=True)
    async def noop(context: procrastinate.JobContext, ts: float) -> None:
        started = time.time()
        if records is not None:
            records.append((context.job.id, ts, started))

    return app


async def setup(dsn: str) -> None:
    app = make_app(dsn, 1)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


async def enqueue(dsn: str, n: int) -> float:
    app = make_app(dsn, 1)
    async with app.open_async():
        task = app.tasks[TASK_NAME]
        ts = time.time()
        t0 = time.perf_counter()
        await task.batch_defer_async(*({"ts": ts} for _ in range(n)))
        return time.perf_counter() - t0


async def work(dsn: str, concurrency: int, records: list[_common.StartRecord]) -> None:
    app = make_app(dsn, concurrency + 1, records)
    async with app.open_async():
        _common.emit_ready()
        await app.run_worker_async(concurrency=concurrency)


async def produce(dsn: str, rate: float, seconds: float) -> dict[str, float]:
    app = make_app(dsn, _common.PRODUCER_POOL)
    async with app.open_async():
        task = app.tasks[TASK_NAME]

        async def submit(ts: float) -> None:
            await task.defer_async(ts=ts)

        return await _common.paced(rate, seconds, submit)


def main(argv: list[str] | None = None) -> None:
    import asyncio

    args = _common.parse_args(PEER, argv)
    if args.command == "info":
        _common.emit_result(
            peer=PEER,
            versions=_common.installed_versions(
                "procrastinate", "psycopg", "psycopg-binary", "psycopg-pool"
            ),
            settings=SETTINGS,
            sources=SOURCES,
            remaining_sql=REMAINING_SQL,
        )
    elif args.command == "setup":
        asyncio.run(setup(args.dsn))
        _common.emit_result(ok=True)
    elif args.command == "enqueue":
        seconds = asyncio.run(enqueue(args.dsn, args.n))
        _common.emit_result(enqueued=args.n, seconds=seconds)
    elif args.command == "work":
        records: list[_common.StartRecord] = []
        asyncio.run(work(args.dsn, args.concurrency, records))
        _common.write_records(args.records, records)
        _common.emit_result(handled=len(records), **_common.self_usage())
    elif args.command == "produce":
        _common.emit_result(**asyncio.run(produce(args.dsn, args.rate, args.seconds)))
    else:  # pragma: no cover - argparse rejects unknown commands
        sys.exit(2)


if __name__ == "__main__":
    main()
