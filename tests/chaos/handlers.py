"""Handlers the chaos suite loads into workers (``--handlers tests.chaos.handlers``).

Every run records that it started (``chaos.runs``), does its work, and ends by committing one
side effect guarded by its fence, the way a real handler makes ``job.fence`` an idempotency
token: in one transaction it locks the job row ``FOR SHARE``, checks that the job is still
running at its fence, and records the effect as accepted or, when the fence is stale, as
rejected (and then raises ``FencedOut``). The lock matters: a plain ``WHERE EXISTS`` check
under READ COMMITTED can pass while the reaper's fence change is committing, and accept a
stale write. The lock has a price: the reaper skips locked job rows, so a handler stalled
inside that transaction (SIGSTOP) would keep its job past the lease. The server ends such a
transaction after ``IDLE_IN_TRANSACTION_MS`` (tests/chaos/test_handler_lock.py shows both).

The handlers are sync on purpose. They run in a thread that the runtime abandons when the
lease is lost, so a handler that outlived its lease really does try to write afterwards; and
they ignore ``job.cancelled``, playing the worst-case handler that only the fence can stop.

Payloads:
    chaos_noop   {}
    chaos_sleep  {"ms": N, "slow_attempts": K}   sleeps N ms (4 N ms while attempt <= K)
    chaos_fail   {"fail_first": K}               fails attempts 1..K, then succeeds
                 {"permanent": true}             fails for good (dead letter)
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from fenceline.worker.job import Job, PermanentError

APPLICATION_NAME = "chaos handler"
# A stalled handler's transaction is ended by the server after this long (see above).
IDLE_IN_TRANSACTION_MS = 1000


class FencedOut(Exception):
    """The side effect was refused: this run's fence was no longer current."""


class PlannedFailure(Exception):
    """A ``chaos_fail`` attempt failing on purpose (retried by the queue's policy)."""


def _connect() -> psycopg.Connection[Any]:
    return psycopg.connect(os.environ["DATABASE_URL"], autocommit=True,
                           application_name=APPLICATION_NAME, connect_timeout=5,
                           options=f"-c idle_in_transaction_session_timeout="
                                   f"{IDLE_IN_TRANSACTION_MS}")


def _payload(job: Job) -> dict[str, Any]:
    return job.payload if isinstance(job.payload, dict) else {}


def _record_start(conn: psycopg.Connection[Any], job: Job) -> None:
    conn.execute("insert into chaos.runs (job_id, fence, attempt, type, pid)"
                 " values (%s, %s, %s, %s, %s)",
                 (job.id, job.fence, job.attempt, job.type, os.getpid()))


def _commit_effect(conn: psycopg.Connection[Any], job: Job) -> None:
    with conn.transaction():
        row = conn.execute("select fence, status::text from fl.jobs where id = %s for share",
                           (job.id,)).fetchone()
        seen_fence, seen_status = row if row is not None else (None, None)
        accepted = seen_fence == job.fence and seen_status == "running"
        conn.execute("insert into chaos.effects"
                     " (job_id, fence, pid, accepted, seen_fence, seen_status)"
                     " values (%s, %s, %s, %s, %s, %s::fl.job_status)",
                     (job.id, job.fence, os.getpid(), accepted, seen_fence, seen_status))
    if not accepted:
        raise FencedOut(f"job {job.id}: fence {job.fence} is stale "
                        f"(now {seen_fence}, {seen_status})")


def chaos_noop(job: Job) -> None:
    with _connect() as conn:
        _record_start(conn, job)
        _commit_effect(conn, job)


def chaos_sleep(job: Job) -> dict[str, Any]:
    payload = _payload(job)
    ms = float(payload.get("ms", 0))
    if job.attempt <= int(payload.get("slow_attempts", 0)):
        ms *= 4
    with _connect() as conn:
        _record_start(conn, job)
        time.sleep(ms / 1000)
        _commit_effect(conn, job)
    return {"slept_ms": ms}


def chaos_fail(job: Job) -> None:
    payload = _payload(job)
    with _connect() as conn:
        _record_start(conn, job)
        if payload.get("permanent") is True:
            raise PermanentError("planned permanent failure")
        if job.attempt <= int(payload.get("fail_first", 1)):
            raise PlannedFailure(f"planned failure of attempt {job.attempt}")
        _commit_effect(conn, job)


HANDLERS = {"chaos_noop": chaos_noop, "chaos_sleep": chaos_sleep, "chaos_fail": chaos_fail}
