"""Run the chaos suite: ``python -m tests.chaos.run --minutes 10`` (the long run).

One run: a private PostgreSQL, a migrated database with the suite's own tables, one queue
with a concurrency cap, scheduler replicas and worker processes (``fenceline run``), a stream
of jobs, and the faults of ``tests.chaos.faults`` injected one after another (every kind at
least once, in a seeded random order, then more at random while the load lasts). Then the
load stops, the fleet settles until every job is terminal, every process gets SIGTERM, and
``tests.chaos.checks`` counts what really happened. ``tests/chaos/test_chaos_short.py`` is
the short run CI does on every submission.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import trio
from psycopg import sql

from fenceline.db import migrator
from fenceline.db.connection import connect
from tests.chaos import checks, load
from tests.chaos.cluster import (
    DATABASE,
    Fleet,
    PrivatePostgres,
    ProcessSettings,
    snapshot_code,
)
from tests.chaos.db import Db
from tests.chaos.faults import FAULTS, LONG_FAULTS, WEIGHTS, FaultEvent, Rig
from tests.chaos.report import render
from tests.chaos.schema import SCHEMA


@dataclass(frozen=True)
class ChaosConfig:
    load_seconds: float  # at least this long; longer if the faults need it
    workers: int = 4
    schedulers: int = 2
    concurrency: int = 4
    cap: int = 10  # the queue's max_concurrency (below workers x concurrency, so it binds)
    lease: float = 3.0
    reaper_interval: float = 0.5
    orphan_interval: float = 2.0
    drain_timeout: float = 2.0
    rate: float = 8.0  # jobs submitted per second
    fault_gap: tuple[float, float] = (2.0, 4.0)  # seconds between faults
    extra_faults: int | None = 2  # after one of each kind; None: keep going while load lasts
    settle_timeout: float = 120.0  # for every job to become terminal once the load stops
    backoff_max_ms: int = 2000
    long_faults: bool = False  # also sigterm_db_down and sigkill_scheduler
    seed: int | None = None

    @property
    def faults(self) -> dict[str, Callable[[Rig], Awaitable[FaultEvent]]]:
        return LONG_FAULTS if self.long_faults else FAULTS

    @property
    def reap_bound(self) -> float:
        """The promise: a killed worker's jobs are reaped within lease + reaper interval
        (measured from the kill, so at most one lease), plus slack for a loaded machine."""
        return self.lease + self.reaper_interval + 5.0

    @property
    def rerun_bound(self) -> float:
        """Reaped, then the retry backoff, then a free slot under the cap: generous."""
        return self.reap_bound + self.backoff_max_ms / 1000 + 15.0


SHORT = ChaosConfig(load_seconds=45)


def long_config(minutes: float) -> ChaosConfig:
    return ChaosConfig(load_seconds=minutes * 60, workers=5, schedulers=3, cap=12, rate=10.0,
                       fault_gap=(3.0, 8.0), extra_faults=None, long_faults=True)


@dataclass
class Outcome:
    config: ChaosConfig
    seed: int
    findings: checks.Findings
    results: list[checks.Check]
    report: str
    log_dir: Path | None  # kept when the run failed
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.ok is not False or c.known_issue for c in self.results)


def run_chaos(config: ChaosConfig, *, keep_logs: bool = False) -> Outcome:
    seed = config.seed if config.seed is not None else random.SystemRandom().randrange(10**9)
    config = replace(config, seed=seed)
    base = Path(tempfile.mkdtemp(prefix="fenceline-chaos-"))
    base.chmod(0o755)  # as root the server runs as nobody and must reach its data dir
    (base / "logs").mkdir()
    snapshot_code(base / "code")
    outcome: Outcome | None = None
    try:
        outcome = trio.run(_run, config, base)
        return outcome
    finally:
        if outcome is not None and outcome.passed and not keep_logs:
            shutil.rmtree(base, ignore_errors=True)
        else:
            pg_log = base / "pgdata" / "postgres.log"
            if pg_log.exists():
                shutil.copy(pg_log, base / "logs" / "postgres.log")
            shutil.rmtree(base / "pgdata", ignore_errors=True)
            shutil.rmtree(base / "code", ignore_errors=True)
            if outcome is not None:
                outcome.log_dir = base / "logs"


async def _run(config: ChaosConfig, base: Path) -> Outcome:
    assert config.seed is not None
    rng = random.Random(config.seed)
    timings: dict[str, float] = {}
    began = trio.current_time()
    pg = PrivatePostgres(base)
    async with trio.open_nursery() as server_nursery:
        await pg.start(server_nursery)
        db = Db(pg.dsn)
        fleet: Fleet | None = None
        try:
            queue = await _prepare_database(pg, config, base / "code")
            timings["server_s"] = trio.current_time() - began
            fleet = Fleet(pg.dsn, ProcessSettings(
                queue=str(queue), lease=config.lease, concurrency=config.concurrency,
                drain_timeout=config.drain_timeout, reaper_interval=config.reaper_interval,
                orphan_interval=config.orphan_interval), base / "logs", base / "code")
            for slot in range(config.schedulers):
                await fleet.spawn("scheduler", slot)
            for slot in range(config.workers):
                await fleet.spawn("worker", slot)
            await _wait_registered(db, config.workers)
            timings["fleet_s"] = trio.current_time() - began - timings["server_s"]

            rig = Rig(pg=pg, fleet=fleet, db=db, queue=queue, server_nursery=server_nursery,
                      rng=rng, lease=config.lease, reaper_interval=config.reaper_interval,
                      drain_timeout=config.drain_timeout)
            stats = load.LoadStats()
            in_flight = load.InFlight()
            events: list[FaultEvent] = []
            mark = trio.current_time()
            await _load_with_faults(rig, config, stats, in_flight, events)
            timings["load_s"] = trio.current_time() - mark

            mark = trio.current_time()
            stuck = await _settle(db, config.settle_timeout)
            timings["settle_s"] = trio.current_time() - mark
            stop_codes = [(p.role, code) for p, code in await fleet.stop_all(
                config.drain_timeout + 15)]
            findings = await checks.collect(db, queue, config.cap, stats, in_flight, events,
                                            fleet, stop_codes, stuck)
        finally:
            if fleet is not None:
                await fleet.kill_all()
            await db.aclose()
            await pg.stop()
            server_nursery.cancel_scope.cancel()
    timings["total_s"] = trio.current_time() - began
    results = checks.evaluate(findings, config)
    report = render(config, findings, results, timings)
    return Outcome(config, config.seed, findings, results, report, None, timings)


async def _prepare_database(pg: PrivatePostgres, config: ChaosConfig,
                            code: Path) -> uuid.UUID:
    """The chaos database: every migration (of the code snapshot the fleet runs), the
    suite's tables, one capped queue."""
    async with await connect(pg.admin_dsn) as admin:
        await admin.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
    async with await connect(pg.dsn) as conn:
        await migrator.migrate(
            conn, migrator.load_migrations(code / "fenceline" / "migrations"))
        await conn.execute(SCHEMA.encode())
        cur = await conn.execute(
            b"with org as (insert into fl.organizations (name) values ('chaos') returning id),"
            b" project as (insert into fl.projects (org_id, name)"
            b"             select id, 'chaos' from org returning id)"
            b" insert into fl.retry_policies (project_id, name, kind, base_delay_ms,"
            b"                                max_delay_ms, jitter, max_attempts, max_lost,"
            b"                                max_timeouts)"
            b" select id, 'chaos', 'exponential', 200, %s, true, 8, 6, 3 from project"
            b" returning project_id, id", (config.backoff_max_ms,))
        row = await cur.fetchone()
        assert row is not None
        cur = await conn.execute(
            b"insert into fl.queues (project_id, retry_policy_id, name, max_concurrency,"
            b"                       default_timeout_ms, breaker_failure_ratio,"
            b"                       breaker_min_volume, breaker_window_ms, breaker_cooldown_ms)"
            b" values (%s, %s, 'chaos', %s, 30000, 0.7, 10, 5000, 1000) returning id",
            (row[0], row[1], config.cap))
        queue = await cur.fetchone()
        assert queue is not None
        return uuid.UUID(str(queue[0]))


