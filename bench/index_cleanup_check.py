"""Why a claim reads more blocks beside 10 million finished jobs (a profiling aid).

VACUUM skips index vacuuming when the dead rows sit on fewer than 2 % of the heap's pages
("index scan bypassed", PostgreSQL 14+). Beside a large history that is nearly always the
case, so the dead entries that claims leave at the head of fl.jobs_claimable stay there, and
every claim walks past them. This script shows it on one database:

1. 10 million terminal rows (the claim-cost fixture) and 14,000 queued jobs, VACUUM (ANALYZE);
2. blocks per n=1 claim (median of 20, EXPLAIN (ANALYZE, BUFFERS)) on a new session;
3. 10,000 more jobs claimed and completed (n=16), then blocks per claim again;
4. plain VACUUM (what autovacuum runs; its index-cleanup decision printed), new session,
   blocks per claim;
5. VACUUM (INDEX_CLEANUP ON), new session, blocks per claim.

    .venv/bin/python bench/index_cleanup_check.py [--dsn URL] [--rows 10000000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

from bench import harness  # noqa: E402
from bench.engine_workloads import FILL_BATCH, FL_FILL_SQL  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=os.environ.get("BENCH_DSN", harness.DEFAULT_DSN))
    ap.add_argument("--rows", type=int, default=10_000_000)
    args = ap.parse_args()
    scratch = harness.scratch_database(args.dsn, f"bench_index_cleanup_{os.getpid()}")
    pg, db, url, commit = scratch.pg, scratch.name, scratch.url, scratch.commit
    print(f"schema: git {commit}; load {os.getloadavg()[0]:.2f}", flush=True)
    try:
        subprocess.run([sys.executable, str(BENCH_DIR / "adapters" / "fenceline_worker.py"),
                        "setup", "--dsn", url], check=True, capture_output=True)
        admin = psycopg.connect(url, autocommit=True)
        q = admin.execute("select id from fl.queues where name = 'bench'").fetchone()[0]  # type: ignore[index]
        t0 = time.monotonic()
        admin.execute("alter table fl.jobs disable trigger all")
        for lo in range(1, args.rows + 1, FILL_BATCH):
            admin.execute(FL_FILL_SQL, {"lo": lo, "hi": min(args.rows, lo + FILL_BATCH - 1)})
        admin.execute("alter table fl.jobs enable trigger all")
        admin.execute("select count(*) from (select fl.submit(%s, 'noop', '{}')"
                      " from generate_series(1, 14000)) x", (q,))
        admin.execute("vacuum (analyze) fl.jobs")
        print(f"{args.rows:,} terminal rows + 14,000 queued, VACUUM (ANALYZE): "
              f"{time.monotonic() - t0:.0f} s", flush=True)

        def session() -> tuple[psycopg.Connection[Any], Any]:
            s = psycopg.connect(url, autocommit=True)
            w = s.execute("select fl.register_worker(array[%s]::uuid[], array['noop'], 'b',"
                          " pg_backend_pid(), 16, null)", (q,)).fetchone()[0]  # type: ignore[index]
            return s, w

        def cycle(s: psycopg.Connection[Any], w: Any, k: int, n: int) -> None:
            for _ in range(k):
                rows = [(r[0], r[1]) for r in s.execute(
                    "select job_id, fence from fl.claim(%s, %s, array['noop'], %s,"
                    " interval '30 s') where outcome = 'ok'", (q, w, n)).fetchall()]
                s.execute("select * from fl.complete(%s, %s, %s, %s::jsonb[])",
                          (w, [r[0] for r in rows], [r[1] for r in rows], [None] * len(rows)))

        def blocks(s: psycopg.Connection[Any], w: Any) -> int:
            cycle(s, w, 5, 1)
            out = []
            for _ in range(20):
                plan = s.execute(
                    "explain (analyze, buffers, format json) select * from fl.claim(%s, %s,"
                    " array['noop'], 1, interval '30 s')", (q, w)).fetchone()[0][0]  # type: ignore[index]
                s.execute("select fl.complete(%s, array_agg(job_id), array_agg(fence),"
                          " array_agg(null::jsonb)) from fl.leases where worker_id = %s", (w, w))
                out.append(int(plan["Plan"]["Shared Hit Blocks"]) +
                           int(plan["Plan"]["Shared Read Blocks"]))
            return sorted(out)[len(out) // 2]

        def vacuum(options: str) -> str:
            notes: list[str] = []
            admin.add_notice_handler(lambda d: notes.extend(
                ln for ln in (d.message_primary or "").splitlines()
                if ln.startswith("index scan")))
            admin.execute(f"vacuum ({options}) fl.jobs")  # type: ignore[arg-type]
            return notes[0] if notes else "?"

        def pages() -> int:
            return int(admin.execute(  # type: ignore[index]
                "select pg_relation_size('fl.jobs_claimable') / 8192").fetchone()[0])

        s, w = session()
        print(f"after VACUUM: {blocks(s, w)} blocks per claim "
              f"(claimable index {pages()} pages)", flush=True)
        cycle(s, w, 625, 16)
        print(f"after 10,000 more claims, no VACUUM: {blocks(s, w)} blocks per claim", flush=True)
        print(f"plain VACUUM: {vacuum('verbose')}", flush=True)
        s, w = session()
        print(f"after plain VACUUM: {blocks(s, w)} blocks per claim", flush=True)
        print(f"VACUUM (INDEX_CLEANUP ON): {vacuum('verbose, index_cleanup on')}", flush=True)
        s, w = session()
        print(f"after VACUUM (INDEX_CLEANUP ON): {blocks(s, w)} blocks per claim "
              f"(claimable index {pages()} pages)", flush=True)
    finally:
        pg.drop_database(db)
        pg.close()


if __name__ == "__main__":
    main()
