"""Job submission: one job, a batch of up to 1000, batch progress.

Both submissions honour an ``Idempotency-Key`` header (1 to 200 printable characters, per
queue, 24 hours). The key's fingerprint is SHA-256 over the request as sent: type, the payload
re-serialised with sorted keys, the optional fields as given (absent and null alike; run_at
normalised to UTC) and depends_on sorted. Resolved defaults are not part of it, so changing a
queue's default priority or policy does not turn a client's retry into a 409 (the reference
fingerprinted resolved values). Same key and fingerprint: 200 with the original job(s), even
if the queue has filled up since (reference W14: the key is looked up before the depth cap);
same key, different request: 409 ``idempotency_conflict``.

Dependencies (``depends_on``: ids of jobs in the same project; in a batch also
``depends_on_batch``: indexes of earlier entries) are settled by the engine
(migrations/0006_submission.sql): a parent that does not exist and a parent in another
tenant's project get the same 400 ``unknown_parent`` (reference W3); a parent already dead or
cancelled is a 409 ``parent_failed`` (W2).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from werkzeug.datastructures import Headers

from fenceline.api import auth, authz
from fenceline.api.endpoint import Call, Direct, Reply, Resource
from fenceline.api.problems import Problem
from fenceline.api.statements import Statement
from fenceline.api.validation import (
    INT64_MAX,
    any_json,
    array,
    integer,
    obj,
    string,
    timestamp,
    uuid_string,
)
from fenceline.engine import submission as engine
from fenceline.engine.calls import EngineInputError, _raise_engine_error

resource = Resource("submission", "Jobs")

MAX_PAYLOAD_BYTES = 262_144
MAX_BATCH = 1000
MAX_DELAY_MS = 315_360_000_000   # ten years, as the engine allows

JOB_FIELDS: dict[str, Any] = {
    "type": string(1, 200, description="Job type; surrounding blanks are trimmed."),
    "payload": any_json("Any JSON value (default {}); at most 256 KiB."),
    "priority": integer(nullable=True, description="Higher is claimed first; default: the "
                                                   "queue's default_priority."),
    "run_at": timestamp(nullable=True, description="Not before this time (default now)."),
    "delay_ms": integer(0, MAX_DELAY_MS, nullable=True,
                        description="Not before now + this many ms; not with run_at."),
    "timeout_ms": integer(1, nullable=True, description="Default: the queue's."),
    "retry_policy_id": uuid_string(nullable=True,
                                   description="A policy of the queue's project; default: "
                                               "the queue's."),
    "depends_on": array(integer(1, INT64_MAX), max_items=1000, unique=True,
                        description="Ids of jobs of the same project this job waits for."),
}

BATCH_ENTRY = obj(JOB_FIELDS | {
    "depends_on_batch": array(integer(0, MAX_BATCH - 1), max_items=MAX_BATCH, unique=True,
                              description="0-based indexes of earlier entries of this batch "
                                          "this job waits for."),
}, ["type"])

SUBMIT_VIEW = obj({
    "id": integer(1, INT64_MAX), "queue_id": uuid_string(), "type": string(),
    "status": string(nullable=True), "priority": integer(nullable=True),
    "run_at": timestamp(nullable=True), "created_at": timestamp(nullable=True),
}, ["id", "queue_id", "type", "status", "priority", "run_at", "created_at"])

BATCH_VIEW = obj({"batch_id": uuid_string(), "count": integer(1, MAX_BATCH),
                  "job_ids": array(integer(1, INT64_MAX))}, ["batch_id", "count", "job_ids"])

PROGRESS_VIEW = obj({
    "batch_id": uuid_string(), "total": integer(0, None), "done": integer(0, None),
    "complete": {"type": "boolean"},
    "status_counts": obj({}, additional=True),
}, ["batch_id", "total", "done", "complete", "status_counts"])


# -- the request as sent, for the engine and the fingerprint ------------------------------


def _spec(body: dict[str, Any], where: str) -> dict[str, Any]:
    """One job as the engine takes it, with the API's own checks (type, payload size)."""
    job_type = body["type"].strip()
    if not job_type:
        raise Problem(400, "invalid_input", "Invalid input", f"{where}type: must not be blank",
                      field=f"{where}type")
    payload = body.get("payload", {})
    size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_PAYLOAD_BYTES:
        raise Problem(413, "payload_too_large", "Payload too large",
                      f"{where}payload is {size} bytes, the limit is {MAX_PAYLOAD_BYTES}")
    if body.get("run_at") is not None and body.get("delay_ms") is not None:
        raise Problem(400, "invalid_input", "Invalid input",
                      f"{where}run_at: give run_at or delay_ms, not both", field=f"{where}run_at")
    spec: dict[str, Any] = {"type": job_type, "payload": payload}
    for name in ("priority", "run_at", "delay_ms", "timeout_ms", "retry_policy_id",
                 "depends_on", "depends_on_batch"):
        value = body.get(name)
        if value is None or value == []:
            continue
        if isinstance(value, dt.datetime):
            value = value.astimezone(dt.UTC).isoformat()
        elif isinstance(value, uuid.UUID):
            value = str(value)
        elif isinstance(value, list):
            value = sorted(value)
        spec[name] = value
    return spec


