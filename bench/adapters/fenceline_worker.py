"""fenceline adapter: runs in the project's own venv (the harness's interpreter).

Settings (fenceline's own defaults, README "A worker in your own program" and
fenceline/worker/runtime.py):

- Schema: `fenceline.db.migrator.migrate` (what `fenceline migrate` and start-up run), then one
  organization, project, retry policy (table defaults: exponential, base 1 s, 5 attempts) and
  queue `bench/bench/bench` with no cap, no rate limit, breaker on (defaults), inserted in SQL
  as fenceline/benchmark.py does (there is no queue API yet).
- Worker: `fenceline.Worker(queue, concurrency=16)` with its defaults: lease 30 s (heartbeat
  every 10 s), poll interval 1 s behind LISTEN fl_queue, drain timeout 30 s. It claims exactly
  its free slots per call (fl.claim n = free), completes in batches (fl.complete with every
  completion that arrived while the previous flush ran), on two connections plus one LISTEN
  connection (fenceline's Trio driver over psycopg 3).
- Bulk enqueue: one statement, `select fl.submit(queue, 'noop', payload) from
  generate_series(1, N)` (README: jobs are submitted with fl.submit from any client).
- Producer: `fl.submit` one job per statement (autocommit), over 8 connections of the Trio
  driver, on the same open-loop schedule as `_common.paced`.
- Logging is not configured (fenceline logs nothing per job at INFO anyway).

Commands: see bench/adapters/_common.py. `remaining_sql` counts queued and running jobs (the
retry states cannot occur with a no-op handler, and would show up as missing jobs).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from typing import Any

import _common

PEER = "fenceline"
QUEUE_PATH = "bench/bench/bench"
JOB_TYPE = "noop"
SETTINGS: dict[str, Any] = {
    "worker": "fenceline.Worker(queue, concurrency=--concurrency (16)), defaults otherwise",
    "lease_s": 30,
    "poll_interval_s": "1 (behind LISTEN fl_queue)",
    "drain_timeout_s": 30,
    "connections": "claim + report + LISTEN (Trio driver over psycopg 3)",
    "queue": "no cap, no rate limit, breaker on (defaults); retry policy table defaults",
    "schema": "fenceline.db.migrator.migrate (all migrations), queue rows in SQL",
    "enqueue": "select fl.submit(q, 'noop', payload) from generate_series(1, N): one statement",
    "producer": "fl.submit, one job per autocommit statement, 8 Trio-driver connections",
}
SOURCES = [
    "README.md (A worker in your own program; jobs submitted with fl.submit from any client)",
    "fenceline/worker/runtime.py (Worker defaults), fenceline/benchmark.py (scratch queue SQL)",
]
# Through the claimable index and the lease table, not a scan of fl.jobs: fl.jobs keeps every
# finished job, and `exists(... status in ('queued', 'running'))` was planned as a sequential
# scan that read past the finished rows on every 5 ms probe (up to ~30 ms each on a churned
# table), taking CPU from the worker being measured. A running job always has a lease.
REMAINING_SQL = (
    "exists(select 1 from (select 1 from fl.jobs where status = 'queued'"
    " order by queue_id, type, priority desc, run_at, id limit 1) q)"
    " or exists(select 1 from (select 1 from fl.leases order by queue_id, job_id limit 1) l)"
)

QUEUE_SQL = """
with o as (insert into fl.organizations (name) values ('bench') returning id),
     p as (insert into fl.projects (org_id, name) select id, 'bench' from o returning id),
     r as (insert into fl.retry_policies (project_id, name)
           select id, 'default' from p returning id, project_id)
