"""N concurrent claimers against one capped fenceline queue (the `caps` workload's load).

Each claimer is one connection (fenceline's Trio driver) registered as a worker of
concurrency 1. Its loop: `fl.claim(queue, worker, {noop}, 1, lease)`; when it gets a job it
holds it for --hold-ms (the job "runs"), then `fl.complete`s it and claims again at once;
when the claim says cap_full (or anything else) it waits a random 1-3 ms and retries. A real
worker would wait for a notification or its 1 s poll instead; the short retry keeps the gate
under contention, which is what this measures.

Prints one JSON line: admissions, refusals by reason, admissions/s, claim round trips,
the claimers' own (client-side) maximum of jobs held at once, and the process's CPU.

    .venv/bin/python bench/claimers.py --dsn URL --queue Q --claimers 16 --seconds 10
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import resource
import time
from collections import Counter
from typing import Any

import trio

from fenceline.db.connection import connect


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", required=True)
    p.add_argument("--queue", required=True, help="queue id")
    p.add_argument("--claimers", type=int, required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--hold-ms", type=float, default=10.0)
    p.add_argument("--lease-s", type=float, default=30.0)
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    admissions = 0
    refusals: Counter[str] = Counter()
    held = 0
    max_held = 0
    claim_ms: list[float] = []
    conns: list[Any] = []
    workers: list[Any] = []
    for i in range(args.claimers):
        conn = await connect(args.dsn, application_name=f"bench claimer {i}")
        cur = await conn.execute(
            "select fl.register_worker(array[%s]::uuid[], array['noop'], 'bench', "
            "pg_backend_pid(), 1, null)",
            (args.queue,),
        )
        row = await cur.fetchone()
        conns.append(conn)
        workers.append(row[0])
    start = trio.Event()
    t_end = 0.0

    async def claimer(conn: Any, worker: Any) -> None:
        nonlocal admissions, held, max_held
        await start.wait()
        lease = datetime.timedelta(seconds=args.lease_s)
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            cur = await conn.execute(
                "select outcome, job_id, fence from fl.claim(%s, %s, array['noop'], 1, %s)",
                (args.queue, worker, lease),
            )
            rows = await cur.fetchall()
            claim_ms.append((time.perf_counter() - t0) * 1000)
            if rows and rows[0][0] == "ok":
                held += 1
                max_held = max(max_held, held)
                admissions += 1
                await trio.sleep(args.hold_ms / 1000)
                held -= 1
                await conn.execute(
                    "select * from fl.complete(%s, array[%s]::bigint[], array[%s]::bigint[],"
                    " array[null]::jsonb[])",
                    (worker, rows[0][1], rows[0][2]),
                )
            else:
                refusals[rows[0][0] if rows else "none"] += 1
                await trio.sleep(random.uniform(0.001, 0.003))

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    async with trio.open_nursery() as nursery:
        for conn, worker in zip(conns, workers, strict=True):
            nursery.start_soon(claimer, conn, worker)
        t0 = time.monotonic()
        t_end = t0 + args.seconds
        start.set()
    elapsed = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    for conn in conns:
        await conn.close()
    claim_ms.sort()

    def pct(q: float) -> float | None:
        return claim_ms[min(len(claim_ms) - 1, int(q / 100 * len(claim_ms)))] if claim_ms else None

    return {
        "claimers": args.claimers,
        "seconds": elapsed,
        "hold_ms": args.hold_ms,
        "admissions": admissions,
        "admissions_per_s": admissions / elapsed if elapsed else None,
        "refusals": dict(refusals),
        "claim_calls": len(claim_ms),
        "claim_ms_p50": pct(50),
        "claim_ms_p99": pct(99),
        "client_max_held": max_held,
        "client_cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(json.dumps(trio.run(run, args)), flush=True)


if __name__ == "__main__":
    main()
