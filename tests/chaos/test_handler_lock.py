"""The price of the chaos handlers' fence check, and how they bound it.

A handler that commits its side effect under ``SELECT ... FOR SHARE`` of its job row cannot
commit at a stale fence (tests/chaos/handlers.py). But the reaper skips locked job rows
(``FOR UPDATE SKIP LOCKED``: a job being reported right now is not its to judge), so a
handler stalled inside that transaction keeps its job past the lease. An early long chaos
run most likely hit it: one job of a SIGSTOPped worker was not reaped until SIGCONT, 23 s
later, while its other jobs were reaped at once. ``idle_in_transaction_session_timeout`` on
the handler's connection makes the server end such a transaction, and the job is reaped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from tests.engine.conftest import Engine


@pytest.fixture
def eng(dsn: str) -> Iterator[Engine]:
    engine = Engine(dsn)
    yield engine
    engine.close()


def _claimed_job(eng: Engine) -> int:
    queue = eng.make_queue()
    worker = eng.worker(queue)
    job = eng.submit(queue, "t")
    eng.claim_one(queue, worker, lease="1 second")
    return job


def _lock_job_row(conn: psycopg.Connection[tuple[object, ...]], job: int) -> None:
    conn.execute("select fence from fl.jobs where id = %s for share", (job,))


def test_the_reaper_skips_a_job_whose_handler_holds_its_row(eng: Engine, dsn: str) -> None:
    job = _claimed_job(eng)
    with psycopg.connect(dsn) as handler:  # a transaction, as the handler's effect write
        _lock_job_row(handler, job)
        eng.advance(5)
        assert eng.reap() == []
        assert eng.job(job)["status"] == "running"
    assert [r["job_id"] for r in eng.reap()] == [job]


def test_idle_in_transaction_timeout_ends_a_stalled_handlers_hold(eng: Engine, dsn: str) -> None:
    job = _claimed_job(eng)
    with psycopg.connect(dsn, options="-c idle_in_transaction_session_timeout=200") as handler:
        _lock_job_row(handler, job)
        pid = handler.info.backend_pid
        deadline = time.monotonic() + 30
        while eng.val("select count(*) from pg_stat_activity where pid = %s", (pid,)):
            assert time.monotonic() < deadline, "the server never ended the idle transaction"
            time.sleep(0.05)
        eng.advance(5)
        assert [r["job_id"] for r in eng.reap()] == [job]
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            handler.execute("select 1")
