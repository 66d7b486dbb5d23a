"""Scheduler sweeps: each pass does its work once, however many schedulers run it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pytest
import trio

from fenceline.config import Settings
from fenceline.db.pool import open_pool
from fenceline.readiness import Readiness
from fenceline.scheduler.sweeps import SWEEPS, Sweep, run_once, scheduler_services
from fenceline.service import ServiceContext
from tests.engine.conftest import Engine


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    e = Engine(dsn)
    yield e
    e.close()


def sweep(name: str) -> Sweep:
    return next(s for s in SWEEPS if s.name == name)


async def test_three_schedulers_reap_each_expired_job_exactly_once(engine: Engine,
                                                                   dsn: str) -> None:
    queue = engine.make_queue()
    worker = engine.worker(queue)
    for _ in range(30):
        engine.submit(queue)
    claimed = engine.claim(queue, worker, n=30, lease="1 second")
    assert len(claimed) == 30
    # Every pooled connection of the schedulers sees time past the leases.
    later = (engine.now + dt.timedelta(seconds=10)).isoformat()
    options = f"-c fl.testing=on -c fl.now={later.replace(' ', 'T')}"
    results: list[int] = []

    async def scheduler() -> None:
        async with open_pool(dsn, max_size=1, connect_kwargs={"options": options}) as pool:
            ctx = ServiceContext(Settings(), Readiness(), pool)
            total = 0
            while (n := await run_once(ctx, sweep("reaper"))) > 0:
                total += n
            results.append(total)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(scheduler)

    assert sum(results) == 30
    assert engine.val("select count(*) from fl.jobs where status = 'retry_wait'") == 30
    assert engine.val("select count(*) from fl.attempts where outcome = 'lost'") == 30
    assert engine.val("select count(*) from fl.leases") == 0


async def test_every_sweep_runs_against_the_schema(dsn: str) -> None:
    async with open_pool(dsn, max_size=1) as pool:
        ctx = ServiceContext(Settings(), Readiness(), pool)
        for s in SWEEPS:
            assert await run_once(ctx, s) == 0


def test_every_sweep_is_a_service_with_its_interval() -> None:
    settings = Settings(reaper_interval=2.5)
    assert [s.name for s in scheduler_services()] == [f"sweep:{s.name}" for s in SWEEPS]
    assert sweep("reaper").interval(settings) == 2.5


async def test_the_events_sweep_keeps_the_configured_days(engine: Engine, dsn: str) -> None:
    queue = engine.make_queue()
    engine.submit(queue)
    later = (engine.now + dt.timedelta(days=2)).isoformat()
    options = f"-c fl.testing=on -c fl.now={later.replace(' ', 'T')}"
    async with open_pool(dsn, max_size=1, connect_kwargs={"options": options}) as pool:
        for days, dropped in ((3.0, 0), (1.5, 1)):
            ctx = ServiceContext(Settings(events_retention_days=days), Readiness(), pool)
            assert await run_once(ctx, sweep("events-retention")) == dropped
    assert engine.val("select count(*) from fl.events") == 0


async def test_an_unreachable_database_skips_passes_instead_of_crashing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fenceline.scheduler.sweeps import sweep_service

    service = sweep_service(sweep("reaper"))
    async with open_pool("postgresql://postgres@127.0.0.1:1/none", max_size=1,
                         timeout=0.5) as pool:
        ctx = ServiceContext(Settings(reaper_interval=0.2), Readiness(), pool)
        with trio.move_on_after(2):
            await service.run(ctx)  # must keep running: no exception escapes
    skipped = [r for r in caplog.records if r.getMessage() == "sweep skipped: database unreachable"]
    assert len(skipped) == 1, "logged once per outage, not once per pass"
