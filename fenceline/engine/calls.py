"""Typed calls to the engine's SQL functions, one Python function per ``fl.*`` function.

Every job state change lives in PL/pgSQL (migrations/0004_engine.sql) and is one round trip
that returns an explicit outcome. This module only shapes arguments and rows; it never reads
job state and then writes it, so there is nothing here to race.

Bad input raised by the SQL (SQLSTATE class ``FL``) surfaces as ``EngineInputError`` with the
function's own message, so callers can show it as-is.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from fenceline.errors import FencelineError

Conn = psycopg.AsyncConnection[Any]


class EngineInputError(FencelineError):
    """The engine refused its input (SQLSTATE FLxxx); nothing was changed."""

    def __init__(self, sqlstate: str, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def _raise_engine_error(exc: psycopg.Error) -> None:
    state = exc.sqlstate or ""
    if state.startswith("FL"):
        message = exc.diag.message_primary or str(exc)
        raise EngineInputError(state, message) from None


async def _rows(conn: Conn, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    try:
        cur = await conn.execute(query.encode(), params)
        return await cur.fetchall()
    except psycopg.Error as exc:
        _raise_engine_error(exc)
        raise


def _seconds(value: float) -> dt.timedelta:
    return dt.timedelta(seconds=value)


# -- submit ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submitted:
    outcome: str
    job_id: int | None
    status: str | None
    run_at: dt.datetime | None


async def submit(conn: Conn, queue_id: uuid.UUID, job_type: str, payload: Any = None, *,
                 priority: int | None = None, run_at: dt.datetime | None = None,
                 delay_s: float | None = None, timeout_ms: int | None = None,
                 retry_policy_id: uuid.UUID | None = None) -> Submitted:
    rows = await _rows(
        conn,
        "select outcome, job_id, status::text, run_at"
        " from fl.submit(%s, %s, %s, %s, %s, %s, %s, %s)",
        (queue_id, job_type, Jsonb(payload if payload is not None else {}), priority, run_at,
         delay_s, timeout_ms, retry_policy_id),
    )
    return Submitted(*rows[0])


# -- claim -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimedJob:
    id: int
    fence: int
    attempt: int
    type: str
    payload: Any
    priority: int
    replay_generation: int
    deadline_at: dt.datetime
    lease_expires_at: dt.datetime


@dataclass(frozen=True)
class ClaimResult:
    jobs: list[ClaimedJob]
    # Why nothing was claimed (None when jobs were): paused, cap_full, rate_limited, empty...
    reason: str | None
    # When trying again can help (next token, end of cooldown, next delayed job), if known.
    retry_at: dt.datetime | None


async def claim(conn: Conn, queue_id: uuid.UUID, worker_id: uuid.UUID,
                types: Sequence[str] | None, n: int, lease_s: float) -> ClaimResult:
    rows = await _rows(
        conn,
        "select outcome, job_id, fence, attempt, type, payload, priority, replay_generation,"
        " deadline_at, lease_expires_at, retry_at from fl.claim(%s, %s, %s, %s, %s)",
        (queue_id, worker_id, list(types) if types is not None else None, n,
         _seconds(lease_s)),
    )
    if len(rows) == 1 and rows[0][1] is None:
        return ClaimResult([], rows[0][0], rows[0][10])
    jobs = [ClaimedJob(r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]) for r in rows]
    return ClaimResult(jobs, None, None)


# -- reports ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobOutcome:
    job_id: int
    fence: int
    outcome: str


async def complete(conn: Conn, worker_id: uuid.UUID, ids: Sequence[int],
                   fences: Sequence[int], results: Sequence[Any]) -> list[JobOutcome]:
    rows = await _rows(
        conn, "select job_id, fence, outcome from fl.complete(%s, %s, %s, %s::jsonb[])",
        (worker_id, list(ids), list(fences),
         # All None (the usual case): NULL, which the function reads as no results.
         None if all(r is None for r in results)
         else [json.dumps(r) if r is not None else None for r in results]),
    )
    return [JobOutcome(*r) for r in rows]


@dataclass(frozen=True)
class Reported:
    outcome: str
    status: str | None
    run_at: dt.datetime | None


async def fail(conn: Conn, worker_id: uuid.UUID, job_id: int, fence: int, kind: str,
               message: str | None = None, error_class: str | None = None) -> Reported:
    rows = await _rows(
        conn, "select outcome, status::text, run_at from fl.fail(%s, %s, %s, %s, %s, %s)",
        (worker_id, job_id, fence, kind, message, error_class),
    )
    return Reported(*rows[0])


async def snooze(conn: Conn, worker_id: uuid.UUID, job_id: int, fence: int,
                 seconds: float) -> Reported:
    rows = await _rows(
        conn, "select outcome, status::text, run_at from fl.snooze(%s, %s, %s, %s)",
        (worker_id, job_id, fence, seconds),
    )
    return Reported(*rows[0])


async def release(conn: Conn, worker_id: uuid.UUID, ids: Sequence[int],
                  fences: Sequence[int]) -> list[JobOutcome]:
    rows = await _rows(
        conn, "select job_id, fence, outcome from fl.release(%s, %s, %s)",
        (worker_id, list(ids), list(fences)),
    )
    return [JobOutcome(*r) for r in rows]


async def extend_leases(conn: Conn, worker_id: uuid.UUID, ids: Sequence[int],
                        fences: Sequence[int], lease_s: float,
                        progress: Sequence[Any] | None = None) -> list[JobOutcome]:
    """Extend every lease held; return only the jobs that need attention."""
    rows = await _rows(
        conn, "select job_id, fence, outcome from fl.extend_leases(%s, %s, %s, %s, %s::jsonb[])",
        (worker_id, list(ids), list(fences), _seconds(lease_s),
         [json.dumps(p) if p is not None else None for p in progress]
         if progress is not None else None),
    )
    return [JobOutcome(*r) for r in rows]


async def append_logs(conn: Conn, worker_id: uuid.UUID, job_id: int, fence: int,
                      levels: Sequence[str], messages: Sequence[str],
                      times: Sequence[dt.datetime]) -> str:
    rows = await _rows(
        conn, "select fl.append_logs(%s, %s, %s, %s, %s, %s)",
        (worker_id, job_id, fence, list(levels), list(messages), list(times)),
    )
    return str(rows[0][0])


# -- workers ---------------------------------------------------------------------------------


async def register_worker(conn: Conn, queue_ids: Sequence[uuid.UUID],
                          handlers: Sequence[str] | None, hostname: str, pid: int,
                          concurrency: int, meta: Any = None) -> uuid.UUID:
    rows = await _rows(
        conn, "select fl.register_worker(%s, %s, %s, %s, %s, %s)",
        (list(queue_ids), list(handlers) if handlers is not None else None, hostname, pid,
         concurrency, Jsonb(meta) if meta is not None else None),
    )
    value = rows[0][0]
    assert isinstance(value, uuid.UUID)
    return value


async def worker_heartbeat(conn: Conn, worker_id: uuid.UUID, state: str | None = None) -> None:
    await _rows(conn, "select fl.worker_heartbeat(%s, %s)", (worker_id, state))


# -- queues ----------------------------------------------------------------------------------


async def resolve_queue(conn: Conn, ref: str) -> uuid.UUID:
    """A queue id from its uuid or its ``organization/project/queue`` path."""
    try:
        queue_id = uuid.UUID(ref)
    except ValueError:
        parts = ref.split("/")
        if len(parts) != 3 or not all(parts):
            raise EngineInputError(
                "FL001", f"queue {ref!r} is neither a queue id nor an org/project/queue path"
            ) from None
        rows = await _rows(
            conn,
            "select q.id from fl.queues q join fl.projects p on p.id = q.project_id"
            " join fl.organizations o on o.id = p.org_id"
            " where o.name = %s and p.name = %s and q.name = %s",
            parts,
        )
        if len(rows) > 1:
            raise EngineInputError("FL001", f"queue path {ref!r} is ambiguous: use the queue id"
                                   ) from None
    else:
        rows = await _rows(conn, "select id from fl.queues where id = %s", (queue_id,))
    if not rows:
        raise EngineInputError("FL001", f"queue {ref} does not exist")
    value = rows[0][0]
    assert isinstance(value, uuid.UUID)
    return value
