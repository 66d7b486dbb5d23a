"""What fenceline's commits per job are made of, in a burn-down (a profiling aid).

A fresh database (HEAD's migrations, like the harness) with `track_functions = 'pl'` set on
it, N no-op jobs bulk-submitted, then the adapter's worker (concurrency 16) drains them.
After the worker has exited (so its statistics are flushed): `pg_stat_user_functions` says
how many times each fl.* function was called, `pg_stat_database` how many transactions the
database committed. Every engine call is one autocommit transaction, so the transactions
that are not engine calls are the rest: chiefly the worker's LISTEN connection, which runs a
transaction to read the notification queue for every notifying commit it hears of.

    .venv/bin/python bench/commit_split.py [--dsn URL] [--jobs 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg import sql

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

from bench import harness  # noqa: E402

sys.path.insert(0, str(BENCH_DIR / "adapters"))
# The harness's own probe for fenceline: index-shaped, not a scan of fl.jobs (BENCHMARKS, Method).
from fenceline_worker import REMAINING_SQL  # noqa: E402

TOP_LEVEL = ("claim", "complete", "extend_leases", "worker_heartbeat", "register_worker")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=os.environ.get("BENCH_DSN", harness.DEFAULT_DSN))
    ap.add_argument("--jobs", type=int, default=20_000)
    args = ap.parse_args()
    scratch = harness.scratch_database(args.dsn, f"bench_commit_split_{os.getpid()}")
    pg, db, url, commit, work = (scratch.pg, scratch.name, scratch.url, scratch.commit,
                                 scratch.work)
    pg.conn.execute(sql.SQL("alter database {} set track_functions = 'pl'").format(
        sql.Identifier(db)))
    adapter = [sys.executable, str(BENCH_DIR / "adapters" / "fenceline_worker.py")]
    try:
        subprocess.run([*adapter, "setup", "--dsn", url], check=True, capture_output=True)
        subprocess.run([*adapter, "enqueue", str(args.jobs), "--dsn", url], check=True,
                       capture_output=True)
        pg.analyze_and_checkpoint(db, checkpoint=False)
        pg.wait_database_idle(db)
        xact0 = pg.transactions(db)
        probe = harness.Probe(url, REMAINING_SQL)
        worker = subprocess.Popen([*adapter, "work", "--dsn", url, "--records",
                                   str(work / "records.json")], stdout=subprocess.PIPE,
                                  text=True)
        assert worker.stdout is not None
        while not worker.stdout.readline().startswith("ready"):
            pass
        t0 = time.monotonic()
        drained, t1 = probe.wait_empty(600)
        worker.terminate()
        worker.wait(timeout=60)
        probe.close()
        pg.wait_database_idle(db)
        xacts = pg.transactions(db) - xact0 - probe.queries
        with psycopg.connect(url, autocommit=True) as conn:
            calls = dict(conn.execute(  # type: ignore[arg-type]
                "select funcname, calls from pg_stat_user_functions where schemaname = 'fl'"
            ).fetchall())
    finally:
        pg.drop_database(db)
        pg.close()
    engine = sum(int(calls.get(f, 0)) for f in TOP_LEVEL)
    n = args.jobs
    print(json.dumps({
        "schema": commit,
        "jobs": n,
        "drained": drained,
        "jobs_per_s": round(n / (t1 - t0)) if drained else None,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "transactions": xacts,
        "per_job": round(xacts / n, 3),
        "engine_calls": {f: int(calls.get(f, 0)) for f in TOP_LEVEL},
        "engine_calls_per_job": round(engine / n, 3),
        "other_transactions_per_job": round((xacts - engine) / n, 3),
        "notify_calls": int(calls.get("_notify_queues", 0)),
        "submit_calls": int(calls.get("submit", 0)),
    }, indent=1))


if __name__ == "__main__":
    main()
