"""``fenceline bench``: burn-down and latency against the user's own installation.

It creates a scratch organization, project and queue (named ``fenceline-bench-<random>``),
measures, and deletes them again (cascading to their jobs), so it leaves nothing behind in
a real database. Two phases:

- burn-down: N noop jobs are inserted in one statement (timed on its own), then one worker
  with the given concurrency drains them; jobs/s from the first claim to the last completion;
- latency: one job at a time at a fixed rate while the worker idles; submit-to-start
  (handler entry) p50/p95/p99, with each job's submit time taken from the database clock
  at insert and its start from the worker's clock (same machine: same clock).

For comparisons with other queues, see bench/ in the repository; this command answers
"how fast is fenceline on my database", not "how fast compared to X".
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TextIO

import trio

from fenceline.db import migrator
from fenceline.db.connection import connect
from fenceline.errors import ConfigError
from fenceline.worker.job import Job
from fenceline.worker.runtime import Worker


@dataclass
class BenchResult:
    jobs: int
    concurrency: int
    insert_s: float
    burn_s: float
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.burn_s if self.burn_s > 0 else 0.0

    def percentile(self, q: float) -> float:
        data = sorted(self.latencies_ms)
        if not data:
            return float("nan")
        k = min(len(data) - 1, max(0, round(q / 100 * (len(data) - 1))))
        return data[k]


async def _scratch_queue(conn: Any) -> tuple[uuid.UUID, uuid.UUID]:
    name = f"fenceline-bench-{uuid.uuid4().hex[:8]}"
    cur = await conn.execute(
        """
        with o as (insert into fl.organizations (name) values (%(n)s) returning id),
             p as (insert into fl.projects (org_id, name) select id, %(n)s from o returning id),
             r as (insert into fl.retry_policies (project_id, name)
                   select id, 'default' from p returning id, project_id)
        insert into fl.queues (project_id, retry_policy_id, name)
        select project_id, id, %(n)s from r
        returning id, (select id from o)
        """,
        {"n": name},
    )
    row = await cur.fetchone()
    assert row is not None
    return row[0], row[1]


async def run_bench(dsn: str, *, jobs: int, concurrency: int, latency_jobs: int,
                    rate: float, out: TextIO = sys.stdout) -> BenchResult:
    conn = await connect(dsn, application_name="fenceline bench")
    async with conn:
        if not (await migrator.status(conn)).current:
            raise ConfigError("the database is not migrated: run fenceline migrate first")
        queue_id, org_id = await _scratch_queue(conn)
        try:
            return await _measure(dsn, conn, queue_id, jobs=jobs, concurrency=concurrency,
                                  latency_jobs=latency_jobs, rate=rate, out=out)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                # Jobs first: their retry-policy foreign key does not cascade.
                await conn.execute("delete from fl.jobs where queue_id = %s", (queue_id,))
                await conn.execute("delete from fl.organizations where id = %s", (org_id,))


async def _measure(dsn: str, conn: Any, queue_id: uuid.UUID, *, jobs: int, concurrency: int,
                   latency_jobs: int, rate: float, out: TextIO) -> BenchResult:
    began = time.perf_counter()
    await conn.execute(
        "select fl.submit(%s, 'noop') from generate_series(1, %s)", (queue_id, jobs))
    insert_s = time.perf_counter() - began

    done = 0
    first_start: float | None = None
    last_done = 0.0
    starts: dict[int, float] = {}
    all_done, latency_done = trio.Event(), trio.Event()

    worker = Worker(str(queue_id), concurrency=concurrency, drain_timeout=5)

    @worker.handler("noop")
    async def noop(job: Job) -> None:
        nonlocal done, first_start, last_done
        now = time.time()
        if first_start is None:
            first_start = time.perf_counter()
        if isinstance(job.payload, dict) and "submitted" in job.payload:
            starts[job.id] = now - float(job.payload["submitted"])
            if len(starts) == latency_jobs:
                latency_done.set()
        done += 1
        last_done = time.perf_counter()
        if done == jobs:
            all_done.set()

    draining = trio.Event()
    result = BenchResult(jobs=jobs, concurrency=concurrency, insert_s=insert_s, burn_s=0.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: worker.run(dsn, draining=draining,
                                                           task_status=task_status))
        nursery.start_soon(_progress, lambda: done, jobs, out)
        await all_done.wait()
        assert first_start is not None
        result.burn_s = last_done - first_start
        if out.isatty():
            print(file=out)

        # Latency: one job at a time; "submitted" is the database clock at insert.
        interval = 1.0 / rate
        for i in range(latency_jobs):
            await conn.execute(
                "select fl.submit(%s, 'noop', jsonb_build_object('submitted',"
                " extract(epoch from clock_timestamp())))", (queue_id,))
            if out.isatty():
                out.write(f"\rlatency: {i + 1}/{latency_jobs}")
                out.flush()
            await trio.sleep(interval)
        with trio.move_on_after(10):
            await latency_done.wait()
        if out.isatty():
            print(file=out)
        result.latencies_ms = [v * 1000 for v in starts.values()]
        draining.set()
    return result


async def _progress(count: Any, total: int, out: TextIO) -> None:
    """A live line on a terminal; a line every few seconds anywhere else."""
    live = out.isatty()
    began = time.perf_counter()
    while True:
        n = min(count(), total)
        elapsed = time.perf_counter() - began
        rate = n / elapsed if elapsed > 0 else 0.0
        line = f"burn-down: {n}/{total} jobs  {rate:,.0f} jobs/s"
        out.write(f"\r{line}" if live else f"{line}\n")
        out.flush()
        if n >= total:
            return
        await trio.sleep(0.25 if live else 5.0)


def report(result: BenchResult, out: TextIO = sys.stdout) -> None:
    rows = [
        ("jobs", f"{result.jobs}"),
        ("concurrency", f"{result.concurrency}"),
        ("insert (one statement)", f"{result.insert_s:.2f} s"),
        ("burn-down", f"{result.jobs_per_s:,.0f} jobs/s ({result.burn_s:.2f} s)"),
        ("submit-to-start p50", f"{result.percentile(50):.1f} ms"),
        ("submit-to-start p95", f"{result.percentile(95):.1f} ms"),
        ("submit-to-start p99", f"{result.percentile(99):.1f} ms"),
        ("latency samples", f"{len(result.latencies_ms)}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}", file=out)
    if result.latencies_ms:
        spread = statistics.pstdev(result.latencies_ms)
        print(f"{'latency stdev':<{width}}  {spread:.1f} ms", file=out)