def fingerprint(kind: str, specs: list[dict[str, Any]]) -> bytes:
    """SHA-256 over the canonical request: keys sorted, compact, UTF-8."""
    canonical = json.dumps({"kind": kind, "jobs": specs}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).digest()


def idempotency_key(call: Call) -> str | None:
    return idempotency_key_of(call.headers)


def idempotency_key_of(headers: Headers) -> str | None:
    raw = headers.get("Idempotency-Key")
    if raw is None:
        return None
    key = raw.strip()
    if not 1 <= len(key) <= 200 or not key.isprintable():
        raise Problem(400, "invalid_input", "Invalid input",
                      "Idempotency-Key: must be 1 to 200 printable characters",
                      field="Idempotency-Key")
    return key


def _refusal(outcome: str, detail: str | None) -> Problem:
    if outcome == "queue_full":
        return Problem(429, "queue_full", "Queue full", detail, headers={"Retry-After": "1"})
    if outcome == "parent_failed":
        return Problem(409, "parent_failed", "Parent failed", detail)
    if outcome == "idempotency_conflict":
        return Problem(409, "idempotency_conflict", "Idempotency key reused",
                       "this Idempotency-Key was used for a different request in the last 24 "
                       "hours")
    raise AssertionError(f"unknown outcome {outcome}")


def _engine_problem(exc: EngineInputError) -> Problem:
    if exc.sqlstate == engine.UNKNOWN_PARENT:
        return Problem(400, "unknown_parent", "Unknown parent", str(exc))
    if exc.sqlstate == "FL002":
        return Problem(413, "payload_too_large", "Payload too large", str(exc))
    return Problem(400, "invalid_input", "Invalid input", str(exc))


# -- endpoints ---------------------------------------------------------------------------


def _job_args(body: dict[str, Any], spec: dict[str, Any], key: str | None) -> dict[str, Any]:
    """fl.submit_job's arguments for one job, by engine.submit_job's keyword names (the
    ordinary path calls it with them; the one-statement path binds them by the same names)."""
    return {
        "job_type": spec["type"], "payload": spec["payload"], "priority": spec.get("priority"),
        "run_at": body.get("run_at"), "delay_ms": spec.get("delay_ms"),
        "timeout_ms": spec.get("timeout_ms"), "retry_policy_id": body.get("retry_policy_id"),
        "depends_on": spec.get("depends_on"), "idempotency_key": key,
        "fingerprint": fingerprint("job", [spec]) if key else None}


def _submitted(got: engine.SubmittedJob, queue_id: uuid.UUID, job_type: str) -> Reply:
    """The answer to fl.submit_job's row: 201 created, 200 the key's earlier job, or the
    refusal."""
    if got.outcome not in ("ok", "existing"):
        raise _refusal(got.outcome, got.detail)
    assert got.job_id is not None
    return Reply(201 if got.outcome == "ok" else 200, {
        "id": got.job_id, "queue_id": queue_id, "type": job_type, "status": got.status,
        "priority": got.priority, "run_at": got.run_at, "created_at": got.created_at})


# POST /queues/{queue_id}/jobs as ONE statement: the caller and its role on the queue
# (fenceline.api.authz's statement), fl.submit_job only when that role is member or above,
# and the audit row only for a job created or found by its key; committed together as the
# statement's own transaction. Prepared per connection (fenceline/api/statements.py).
SUBMIT_AUDIT = "job.submit"
SUBMIT_ROLE = "member"
SUBMIT_TYPES = {
    "token": "bytea", "id": "uuid", "job_type": "text", "payload": "jsonb",
    "priority": "integer", "run_at": "timestamptz", "delay_ms": "bigint",
    "timeout_ms": "integer", "retry_policy_id": "uuid", "depends_on": "bigint[]",
    "idempotency_key": "text", "fingerprint": "bytea", "request_id": "text"}


def _submit_sql(caller_sql: str) -> str:
    roles = ", ".join(f"'{r}'" for r in authz.roles_from(SUBMIT_ROLE))
    return (
        "with a as materialized (" + authz.statement_sql(caller_sql, "queue") + "),"
        " s as materialized ("
        "   select r.outcome, r.job_id, r.status::text, r.priority, r.run_at, r.created_at,"
        "          r.detail"
        "     from a cross join lateral fl.submit_job("
        "            %(id)s::uuid, %(job_type)s::text, %(payload)s::jsonb,"
        "            %(priority)s::integer, %(run_at)s::timestamptz, %(delay_ms)s::bigint,"
        "            %(timeout_ms)s::integer, %(retry_policy_id)s::uuid,"
        "            %(depends_on)s::bigint[], %(idempotency_key)s::text,"
        "            %(fingerprint)s::bytea) r"
        f"   where a.role in ({roles})),"
        " w as ("
        "   insert into fl.audit_log (org_id, project_id, actor_user, actor_key, action,"
        "                             entity, entity_id, detail, request_id)"
        f"  select a.org_id, a.project_id, a.user_id, a.key_id, '{SUBMIT_AUDIT}',"
        f"         '{SUBMIT_AUDIT.split('.')[0]}', s.job_id::text,"
        "          jsonb_build_object('queue_id', %(id)s::uuid::text, 'type', %(job_type)s::text,"
        "                             'replayed', s.outcome = 'existing'),"
        "          %(request_id)s::text"
        "     from a, s where s.outcome in ('ok', 'existing'))"
        " select a.*, s.* from a left join s on true")


