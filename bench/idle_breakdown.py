"""Where fenceline's idle submit-to-start latency goes (a profiling aid, not a workload).

A fresh database migrated by the fenceline adapter (pinned to HEAD's migrations like the
harness), the adapter's worker (`work`, concurrency 16) running, then one job every
--interval seconds. For each job:

- submit: fl.submit round trip, commit (WAL flush) included;
- notify: when a LISTEN connection of this script sees the queue's notification;
- start: when the worker's handler began (its start record).

all measured from the submit timestamp. start - notify is the worker's own share: its
listener hand-off, the claim round trip and starting the handler task. Also `select 1`
round trips back to back and after the same idle gap: on a virtual machine whose idle
vCPUs sleep deeply, the second is what any idle latency starts from.

    .venv/bin/python bench/idle_breakdown.py [--dsn URL] [--jobs 40] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

from bench import harness  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=os.environ.get("BENCH_DSN", harness.DEFAULT_DSN))
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--interval", type=float, default=0.5)
    args = ap.parse_args()
    scratch = harness.scratch_database(args.dsn, f"bench_idle_breakdown_{os.getpid()}")
    pg, db, url, commit, work = (scratch.pg, scratch.name, scratch.url, scratch.commit,
                                 scratch.work)
    adapter = [sys.executable, str(BENCH_DIR / "adapters" / "fenceline_worker.py")]
    worker = None
    try:
        subprocess.run([*adapter, "setup", "--dsn", url], check=True, capture_output=True)
        records = work / "records.json"
        worker = subprocess.Popen([*adapter, "work", "--dsn", url, "--records", str(records)],
                                  stdout=subprocess.PIPE, text=True)
        assert worker.stdout is not None
        while not worker.stdout.readline().startswith("ready"):
            pass
        listen = psycopg.connect(url, autocommit=True)
        listen.execute("listen fl_queue")
        seen: list[float] = []

        def listener() -> None:
            try:
                for _ in listen.notifies():
                    seen.append(time.time())
            except psycopg.Error:
                return  # the database is dropped at the end

        t = threading.Thread(target=listener, daemon=True)
        t.start()
        sub = psycopg.connect(url, autocommit=True)
        q = sub.execute("select id from fl.queues where name = 'bench'").fetchone()[0]  # type: ignore[index]
        # The host's own wake-up cost: `select 1` back to back, and after the same idle gap
        # as the jobs (client and backend both asleep in between).
        rtt: dict[str, list[float]] = {"hot": [], "after_gap": []}
        for key, gap in (("hot", 0.0), ("after_gap", args.interval)):
            for _ in range(15):
                time.sleep(gap)
                t0 = time.perf_counter()
                sub.execute("select 1")
                rtt[key].append((time.perf_counter() - t0) * 1000)
        time.sleep(1.0)
        sent: list[tuple[float, float]] = []
        for _ in range(args.jobs):
            t0 = time.time()
            sub.execute("select fl.submit(%s, 'noop', jsonb_build_object('ts', %s::float8))",
                        (q, t0))
            sent.append((t0, time.time()))
            time.sleep(args.interval)
        time.sleep(0.5)
        worker.terminate()
        worker.wait(timeout=60)
        starts = sorted(json.loads(records.read_text()), key=lambda r: r[1])
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        pg.drop_database(db)
        pg.close()

    def stats(vals: list[float]) -> dict[str, Any]:
        return {"p50": round(statistics.median(vals), 2), "max": round(max(vals), 2)}

    submit = [(b - a) * 1000 for a, b in sent]
    # fl.complete notifies the queue too: take the first notification after each submit.
    notify = [(min((n for n in seen if n >= a), default=float("nan")) - a) * 1000
              for a, _ in sent]
    start = [(r[2] - r[1]) * 1000 for r in starts]
    worker_share = [s - n for s, n in zip(start, notify, strict=False)]
    print(json.dumps({
        "schema": commit,
        "jobs": len(starts),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "submit_rtt_ms": stats(submit),
        "notify_seen_ms": stats(notify),
        "handler_start_ms": stats(start),
        "worker_share_ms": stats(worker_share),
        "select1_back_to_back_ms": stats(rtt["hot"]),
        "select1_after_idle_gap_ms": stats(rtt["after_gap"]),
    }, indent=1))


if __name__ == "__main__":
    main()
