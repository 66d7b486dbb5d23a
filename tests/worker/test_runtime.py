"""The worker runtime against a real PostgreSQL: run, report, lose a lease, drain, reconnect.

These tests run a real Worker in the test's Trio loop and wait for it with bounded polls
of the database: the worker's own clock is real time (its deadlines and heartbeats are what
is under test). Moving a job on behind the worker's back uses ``fl.now`` on a side
connection, so no test waits for a lease to run out.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio
import trio.testing

import fenceline
from fenceline.db.listener import Listener
from fenceline.engine.calls import EngineInputError
from fenceline.worker.runtime import NOTIFY_CHANNEL, Worker
from tests.engine.conftest import Engine

WAIT = 20.0


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    e = Engine(dsn)
    # The worker runs on real time; the side connections start there too and jump ahead.
    e.set_now(dt.datetime.now(dt.UTC))
    yield e
    e.close()


async def wait_for(engine: Engine, query: str, params: Any = None,
                   check: Callable[[Any], bool] = bool) -> Any:
    """Poll ``query`` (one value) until ``check`` accepts it; fail after WAIT seconds."""
    with trio.move_on_after(WAIT):
        while True:
            value = engine.val(query, params)
            if check(value):
                return value
            await trio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {query} (last value {value!r})")


class Running:
    def __init__(self, worker: Worker, draining: trio.Event, nursery: trio.Nursery) -> None:
        self.worker = worker
        self.draining = draining
        self.nursery = nursery


async def start(nursery: trio.Nursery, worker: Worker, dsn: str) -> Running:
    draining = trio.Event()
    await nursery.start(lambda task_status: worker.run(dsn, draining=draining,
                                                       task_status=task_status))
    return Running(worker, draining, nursery)


async def test_jobs_run_to_completion_with_results(engine: Engine, dsn: str) -> None:
    queue = engine.make_queue()
    ids = [engine.submit(queue, "double", {"n": i}) for i in range(40)]
    worker = Worker(str(queue), concurrency=8)

    @worker.handler("double")
    async def double(job: fenceline.Job) -> dict[str, int]:
        job.log(f"doubling {job.payload['n']}")
        return {"n": job.payload["n"] * 2}

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        await wait_for(engine, "select count(*) = 40 from fl.jobs where status = 'completed'")
        run.draining.set()

    rows = engine.rows("select job_id, outcome::text, result from fl.attempts order by job_id")
    assert [r["job_id"] for r in rows] == ids
    assert {r["outcome"] for r in rows} == {"success"}
    assert [r["result"]["n"] for r in rows] == [2 * i for i in range(40)]
    assert engine.val("select count(*) from fl.attempt_logs") == 40
    assert engine.val("select count(*) from fl.fence_violations") == 0
    assert engine.val("select count(*) from fl.leases") == 0
    assert worker.stats.completed == 40
    assert engine.val("select state from fl.workers") == "stopped"


async def test_unknown_queue_is_a_clear_error(dsn: str) -> None:
    worker = Worker(str(uuid.uuid4()))
    worker.handler("t")(lambda job: None)
    with pytest.raises(EngineInputError, match="does not exist"):
        await worker.run(dsn)
    worker = Worker("no/such/queue")
    worker.handler("t")(lambda job: None)
    with pytest.raises(EngineInputError, match="does not exist"):
        await worker.run(dsn)


async def test_a_handler_past_its_deadline_is_reported_as_timeout(engine: Engine,
                                                                   dsn: str) -> None:
    # A long backoff: under load the poll below could otherwise see a second attempt.
    queue = engine.make_queue(default_timeout_ms=300,
                              policy={"base_delay_ms": 3_600_000, "jitter": False})
    job_id = engine.submit(queue, "slow")
    worker = Worker(str(queue))
    cancelled = trio.Event()

    @worker.handler("slow")
    async def slow(job: fenceline.Job) -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        await wait_for(engine, "select (select outcome::text from fl.attempts"
                       " where job_id = %s)", (job_id,), lambda v: v is not None)
        run.draining.set()
    assert cancelled.is_set()
    assert engine.val("select outcome::text from fl.attempts where job_id = %s",
                      (job_id,)) == "timeout"
    job = engine.job(job_id)
    assert job["timeout_count"] == 1
    assert job["status"] == "retry_wait"


async def test_a_lost_lease_cancels_the_handler_within_one_heartbeat(engine: Engine,
                                                                     dsn: str) -> None:
    queue = engine.make_queue()
    job_id = engine.submit(queue, "long")
    lease = 3.0
    worker = Worker(str(queue), lease=lease)
    started, cancelled = trio.Event(), trio.Event()
    cancelled_at: list[float] = []

    @worker.handler("long")
    async def long(job: fenceline.Job) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled_at.append(trio.current_time())
            cancelled.set()

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        with trio.fail_after(WAIT):
            await started.wait()
        # Behind the worker's back: time jumps past the lease and the reaper takes the job.
        engine.advance(lease + 5)
        reaped = engine.rows("select * from fl.reap(100)")
        taken_at = trio.current_time()
        assert [r["job_id"] for r in reaped] == [job_id]
        with trio.fail_after(WAIT):
            await cancelled.wait()
        run.draining.set()

    assert cancelled_at[0] - taken_at <= lease / 3 + 0.5
    assert worker.stats.lost_leases == 1
    # The stale worker reported nothing: the only attempt is the one the reaper closed.
    assert engine.val("select outcome::text from fl.attempts where job_id = %s",
                      (job_id,)) == "lost"
    assert engine.val("select count(*) from fl.fence_violations where attempted = 'heartbeat'"
                      ) == 1


async def test_a_full_worker_sleeps_through_notifications(engine: Engine, dsn: str) -> None:
    """Every slot busy and new work notified: the claim loop wakes, sees no free slot and
    waits again. It used to keep the wake-up set and spin until a slot freed: a worker whose
    long jobs filled its slots burned a core for as long as its queue got submissions."""
    queue = engine.make_queue()
    engine.submit(queue, "hold")
    worker = Worker(str(queue), concurrency=1)
    started, release = trio.Event(), trio.Event()

    @worker.handler("hold")
    async def hold(job: fenceline.Job) -> None:
        started.set()
        await release.wait()

    listener = Listener(dsn, name="test")
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        with listener.subscribe(NOTIFY_CHANNEL) as seen:
            await listener.wait_listening(NOTIFY_CHANNEL)
            async with trio.open_nursery() as worker_nursery:
                draining = trio.Event()
                await worker_nursery.start(lambda task_status: worker.run(
                    dsn, draining=draining, listener=listener, task_status=task_status))
                with trio.fail_after(WAIT):
                    await started.wait()
                engine.submit(queue, "hold")  # notifies the queue while the only slot is busy
                with trio.fail_after(WAIT):
                    while await seen.receive() != str(queue):
                        pass
                # The worker's subscription was handed the same payload. A spinning claim
                # loop is always runnable, so the program would never be all blocked.
                with trio.fail_after(5):
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                release.set()
                await wait_for(engine,
                               "select count(*) = 2 from fl.jobs where status = 'completed'")
                draining.set()
        nursery.cancel_scope.cancel()  # the listener
    assert worker.stats.completed == 2


async def test_a_stale_completion_is_fenced_and_changes_nothing(engine: Engine,
                                                                dsn: str) -> None:
    queue = engine.make_queue(default_timeout_ms=3_600_000)
    job_id = engine.submit(queue, "gated")
    worker = Worker(str(queue), lease=600)  # heartbeat every 200 s: it will not notice
    started, finish = trio.Event(), trio.Event()

    @worker.handler("gated")
    async def gated(job: fenceline.Job) -> str:
        started.set()
        await finish.wait()
        return "stale result"

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        with trio.fail_after(WAIT):
            await started.wait()
        engine.advance(700)
        assert len(engine.rows("select * from fl.reap(100)")) == 1
        finish.set()
        await wait_for(engine, "select count(*) from fl.fence_violations")
        run.draining.set()

    assert worker.stats.fenced == 1
    assert worker.stats.completed == 0
    job = engine.job(job_id)
    assert job["status"] == "retry_wait"
    assert engine.val("select count(*) from fl.attempts where outcome = 'success'") == 0
    violation = engine.row("select * from fl.fence_violations")
    assert violation["attempted"] == "complete"
    assert violation["held_fence"] < violation["actual_fence"]


async def test_snooze_and_permanent_error(engine: Engine, dsn: str) -> None:
    queue = engine.make_queue()
    snoozer = engine.submit(queue, "snooze")
    doomed = engine.submit(queue, "doomed")
    worker = Worker(str(queue))

    @worker.handler("snooze")
    async def snooze(job: fenceline.Job) -> None:
        raise fenceline.Snooze(60)

    @worker.handler("doomed")
    async def doomed_handler(job: fenceline.Job) -> None:
        raise fenceline.PermanentError("cannot ever work")

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        await wait_for(engine, "select count(*) = 2 from fl.attempts where outcome is not null")
        run.draining.set()

    s = engine.job(snoozer)
    assert (s["status"], s["attempts"], s["snooze_count"]) == ("scheduled", 0, 1)
    d = engine.job(doomed)
    assert d["status"] == "dead_letter"
    dead = engine.row("select * from fl.dead_letters where job_id = %s", (doomed,))
    assert dead["reason"] == "permanent_error"
    assert "cannot ever work" in dead["error_message"]


async def test_drain_releases_running_jobs_after_the_timeout(engine: Engine,
                                                             dsn: str) -> None:
    queue = engine.make_queue()
    ids = [engine.submit(queue, "forever") for _ in range(3)]
    worker = Worker(str(queue), drain_timeout=0.5)
    started: list[int] = []
    all_started = trio.Event()

    @worker.handler("forever")
    async def forever(job: fenceline.Job) -> None:
        started.append(job.id)
        if len(started) == 3:
            all_started.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        with trio.fail_after(WAIT):
            await all_started.wait()
        run.draining.set()

    rows = engine.rows("select status::text, attempts, fence from fl.jobs where id = any(%s)"
                       " order by id", (ids,))
    assert [r["status"] for r in rows] == ["queued"] * 3
    assert [r["attempts"] for r in rows] == [0, 0, 0], "a released job uses no attempt"
    assert {r["outcome"] for r in engine.rows("select outcome::text from fl.attempts")} == {
        "released"}
    assert worker.stats.released == 3
    assert engine.val("select count(*) from fl.leases") == 0


async def test_reports_survive_a_terminated_connection(engine: Engine, dsn: str) -> None:
    queue = engine.make_queue()
    job_id = engine.submit(queue, "gated")
    worker = Worker(str(queue))
    started, finish = trio.Event(), trio.Event()

    @worker.handler("gated")
    async def gated(job: fenceline.Job) -> str:
        started.set()
        await finish.wait()
        return "done"

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        with trio.fail_after(WAIT):
            await started.wait()
        killed = engine.val(
            "select count(pg_terminate_backend(pid)) from pg_stat_activity"
            " where application_name like 'fenceline worker%%' and datname = current_database()")
        assert killed >= 2
        finish.set()
        await wait_for(engine, "select status::text = 'completed' from fl.jobs where id = %s",
                       (job_id,))
        run.draining.set()
    assert worker.stats.completed == 1
    assert engine.val("select count(*) from fl.fence_violations") == 0


async def test_sync_handlers_run_in_a_thread(engine: Engine, dsn: str) -> None:
    queue = engine.make_queue()
    engine.submit(queue, "sync", {"x": 3})
    worker = Worker(str(queue))

    @worker.handler("sync")
    def sync_handler(job: fenceline.Job) -> int:
        return int(job.payload["x"]) + 1

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        await wait_for(engine, "select count(*) from fl.attempts where outcome = 'success'")
        run.draining.set()
    assert engine.val("select result from fl.attempts") == 4


async def test_a_sync_handler_sees_job_cancelled_when_the_drain_times_out(
        engine: Engine, dsn: str) -> None:
    queue = engine.make_queue()
    job_id = engine.submit(queue, "cooperative")
    worker = Worker(str(queue), drain_timeout=0.3)
    started, returned = trio.Event(), trio.Event()
    token = trio.lowlevel.current_trio_token()
    seen: list[bool] = []

    @worker.handler("cooperative")
    def cooperative(job: fenceline.Job) -> None:
        token.run_sync_soon(started.set)
        # A sync handler cannot be interrupted: it waits on the Event it was handed.
        seen.append(job.cancelled.wait(WAIT))
        token.run_sync_soon(returned.set)

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        with trio.fail_after(WAIT):
            await started.wait()
        run.draining.set()
    with trio.fail_after(WAIT):
        await returned.wait()  # the abandoned thread returns once the Event is set
    assert seen == [True]
    assert engine.val("select status::text from fl.jobs where id = %s", (job_id,)) == "queued"


async def test_job_cancelled_is_set_for_a_handler_that_looks_only_after_the_cancel(
        engine: Engine, dsn: str) -> None:
    queue = engine.make_queue()
    engine.submit(queue, "late")
    worker = Worker(str(queue), drain_timeout=0.2)
    started = trio.Event()
    seen: list[bool] = []

    @worker.handler("late")
    async def late(job: fenceline.Job) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            seen.append(job.cancelled.is_set())  # first use of the Event, after the cancel

    async with trio.open_nursery() as nursery:
        run = await start(nursery, worker, dsn)
        with trio.fail_after(WAIT):
            await started.wait()
        run.draining.set()
    assert seen == [True]


def test_bad_worker_arguments() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        Worker("q", concurrency=0)
    with pytest.raises(ValueError, match="lease"):
        Worker("q", lease=0.1)
    w = Worker("q")
    w.handler("a")(lambda job: None)
    with pytest.raises(ValueError, match="already registered"):
        w.handler("a")(lambda job: None)