SUBMIT_STATEMENTS = {caller_sql: Statement(_submit_sql(caller_sql), SUBMIT_TYPES)
                     for caller_sql in (auth.SESSION_CALLER, auth.KEY_CALLER)}


async def submit_direct(req: Direct) -> Reply | None:
    """The single submission in one round trip; the same answers as ``submit`` below."""
    assert req.endpoint.audit == SUBMIT_AUDIT and req.endpoint.role == SUBMIT_ROLE
    caller_sql = auth.caller_query(req.token)
    try:
        # The handler's own checks answer after authorisation: leave them to the ordinary
        # path, which authorises first.
        key = idempotency_key_of(req.headers)
        spec = _spec(req.body, "")
    except Problem:
        return None
    if caller_sql is None or req.token is None:
        return None
    queue_id = req.params["queue_id"]
    args = _job_args(req.body, spec, key)
    values = {"token": auth.token_hash(req.token), "id": queue_id,
              "request_id": req.request_id, **args, "payload": Jsonb(args["payload"])}
    try:
        cur = await SUBMIT_STATEMENTS[caller_sql].execute(req.conn, values)
        row = await cur.fetchone()
    except psycopg.Error as exc:
        try:
            _raise_engine_error(exc)
        except EngineInputError as err:
            raise _engine_problem(err) from None
        raise
    authz.decide(None if row is None else row[:9], "queue", SUBMIT_ROLE)
    assert row is not None
    return _submitted(engine.SubmittedJob(*row[9:]), queue_id, spec["type"])


@resource.route(
    "POST", "/queues/{queue_id}/jobs", summary="Submit a job", role=SUBMIT_ROLE,
    scope=("queue", "queue_id"), body=obj(JOB_FIELDS, ["type"]),
    responses={201: SUBMIT_VIEW, 200: SUBMIT_VIEW}, problems=(409, 429), audit=SUBMIT_AUDIT,
    direct=submit_direct)
async def submit(call: Call) -> Reply:
    key = idempotency_key(call)
    spec = _spec(call.body, "")
    queue_id = call.params["queue_id"]
    try:
        got = await engine.submit_job(call.conn, queue_id, **_job_args(call.body, spec, key))
    except EngineInputError as exc:
        raise _engine_problem(exc) from None
    reply = _submitted(got, queue_id, spec["type"])
    assert got.job_id is not None
    call.audit_entity_id = str(got.job_id)
    call.audit_detail = {"queue_id": queue_id, "type": spec["type"],
                         "replayed": got.outcome == "existing"}
    return reply


@resource.route(
    "POST", "/queues/{queue_id}/jobs/batch", summary="Submit up to 1000 jobs at once",
    role="member", scope=("queue", "queue_id"),
    body=obj({"jobs": array(BATCH_ENTRY, 1, MAX_BATCH)}, ["jobs"]),
    responses={201: BATCH_VIEW, 200: BATCH_VIEW}, problems=(409, 429),
    audit="job.submit_batch")
async def submit_batch(call: Call) -> Reply:
    key = idempotency_key(call)
    specs = [_spec(job, f"jobs[{i}].") for i, job in enumerate(call.body["jobs"])]
    queue_id = call.params["queue_id"]
    try:
        got = await engine.submit_batch(
            call.conn, queue_id, specs, idempotency_key=key,
            fingerprint=fingerprint("batch", specs) if key else None)
    except EngineInputError as exc:
        raise _engine_problem(exc) from None
    if got.outcome not in ("ok", "existing"):
        raise _refusal(got.outcome, got.detail)
    assert got.batch_id is not None
    call.audit_entity_id = str(got.batch_id)
    call.audit_detail = {"queue_id": queue_id, "count": len(got.job_ids),
                         "replayed": got.outcome == "existing"}
    return Reply(201 if got.outcome == "ok" else 200,
                 {"batch_id": got.batch_id, "count": len(got.job_ids), "job_ids": got.job_ids})


@resource.route(
    "GET", "/batches/{batch_id}", summary="Progress of a batch", role="viewer",
    scope=("batch", "batch_id"), responses={200: PROGRESS_VIEW})
async def batch(call: Call) -> Reply:
    batch_id = call.params["batch_id"]
    progress = await engine.batch_progress(call.conn, batch_id)
    return Reply(200, {"batch_id": batch_id, "total": progress.total, "done": progress.done,
                       "complete": progress.done == progress.total,
                       "status_counts": progress.status_counts})
