"""The scheduler role: periodic sweeps, each a loop around one SQL function.

Every sweep is single-runner across replicas without any coordination here: its SQL
function try-locks its own advisory key (fenceline/db/locks.py) inside its transaction and
returns 0 when another scheduler holds it. Running three schedulers is therefore safe, and
the spare ones cost one cheap call per interval.

A sweep that finds a full batch runs again at once (a backlog is drained, not trickled);
otherwise it sleeps its interval, jittered to [interval/2, interval] so replicas do not
march in step. Work done is logged; idle passes are not.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import trio

from fenceline.config import Settings
from fenceline.service import Service, ServiceContext

log = logging.getLogger("fenceline.scheduler")

# One pass may not hold a pooled connection longer than this.
SWEEP_TIMEOUT = 30.0


@dataclass(frozen=True)
class Sweep:
    name: str
    # A statement returning one integer: how many rows the pass changed. Its parameters are
    # %(batch)s and whatever ``params`` gives.
    sql: str
    # How many rows a pass handles at most; a pass that hits it runs again at once.
    batch: int | None
    interval: Callable[[Settings], float]
    params: Callable[[Settings], dict[str, Any]] = lambda s: {}


SWEEPS = (
    # Jobs whose lease ran out: retried, or dead-lettered past their ceilings.
    Sweep("reaper", "select count(*) from fl.reap(%(batch)s)", 500,
          lambda s: s.reaper_interval),
    # Delayed and backing-off jobs that came due (the claim also promotes its own queue).
    Sweep("promoter", "select fl.promote(%(batch)s)", 1000, lambda s: s.promoter_interval),
    # Open breakers whose cooldown ended become half-open.
    Sweep("breaker", "select fl.breaker_sweep()", None, lambda s: s.breaker_interval),
    # Leases whose job is no longer running at that fence (should not happen; cheap to check).
    Sweep("lease-orphans", "select fl.sweep_orphans(%(batch)s)", 1000,
          lambda s: s.orphan_interval),
    # Workers not heard from are marked dead (their leases lapse and are reaped).
    Sweep("worker-liveness", "select fl.mark_dead_workers()", None,
          lambda s: s.orphan_interval),
    # Events older than the retention leave the outbox (migration 0013).
    Sweep("events-retention",
          "select fl.prune_events(%(batch)s, make_interval(secs => %(keep_s)s))", 5000,
          lambda s: 60.0, lambda s: {"keep_s": s.events_retention_days * 86400.0}),
    # Idempotency keys past their 24 hours that nobody sent again. Not single-runner (0006's
    # function takes no lock), and need not be: two passes deleting the same expired keys
    # only wait on each other's row locks.
    Sweep("idempotency-keys", "select fl.prune_idempotency_keys(%(batch)s)", 5000,
          lambda s: 60.0),
)


async def run_once(ctx: ServiceContext, sweep: Sweep) -> int:
    """One pass of ``sweep``: the number of rows it changed."""
    with trio.fail_after(SWEEP_TIMEOUT):
        async with ctx.pool.connection() as conn:
            cur = await conn.execute(sweep.sql.encode(),
                                     {"batch": sweep.batch, **sweep.params(ctx.settings)})
            row = await cur.fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0


def sweep_service(sweep: Sweep) -> Service:
    async def run(ctx: ServiceContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        interval = sweep.interval(ctx.settings)
        task_status.started()
        unreachable = False
        while True:
            try:
                changed = await run_once(ctx, sweep)
            except (psycopg.OperationalError, trio.TooSlowError) as exc:
                # A database outage is a skipped pass, not a crash: crashing would grow the
                # supervisor's restart backoff to 30 s and leave expired leases unreaped
                # that long after the server is back (found by the chaos suite).
                if not unreachable:
                    log.warning("sweep skipped: database unreachable",
                                extra={"sweep": sweep.name, "error": str(exc).strip()[:200]})
                unreachable = True
                changed = 0
            else:
                if unreachable:
                    log.info("sweep resumed", extra={"sweep": sweep.name})
                unreachable = False
            if changed:
                log.info("sweep", extra={"sweep": sweep.name, "changed": changed})
            if sweep.batch is not None and changed >= sweep.batch:
                await trio.lowlevel.checkpoint()
                continue
            await trio.sleep(random.uniform(interval / 2, interval))

    return Service(f"sweep:{sweep.name}", run)


def scheduler_services() -> list[Service]:
    return [sweep_service(s) for s in SWEEPS]