insert into fl.queues (project_id, retry_policy_id, name)
select project_id, id, 'bench' from r
returning id
"""


async def connect(dsn: str, name: str = "fenceline bench adapter") -> Any:
    from fenceline.db.connection import connect as fl_connect

    return await fl_connect(dsn, application_name=name)


async def queue_id(conn: Any) -> Any:
    from fenceline.engine import calls

    return await calls.resolve_queue(conn, QUEUE_PATH)


def migrations() -> Any:
    """The migrations to apply: the harness's pinned copy of HEAD's migrations/ when
    BENCH_FENCELINE_MIGRATIONS names one (other people edit the working tree's), else the
    working tree's."""
    from pathlib import Path

    from fenceline.db import migrator

    pinned = os.environ.get("BENCH_FENCELINE_MIGRATIONS")
    return migrator.load_migrations(Path(pinned) if pinned else None)  # type: ignore[arg-type]


async def setup(dsn: str) -> None:
    from fenceline.db import migrator

    conn = await connect(dsn)
    async with conn:
        await migrator.migrate(conn, migrations())
        await conn.execute(QUEUE_SQL)


async def enqueue(dsn: str, n: int) -> float:
    conn = await connect(dsn)
    async with conn:
        qid = await queue_id(conn)
        ts = time.time()
        t0 = time.perf_counter()
        await conn.execute(
            "select fl.submit(%s, %s, jsonb_build_object('ts', %s::float8))"
            " from generate_series(1, %s)",
            (qid, JOB_TYPE, ts, n),
        )
        return time.perf_counter() - t0


async def work(dsn: str, concurrency: int, records: list[_common.StartRecord]) -> None:
    import trio

    import fenceline

    worker = fenceline.Worker(QUEUE_PATH, concurrency=concurrency)

    @worker.handler(JOB_TYPE)
    async def noop(job: fenceline.Job) -> None:
        started = time.time()
        payload = job.payload if isinstance(job.payload, dict) else {}
        records.append((job.id, float(payload.get("ts", 0.0)), started))

    draining = trio.Event()
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    draining.set()
                    return

        nursery.start_soon(watch)
        await nursery.start(lambda task_status: worker.run(dsn, draining=draining,
                                                           task_status=task_status))
        # worker.run reports "started" once registered, listening and about to claim.
        _common.emit_ready()
        await draining.wait()
    # The nursery exits when worker.run has drained and returned.


async def produce(dsn: str, rate: float, seconds: float) -> dict[str, float]:
    """_common.paced, on Trio: each submission starts at its scheduled time as its own task
    and waits for one of PRODUCER_POOL connections; the timestamp is taken before the wait."""
    import trio

    conns = [await connect(dsn, "fenceline bench producer")
             for _ in range(_common.PRODUCER_POOL)]
    qid = await queue_id(conns[0])
    send, receive = trio.open_memory_channel[Any](len(conns))
    for c in conns:
        send.send_nowait(c)
    n = round(rate * seconds)
    interval = 1.0 / rate
    state = {"in_flight": 0, "max_in_flight": 0}

    async def one(ts: float) -> None:
        state["in_flight"] += 1
        try:
            conn = await receive.receive()
            try:
                await conn.execute(
                    "select fl.submit(%s, %s, jsonb_build_object('ts', %s::float8))",
                    (qid, JOB_TYPE, ts),
                )
            finally:
                send.send_nowait(conn)
        finally:
            state["in_flight"] -= 1

    t0 = time.monotonic()
    last = t0
    max_lag = 0.0
    try:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                delay = t0 + i * interval - time.monotonic()
                if delay > 0:
                    await trio.sleep(delay)
                else:
                    max_lag = max(max_lag, -delay)
                last = time.monotonic()
                nursery.start_soon(one, time.time())
                state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"] + 1)
    finally:
        for c in conns:
            await c.close()
    span = last - t0
    return {
        "submitted": n,
        "elapsed_s": time.monotonic() - t0,
        "achieved_rate_per_s": (n - 1) / span if n > 1 and span > 0 else float(n),
        "max_lag_ms": max_lag * 1000,
        "max_in_flight": state["max_in_flight"],
    }


def schema_version() -> dict[str, str]:
    """Which engine SQL ran: the migrations' combined checksum and the git state of the tree
    (other people edit migrations/ in this working tree, so HEAD alone does not say)."""
    import hashlib
    import subprocess

    from fenceline.db import migrator

    digest = hashlib.sha256()
    try:
        found = migrations()
    except migrator.MigrationError as exc:
        return {"migrations": f"unusable: {exc}"}
    for m in found:
        digest.update(m.checksum.encode())
    try:
        git = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
            timeout=10, check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "migrations"], capture_output=True,
            text=True, timeout=10, check=False,
        ).stdout.split()
    except OSError:
        git, dirty = "unknown", []
    pinned = os.environ.get("BENCH_FENCELINE_MIGRATIONS_COMMIT")
    return {
        "migrations": f"{len(found)} files ({found[-1].filename} last), "
        f"sha256 {digest.hexdigest()[:12]}",
        "migrations_from": f"git {pinned} (pinned by the harness)" if pinned
        else "working tree",
        "git": git,
        "working_tree_migrations_uncommitted": " ".join(dirty[1::2]) or "none",
    }


def main(argv: list[str] | None = None) -> None:
    args = _common.parse_args(PEER, argv)
    if args.command == "info":
        _common.emit_result(
            peer=PEER,
            versions={
                **_common.installed_versions("fenceline", "psycopg", "psycopg-binary", "trio"),
                **schema_version(),
            },
            settings=SETTINGS,
            sources=SOURCES,
            remaining_sql=REMAINING_SQL,
        )
        return
    import trio

    if args.command == "setup":
        trio.run(setup, args.dsn)
        _common.emit_result(ok=True)
    elif args.command == "enqueue":
        seconds = trio.run(enqueue, args.dsn, args.n)
        _common.emit_result(enqueued=args.n, seconds=seconds)
    elif args.command == "work":
        records: list[_common.StartRecord] = []
        trio.run(work, args.dsn, args.concurrency, records)
        _common.write_records(args.records, records)
        _common.emit_result(handled=len(records), **_common.self_usage())
    elif args.command == "produce":
        out = trio.run(produce, args.dsn, args.rate, args.seconds)
        _common.emit_result(**{k: v for k, v in out.items() if not math.isnan(v)})
    else:  # pragma: no cover - argparse rejects unknown commands
        sys.exit(2)


if __name__ == "__main__":
    main()
