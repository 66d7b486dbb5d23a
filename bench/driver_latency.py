"""Driver latency and throughput: Trio-native TrioConnection vs the alternatives.

Variants (letters as in docs/reference feasibility §1.2):

  (a) fenceline.db.connection.TrioConnection under trio (native waits on the libpq socket)
  (d) psycopg.AsyncConnection under asyncio (the reference psycopg async path)
  (b) sync psycopg.Connection called through trio.to_thread.run_sync

Measurements, per variant and run:

  latency     ``select 1`` on one connection: --samples timed round trips after --warmup,
              median and p99 in microseconds, and the client process's CPU time per round
              trip (all threads), which a busy machine distorts much less than wall time;
  throughput  16 tasks, each with its own connection, each running --updates times
              ``UPDATE bench SET n = n + 1 WHERE id = $i RETURNING n`` on its own row;
              operations per second over the whole batch.

Every connection is autocommit with ``synchronous_commit = off`` (so the figures are about
the driver, not fsync) and ``prepare_threshold=None`` as fenceline uses it. Each (variant,
run) is a fresh subprocess; runs are interleaved (a, d, b, then d, b, a, ...) so that drift in
machine load hits every variant alike. The summary gives the median over runs and the
min-max range.

    python bench/driver_latency.py [--dsn DSN] [--runs 8] [--samples 5000] [--updates 1000]

The DSN defaults to $DATABASE_URL, $TEST_DATABASE_URL, then postgresql://postgres@127.0.0.1.
A scratch database is created and dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

TASKS = 16
VARIANTS = {
    "a": "(a) TrioConnection, native trio",
    "d": "(d) psycopg AsyncConnection, asyncio",
    "b": "(b) sync psycopg via trio.to_thread",
}
UPDATE = "update bench set n = n + 1 where id = %s returning n"
SETUP = "set synchronous_commit = off"


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def _latency_summary(samples_ns: list[int], cpu_s: float) -> dict[str, float]:
    values = sorted(ns / 1000 for ns in samples_ns)
    return {
        "median_us": statistics.median(values),
        "p99_us": _percentile(values, 0.99),
        # Client CPU (all threads) per round trip: much less sensitive to machine load than
        # wall-clock latency, so it shows the driver's own cost when the box is busy.
        "cpu_us": cpu_s * 1e6 / len(samples_ns),
    }


# --- workers: each runs in its own subprocess and prints one JSON line -------------------


def worker_a(dsn: str, samples: int, warmup: int, updates: int) -> dict[str, float]:
    import trio

    from fenceline.db.connection import connect

    async def main() -> dict[str, float]:
        conn = await connect(dsn)
        await conn.execute(SETUP)
        cur = conn.cursor()
        timings = []
        for i in range(warmup + samples):
            if i == warmup:
                cpu0 = time.process_time()
            t0 = time.perf_counter_ns()
            await cur.execute("select 1")
            await cur.fetchone()
            if i >= warmup:
                timings.append(time.perf_counter_ns() - t0)
        cpu = time.process_time() - cpu0
        await conn.close()
        result = _latency_summary(timings, cpu)

        conns = [await connect(dsn) for _ in range(TASKS)]
        for c in conns:
            await c.execute(SETUP)

        async def loop(c: Any, row: int) -> None:
            cur = c.cursor()
            for _ in range(updates):
                await cur.execute(UPDATE, (row,))
                await cur.fetchone()

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for row, c in enumerate(conns, 1):
                nursery.start_soon(loop, c, row)
        result["ops_per_s"] = TASKS * updates / (time.perf_counter() - t0)
        for c in conns:
            await c.close()
        return result

    return trio.run(main)


def worker_d(dsn: str, samples: int, warmup: int, updates: int) -> dict[str, float]:
    import asyncio

    async def main() -> dict[str, float]:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=None)
        await conn.execute(SETUP)
        cur = conn.cursor()
        timings = []
        for i in range(warmup + samples):
            if i == warmup:
                cpu0 = time.process_time()
            t0 = time.perf_counter_ns()
            await cur.execute("select 1")
            await cur.fetchone()
            if i >= warmup:
                timings.append(time.perf_counter_ns() - t0)
        cpu = time.process_time() - cpu0
        await conn.close()
        result = _latency_summary(timings, cpu)

        conns = [
            await psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=None)
            for _ in range(TASKS)
        ]
        for c in conns:
            await c.execute(SETUP)

        async def loop(c: Any, row: int) -> None:
            cur = c.cursor()
            for _ in range(updates):
                await cur.execute(UPDATE, (row,))
                await cur.fetchone()

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(c, row) for row, c in enumerate(conns, 1)))
        result["ops_per_s"] = TASKS * updates / (time.perf_counter() - t0)
        for c in conns:
            await c.close()
        return result

    return asyncio.run(main())


def worker_b(dsn: str, samples: int, warmup: int, updates: int) -> dict[str, float]:
    import trio

    def select1(conn: psycopg.Connection[Any]) -> None:
        cur = conn.execute("select 1")
        cur.fetchone()

    def update(conn: psycopg.Connection[Any], row: int) -> None:
        cur = conn.execute(UPDATE, (row,))
        cur.fetchone()

    async def main() -> dict[str, float]:
        conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
        conn.execute(SETUP)
        timings = []
        for i in range(warmup + samples):
            if i == warmup:
                cpu0 = time.process_time()
            t0 = time.perf_counter_ns()
            await trio.to_thread.run_sync(select1, conn)
            if i >= warmup:
                timings.append(time.perf_counter_ns() - t0)
        cpu = time.process_time() - cpu0
        conn.close()
        result = _latency_summary(timings, cpu)

        # A 16-connection "pool": one sync connection per task.
        conns = [psycopg.connect(dsn, autocommit=True, prepare_threshold=None) for _ in range(16)]
        for c in conns:
            c.execute(SETUP)
        limiter = trio.CapacityLimiter(TASKS)

        async def loop(c: psycopg.Connection[Any], row: int) -> None:
            for _ in range(updates):
                await trio.to_thread.run_sync(update, c, row, limiter=limiter)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for row, c in enumerate(conns, 1):
                nursery.start_soon(loop, c, row)
        result["ops_per_s"] = TASKS * updates / (time.perf_counter() - t0)
        for c in conns:
            c.close()
        return result

    return trio.run(main)


WORKERS: dict[str, Callable[[str, int, int, int], dict[str, float]]] = {
    "a": worker_a,
    "d": worker_d,
    "b": worker_b,
}


# --- the driver ----------------------------------------------------------------------------


def _machine() -> str:
    model = "?"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{platform.machine()} {model}, {os.cpu_count()} CPUs, {platform.platform()}"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _versions(dsn: str) -> str:
    import trio

    with psycopg.connect(dsn) as conn:
        server = conn.info.server_version
    return (
        f"Python {platform.python_version()}, trio {trio.__version__},"
        f" psycopg {psycopg.__version__} ({psycopg.pq.__impl__}, libpq {psycopg.pq.version()}),"
        f" PostgreSQL server {server // 10000}.{server % 10000}"
    )


def _fmt(values: list[float], digits: int = 0) -> str:
    med = statistics.median(values)
    return f"{med:,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("DATABASE_URL")
        or os.environ.get("TEST_DATABASE_URL")
        or "postgresql://postgres@127.0.0.1:5432/postgres",
    )
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--variants", default="adb")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = WORKERS[args.worker](args.dsn, args.samples, args.warmup, args.updates)
        print(json.dumps(result))
        return

    scratch = f"fl_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("create database {}").format(sql.Identifier(scratch)))
    dsn = make_conninfo(args.dsn, dbname=scratch)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("create table bench (id int primary key, n bigint not null)")
            conn.execute("insert into bench select g, 0 from generate_series(1, %s) g", (TASKS,))
        print("method: " + __doc__.split("\n\n")[2].strip().replace("\n", "\n        "))
        print(
            f"settings: {args.runs} interleaved runs; latency {args.samples} samples after"
            f" {args.warmup} warm-up; throughput {TASKS} tasks x {args.updates} updates;"
            " autocommit, synchronous_commit=off, prepare_threshold=None"
        )
        print(f"versions: {_versions(dsn)}")
        print(f"machine: {_machine()}")
        print(f"load average at start: {_load()}")

        variants = list(args.variants)
        results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        here = Path(__file__).resolve()
        for run in range(args.runs):
            order = variants[run % len(variants) :] + variants[: run % len(variants)]
            for v in order:
                out = subprocess.run(
                    [
                        sys.executable,
                        str(here),
                        "--worker",
                        v,
                        "--dsn",
                        dsn,
                        "--samples",
                        str(args.samples),
                        "--warmup",
                        str(args.warmup),
                        "--updates",
                        str(args.updates),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                    cwd=here.parent.parent,
                )
                results[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                f"  run {run + 1}: "
                + "; ".join(
                    f"{v} {results[v][-1]['median_us']:.0f} us"
                    f" (cpu {results[v][-1]['cpu_us']:.0f}), {results[v][-1]['ops_per_s']:,.0f}/s"
                    for v in variants
                ),
                flush=True,
            )
        print(f"load average at end: {_load()}")
        print()
        print(
            "| variant | select 1 median us | select 1 p99 us | client CPU us per select 1"
            " | UPDATE...RETURNING ops/s |"
        )
        print("|---|---|---|---|---|")
        for v in variants:
            rs = results[v]
            print(
                f"| {VARIANTS[v]} | {_fmt([r['median_us'] for r in rs])}"
                f" | {_fmt([r['p99_us'] for r in rs])}"
                f" | {_fmt([r['cpu_us'] for r in rs])}"
                f" | {_fmt([r['ops_per_s'] for r in rs])} |"
            )
        print("\nmedian (min-max) over runs")
        if "a" in results and "d" in results:
            thr = [
                a["ops_per_s"] / d["ops_per_s"]
                for a, d in zip(results["a"], results["d"], strict=True)
            ]
            lat = [
                a["median_us"] / d["median_us"]
                for a, d in zip(results["a"], results["d"], strict=True)
            ]
            print(
                f"paired a/d ratios per run: throughput {min(thr):.2f}-{max(thr):.2f}x,"
                f" latency {min(lat):.2f}-{max(lat):.2f}x"
            )
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(scratch))
            )


if __name__ == "__main__":
    main()