async def _wait_registered(db: Db, n: int, within: float = 90.0) -> None:
    with trio.fail_after(within):
        while True:
            active = await db.retry("select count(*) from fl.workers where state = 'active'")
            if active[0][0] >= n:
                return
            await trio.sleep(0.2)


async def _load_with_faults(rig: Rig, config: ChaosConfig, stats: load.LoadStats,
                            in_flight: load.InFlight, events: list[FaultEvent]) -> None:
    stop = trio.Event()
    load_until = trio.current_time() + config.load_seconds
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load.submit_stream, rig.db, rig.queue, config.rate, rig.rng, stats,
                           stop)
        nursery.start_soon(load.replay_dead, rig.db, rig.queue, 8.0, stats, stop)
        nursery.start_soon(load.sample_in_flight, rig.db, rig.queue, config.cap, in_flight,
                           stop)
        faults = config.faults
        kinds = list(faults)
        rig.rng.shuffle(kinds)
        extra = math.inf if config.extra_faults is None else config.extra_faults
        await trio.sleep(rig.rng.uniform(*config.fault_gap) + 3.0)  # let the load build up
        while True:
            if kinds:
                kind = kinds.pop()
            elif extra > 0 and trio.current_time() < load_until - config.fault_gap[1]:
                names = list(faults)
                kind = rig.rng.choices(names, [WEIGHTS.get(k, 1.0) for k in names])[0]
                extra -= 1
            else:
                break
            events.append(await faults[kind](rig))
            await trio.sleep(rig.rng.uniform(*config.fault_gap))
        await trio.sleep(max(0.0, load_until - trio.current_time()))
        stop.set()


async def _settle(db: Db, within: float) -> list[tuple[int, str]]:
    """Wait until every job is terminal; the ones that are not by ``within`` are stuck."""
    deadline = trio.current_time() + within
    while True:
        rows = await db.retry(
            "select id, status::text from fl.jobs"
            " where status not in ('completed', 'dead_letter', 'cancelled') order by id")
        if not rows or trio.current_time() > deadline:
            return [(int(i), s) for i, s in rows]
        await trio.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="how long the load and the faults last (default 10)")
    parser.add_argument("--short", action="store_true", help="the CI profile instead")
    parser.add_argument("--seed", type=int, default=None, help="replay a run's fault order")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the processes' logs even when the run passes")
    args = parser.parse_args(argv)
    config = SHORT if args.short else long_config(args.minutes)
    if args.seed is not None:
        config = replace(config, seed=args.seed)
    started = time.monotonic()
    outcome = run_chaos(config, keep_logs=args.keep_logs)
    print(outcome.report)
    if outcome.log_dir is not None:
        print(f"process logs kept in {outcome.log_dir}")
    print(f"wall time {time.monotonic() - started:.0f} s")
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main())
