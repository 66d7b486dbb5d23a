"""Typed calls to the submission functions of migrations/0006_submission.sql.

``submit_job`` and ``submit_batch`` return the engine's outcome as-is: ``ok`` (created),
``existing`` (an idempotency key's earlier answer), ``idempotency_conflict``, ``queue_full``
or ``parent_failed``; bad input raises ``EngineInputError`` (FL011: a parent that does not
exist or is in another project).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from fenceline.engine.calls import Conn, _rows

UNKNOWN_PARENT = "FL011"


@dataclass(frozen=True)
class SubmittedJob:
    outcome: str
    job_id: int | None
    status: str | None
    priority: int | None
    run_at: dt.datetime | None
    created_at: dt.datetime | None
    detail: str | None


async def submit_job(conn: Conn, queue_id: uuid.UUID, job_type: str, payload: Any = None, *,
                     priority: int | None = None, run_at: dt.datetime | None = None,
                     delay_ms: int | None = None, timeout_ms: int | None = None,
                     retry_policy_id: uuid.UUID | None = None,
                     depends_on: Sequence[int] | None = None,
                     idempotency_key: str | None = None,
                     fingerprint: bytes | None = None) -> SubmittedJob:
    rows = await _rows(
        conn,
        "select outcome, job_id, status::text, priority, run_at, created_at, detail"
        " from fl.submit_job(%s, %s, %s, %s, %s, %s, %s, %s, %s::bigint[], %s, %s)",
        (queue_id, job_type, Jsonb(payload if payload is not None else {}), priority, run_at,
         delay_ms, timeout_ms, retry_policy_id,
         list(depends_on) if depends_on is not None else None, idempotency_key, fingerprint),
    )
    return SubmittedJob(*rows[0])


@dataclass(frozen=True)
class SubmittedBatch:
    outcome: str
    batch_id: uuid.UUID | None
    job_ids: list[int]
    detail: str | None


async def submit_batch(conn: Conn, queue_id: uuid.UUID, specs: Sequence[dict[str, Any]], *,
                       idempotency_key: str | None = None,
                       fingerprint: bytes | None = None) -> SubmittedBatch:
    """``specs``: dicts with the fields fl._submit_jobs documents (run_at as a datetime)."""
    rows = await _rows(
        conn,
        "select outcome, job_id, batch_id, detail from fl.submit_batch(%s, %s::jsonb, %s, %s)",
        (queue_id, json.dumps(list(specs), default=_json_default), idempotency_key,
         fingerprint),
    )
    first = rows[0]
    if first[0] not in ("ok", "existing"):
        return SubmittedBatch(first[0], None, [], first[3])
    return SubmittedBatch(first[0], first[2], [r[1] for r in rows], None)


@dataclass(frozen=True)
class BatchProgress:
    total: int
    done: int
    status_counts: dict[str, int]


async def batch_progress(conn: Conn, batch_id: uuid.UUID) -> BatchProgress:
    rows = await _rows(conn, "select total, done, status_counts from fl.batch_progress(%s)",
                       (batch_id,))
    return BatchProgress(*rows[0])


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")
