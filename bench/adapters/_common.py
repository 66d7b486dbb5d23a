"""What every peer adapter shares: the command line, the output protocol, start records.

Adapters run inside their peer's own virtual environment (bench/.venvs/<peer>), as scripts,
so this module imports nothing outside the standard library at import time (psutil is
optional) and nothing from fenceline.

The protocol between the harness and an adapter:

- ``info``: one stdout line ``result {json}`` with versions, the settings the adapter uses,
  where those settings come from, and ``remaining_sql``: one SQL expression that is true
  while any job is queued or running (the harness polls it to find the end of a drain).
- ``setup``: create the peer's schema in the database named by ``--dsn``.
- ``enqueue N``: bulk-insert N no-op jobs; ``result`` carries the seconds the insert took
  (connect and imports excluded).
- ``work --concurrency C --records PATH``: print ``ready <unix time>`` once the worker is
  about to consume, run until SIGTERM/SIGINT, then write the start records to PATH and
  print ``result``.
- ``produce --rate R --seconds S``: submit round(R*S) jobs, one per insert, each sent at
  its scheduled time over a small connection pool; each carries its submit timestamp.

Exit codes: 0 ok, 3 the adapter is not available (for example not written yet), anything
else is a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

EXIT_NOT_AVAILABLE = 3

# Connections a producer may use, so one slow commit does not hold back the next job.
PRODUCER_POOL = 8

# (job id, submit unix time from the payload, unix time at which the handler began)
StartRecord = tuple[Any, float, float]


def parse_args(peer: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"{peer}_worker.py", description=f"{peer} adapter")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--dsn", required=name != "info", help="libpq URL of the peer's database")
        return p

    add("info", "print versions, settings and the remaining-jobs probe")
    add("setup", "create the peer's schema")
    p = add("enqueue", "bulk-insert N no-op jobs")
    p.add_argument("n", type=int)
    p = add("work", "run the worker until SIGTERM")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--records", type=Path, required=True)
    p = add("produce", "submit jobs one at a time at a fixed rate")
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--seconds", type=float, required=True)
    return parser.parse_args(argv)


def emit_result(**data: Any) -> None:
    print("result " + json.dumps(data, default=str), flush=True)


def emit_ready() -> None:
    print(f"ready {time.time():.6f}", flush=True)


def not_available(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_NOT_AVAILABLE)


def installed_versions(*dists: str) -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {"python": sys.version.split()[0]}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def self_usage() -> dict[str, float]:
    """The adapter's own CPU and peak RSS, as a cross-check of the harness's psutil view."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_mb": ru.ru_maxrss / 1024}


def write_records(path: Path, records: list[StartRecord]) -> None:
    path.write_text(json.dumps(records))


async def paced(
    rate: float, seconds: float, submit: Callable[[float], Awaitable[None]]
) -> dict[str, float]:
    """Submit round(rate*seconds) jobs, one per call, on a fixed open-loop schedule.

    Each submission starts at its scheduled time as its own task, whether or not the earlier
    ones have finished (the adapters bound them with a small connection pool), so a slow
    commit does not lower the offered rate. The submit timestamp is taken at the scheduled
    time, before any wait for a pooled connection, so that wait counts as latency.
    """
    n = round(rate * seconds)
    interval = 1.0 / rate
    t0 = time.monotonic()
    max_lag = 0.0
    last = t0
    in_flight = 0
    max_in_flight = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one(ts: float) -> None:
        nonlocal in_flight
        in_flight += 1
        try:
            await submit(ts)
        finally:
            in_flight -= 1

    for i in range(n):
        delay = t0 + i * interval - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            max_lag = max(max_lag, -delay)
        last = time.monotonic()
        task = asyncio.create_task(one(time.time()))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        max_in_flight = max(max_in_flight, in_flight + 1)
    if tasks:
        await asyncio.gather(*tasks)
    span = last - t0
    return {
        "submitted": n,
        "elapsed_s": time.monotonic() - t0,
        "achieved_rate_per_s": (n - 1) / span if n > 1 and span > 0 else float(n),
        "max_lag_ms": max_lag * 1000,
        "max_in_flight": max_in_flight,
    }
