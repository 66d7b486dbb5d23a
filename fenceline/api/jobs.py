"""Jobs: list, read one (with its attempts, logs, dependencies and lease), cancel, retry.

Every state change is one engine function (fl.cancel, fl.retry) whose outcomes are mapped
one by one below; nothing here reads a job's state and then writes it. The only read before
a change is the job's previous status, taken under the row lock the engine function then
re-takes in the same transaction, so the ``from`` an answer reports is the status the change
really left.

Lists are keyset-paged newest job first, on ``id`` (job ids are bigint identity and only
grow). A page is a merge of one short ordered range per (queue, status) of the index
``jobs_list (queue_id, status, id)`` (migrations/0007_job_reads.sql), so its cost does not
grow with the number of finished jobs.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.pagination import decode_cursor, make_page, page_limit, page_query, page_schema
from fenceline.api.problems import Problem
from fenceline.api.validation import (
    INT64_MAX,
    any_json,
    array,
    boolean,
    integer,
    number,
    obj,
    string,
    timestamp,
    uuid_string,
)
from fenceline.engine.calls import EngineInputError

resource = Resource("jobs", "Jobs")

STATUSES = ("scheduled", "queued", "running", "retry_wait", "completed", "dead_letter",
            "cancelled")
OUTCOMES = ("success", "retryable_error", "permanent_error", "timeout", "lost", "snoozed",
            "released", "cancelled")

JOB_ID = integer(1, INT64_MAX)
STATUS = string(enum=STATUSES)

ITEM_FIELDS = ("id", "queue_id", "type", "status", "priority", "attempts", "replay_generation",
               "run_at", "created_at", "finished_at", "batch_id")
JOB_ITEM = obj({
    "id": JOB_ID, "queue_id": uuid_string(), "type": string(1, 200), "status": STATUS,
    "priority": integer(), "attempts": integer(0), "replay_generation": integer(0),
    "run_at": timestamp(), "created_at": timestamp(), "finished_at": timestamp(nullable=True),
    "batch_id": uuid_string(nullable=True)}, ITEM_FIELDS)

JOB_FIELDS = ("id", "project_id", "queue_id", "type", "payload", "status", "priority", "run_at",
              "fence", "attempts", "lost_count", "timeout_count", "snooze_count",
              "replay_generation", "timeout_ms", "retry_policy_id", "deadline_at",
              "cancel_requested_at", "created_at", "claimed_at", "finished_at", "batch_id",
              "pending_deps")
JOB = obj({
    "id": JOB_ID, "project_id": uuid_string(), "queue_id": uuid_string(),
    "type": string(1, 200), "payload": any_json(), "status": STATUS, "priority": integer(),
    "run_at": timestamp(), "fence": integer(0, INT64_MAX), "attempts": integer(0),
    "lost_count": integer(0), "timeout_count": integer(0), "snooze_count": integer(0),
    "replay_generation": integer(0), "timeout_ms": integer(1),
    "retry_policy_id": uuid_string(), "deadline_at": timestamp(nullable=True),
    "cancel_requested_at": timestamp(nullable=True), "created_at": timestamp(),
    "claimed_at": timestamp(nullable=True), "finished_at": timestamp(nullable=True),
    "batch_id": uuid_string(nullable=True), "pending_deps": integer(0)}, JOB_FIELDS)

LOG = obj({"id": integer(1, INT64_MAX), "ts": timestamp(),
           "level": string(enum=["debug", "info", "warn", "error"]), "message": string(),
           "meta": any_json()}, ["id", "ts", "level", "message", "meta"])

ATTEMPT_FIELDS = ("attempt", "replay_generation", "fence", "worker_id", "outcome",
                  "error_class", "error_message", "started_at", "deadline_at", "finished_at",
                  "duration_ms", "result")
ATTEMPT = obj({
    "attempt": integer(0), "replay_generation": integer(0), "fence": integer(1, INT64_MAX),
    "worker_id": uuid_string(), "outcome": string(enum=OUTCOMES, nullable=True),
    "error_class": string(nullable=True), "error_message": string(nullable=True),
    "started_at": timestamp(), "deadline_at": timestamp(),
    "finished_at": timestamp(nullable=True),
    "duration_ms": number(0, nullable=True, description="null while the attempt runs"),
    "result": any_json(), "logs": array(LOG)}, (*ATTEMPT_FIELDS, "logs"))

RELATIVE = obj({"id": JOB_ID, "type": string(1, 200), "status": STATUS},
               ["id", "type", "status"])

LEASE = obj({"worker_id": uuid_string(), "fence": integer(1, INT64_MAX),
             "expires_at": timestamp(), "heartbeat_at": timestamp(), "progress": any_json()},
            ["worker_id", "fence", "expires_at", "heartbeat_at", "progress"])

JOB_VIEW = obj({"job": JOB, "attempts": array(ATTEMPT), "parents": array(RELATIVE),
                "children": array(RELATIVE),
                "lease": LEASE}, ["job", "attempts", "parents", "children"],
               description="lease is present only while the job is running.")

# At most this many log lines per attempt and parents/children per job in one answer.
MAX_LOGS = 1000
MAX_RELATIVES = 1000


# -- the scope of a list: ?project= or ?queue= -------------------------------------------


async def list_scope(call: Call) -> tuple[uuid.UUID, uuid.UUID | None]:
    """(project id, queue id or None) of a list; viewer of it, or 400/403/404."""
    project = call.query.get("project")
    queue = call.query.get("queue")
    if project is None and queue is None:
        raise Problem(400, "scope_required", "Scope required",
                      "give a project or a queue query parameter", field="project")
    if queue is not None:
        scope = await call.resolve("queue", queue, "viewer")
        if project is not None and scope.project_id != project:
            raise Problem(400, "invalid_input", "Invalid input",
                          "queue: is not in the given project", field="queue")
        assert scope.project_id is not None
        return scope.project_id, queue
    scope = await call.resolve("project", project, "viewer")
    assert scope.project_id is not None
    return scope.project_id, None


SCOPE_QUERY = {"project": uuid_string(description="List this project's (or give queue)."),
               "queue": uuid_string(description="List this queue's (or give project).")}


# A page: per (queue in scope, status wanted), the newest ids below the cursor, one ordered
# range of jobs_list each, merged.
LIST_SQL = (
    "select j.id, j.queue_id, j.type, j.status::text, j.priority, j.attempts,"
    "       j.replay_generation, j.run_at, j.created_at, j.finished_at, j.batch_id"
    "  from fl.queues q"
    " cross join unnest(%(statuses)s::fl.job_status[]) as s(st)"
    " cross join lateral ("
    "       select * from fl.jobs x"
    "        where x.queue_id = q.id and x.status = s.st and x.id < %(after)s"
    "          and (%(type)s::text is null or x.type = %(type)s::text)"
    "        order by x.id desc limit %(n)s) j"
    " where q.project_id = %(project)s and (%(queue)s::uuid is null or q.id = %(queue)s)"
    " order by j.id desc limit %(n)s")


# -- GET /jobs -----------------------------------------------------------------------------


@resource.route(
    "GET", "/jobs", summary="List jobs of a project or a queue, newest first", role="viewer",
    query=page_query(**SCOPE_QUERY, status=STATUS, type=string(1, 200)),
    responses={200: page_schema(JOB_ITEM)}, problems=(403, 404))
async def list_jobs(call: Call) -> Reply:
    project, queue = await list_scope(call)
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("int",))
    status = call.query.get("status")
    cur = await call.conn.execute(
        LIST_SQL,
        {"statuses": [status] if status else list(STATUSES),
         "after": after[0] if after else INT64_MAX, "type": call.query.get("type"),
         "n": limit + 1, "project": project, "queue": queue})
    rows = await cur.fetchall()
    items, next_cursor = make_page(rows, limit, lambda r: [r[0]])
    return Reply(200, {"items": [dict(zip(ITEM_FIELDS, r, strict=True)) for r in items],
                       "next_cursor": next_cursor})


# -- GET /jobs/{job_id} ------------------------------------------------------------------


@resource.route(
    "GET", "/jobs/{job_id}", summary="One job with its attempts, logs, parents and children",
    role="viewer", scope=("job", "job_id"), responses={200: JOB_VIEW})
async def get_job(call: Call) -> Reply:
    job_id = call.params["job_id"]
    cur = await call.conn.execute(
        f"select {', '.join('j.' + f for f in JOB_FIELDS)} from fl.jobs j where j.id = %s",
        (job_id,))
    row = await cur.fetchone()
    if row is None:   # deleted since the scope was resolved
        raise Problem(404, "not_found", "Not found", "job not found")
    job = dict(zip(JOB_FIELDS, row, strict=True))
    job["status"] = str(job["status"])
    view: dict[str, Any] = {"job": job, "attempts": await _attempts(call, job_id)}
    view["parents"], view["children"] = await _relatives(call, job_id, job["project_id"])
    cur = await call.conn.execute(
        "select l.worker_id, l.fence, l.expires_at, l.heartbeat_at, l.progress"
        "  from fl.leases l"
        " where l.queue_id = %s and l.job_id = %s and l.fence = %s",
        (job["queue_id"], job_id, job["fence"]))
    lease = await cur.fetchone()
    if lease is not None and job["status"] == "running":
        view["lease"] = dict(zip(("worker_id", "fence", "expires_at", "heartbeat_at",
                                  "progress"), lease, strict=True))
    return Reply(200, view)


async def _attempts(call: Call, job_id: int) -> list[dict[str, Any]]:
    cur = await call.conn.execute(
        "select a.attempt, a.replay_generation, a.fence, a.worker_id, a.outcome::text,"
        "       a.error_class, a.error_message, a.started_at, a.deadline_at, a.finished_at,"
        "       extract(epoch from a.finished_at - a.started_at) * 1000, a.result,"
        "       coalesce((select jsonb_agg(jsonb_build_object("
        "                     'id', g.id, 'ts', g.ts, 'level', g.level, 'message', g.message,"
        "                     'meta', g.meta) order by g.ts, g.id)"
        "                   from (select * from fl.attempt_logs lg"
        "                          where lg.job_id = a.job_id and lg.fence = a.fence"
        "                          order by lg.ts, lg.id limit %s) g), '[]'::jsonb)"
        "  from fl.attempts a where a.job_id = %s order by a.fence",
        (MAX_LOGS, job_id))
    out = []
    for row in await cur.fetchall():
        attempt = dict(zip(ATTEMPT_FIELDS, row[:-1], strict=True))
        if attempt["duration_ms"] is not None:
            attempt["duration_ms"] = float(attempt["duration_ms"])
        attempt["logs"] = row[-1]
        out.append(attempt)
    return out


async def _relatives(call: Call, job_id: int, project_id: uuid.UUID,
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Parents and children from fl.job_dependencies, when that table exists (issue 4)."""
    cur = await call.conn.execute("select to_regclass('fl.job_dependencies') is not null")
    row = await cur.fetchone()
    if row is None or not row[0]:
        return [], []
    found = []
    for mine, theirs in (("child_id", "parent_id"), ("parent_id", "child_id")):
        # Only jobs of the same project, whatever an edge says: never show another tenant's.
        cur = await call.conn.execute(
            f"select j.id, j.type, j.status::text from fl.job_dependencies d"
            f"  join fl.jobs j on j.id = d.{theirs}"
            f" where d.{mine} = %s and j.project_id = %s order by j.id limit %s",
            (job_id, project_id, MAX_RELATIVES))
        found.append([{"id": r[0], "type": r[1], "status": r[2]} for r in await cur.fetchall()])
    return found[0], found[1]


# -- actions -------------------------------------------------------------------------------


async def _lock_status(call: Call) -> str:
    """The job's status, locked until commit (the engine function re-takes the same lock)."""
    cur = await call.conn.execute(
        "select status::text from fl.jobs where id = %s for update", (call.params["job_id"],))
    row = await cur.fetchone()
    if row is None:
        raise Problem(404, "not_found", "Not found", "job not found")
    return str(row[0])


async def engine_rows(call: Call, query: str, params: Any) -> list[Any]:
    """Rows of an engine function call; its bad-input errors (SQLSTATE FLxxx) as such.

    endpoint.database_problem tests for OperationalError before it looks at the SQLSTATE,
    and psycopg raises the unknown class FL as an OperationalError, so without this an
    engine's 400 would come out as a 503.
    """
    try:
        cur = await call.conn.execute(query, params)
        return await cur.fetchall()
    except psycopg.Error as exc:
        state = exc.sqlstate or ""
        if state.startswith("FL"):
            raise EngineInputError(state, exc.diag.message_primary or str(exc)) from None
        raise


async def _engine(call: Call, function: str) -> tuple[str, str | None]:
    rows = await engine_rows(call, f"select outcome, status::text from fl.{function}(%s)",
                             (call.params["job_id"],))
    row = rows[0] if rows else None
    assert row is not None, function    # every outcome is one row
    return str(row[0]), row[1]


def _unexpected(outcome: str, status: str | None) -> Problem:
    return Problem(409, "conflict", "Conflict",
                   f"the job could not be changed ({outcome}, status {status})",
                   job_status=status)


CANCELLED = obj({"id": JOB_ID, "status": string(enum=["cancelled"]), "from": STATUS},
                ["id", "status", "from"])
CANCEL_REQUESTED = obj({"id": JOB_ID, "status": string(enum=["running"]),
                        "cancel_requested": boolean()}, ["id", "status", "cancel_requested"],
                       description="The job is running: its worker is told to stop; it ends "
                                   "cancelled when the worker reports or its lease lapses.")


@resource.route(
    "POST", "/jobs/{job_id}/cancel", summary="Cancel a job (a running job is asked to stop)",
    role="member", scope=("job", "job_id"),
    responses={200: CANCELLED, 202: CANCEL_REQUESTED}, problems=(409,), audit="job.cancel")
async def cancel_job(call: Call) -> Reply:
    job_id = call.params["job_id"]
    before = await _lock_status(call)
    outcome, status = await _engine(call, "cancel")
    call.audit_detail = {"from": before, "outcome": outcome}
    if outcome == "ok":
        return Reply(200, {"id": job_id, "status": "cancelled", "from": before})
    if outcome == "cancel_requested":
        return Reply(202, {"id": job_id, "status": "running", "cancel_requested": True})
    if outcome == "conflict":
        raise Problem(409, "already_terminal", "Already finished",
                      f"the job is already {status}", job_status=status)
    if outcome == "not_found":
        raise Problem(404, "not_found", "Not found", "job not found")
    raise _unexpected(outcome, status)


RETRIED = obj({"id": JOB_ID, "status": string(enum=["queued"]), "from": STATUS},
              ["id", "status", "from"])


@resource.route(
    "POST", "/jobs/{job_id}/retry",
    summary="Run a waiting job now (retry_wait, or scheduled with no pending parents)",
    role="member", scope=("job", "job_id"), responses={200: RETRIED}, problems=(409,),
    audit="job.retry")
async def retry_job(call: Call) -> Reply:
    job_id = call.params["job_id"]
    before = await _lock_status(call)
    outcome, status = await _engine(call, "retry")
    call.audit_detail = {"from": before}
    if outcome == "ok":
        return Reply(200, {"id": job_id, "status": "queued", "from": before})
    if outcome == "dead":
        raise Problem(409, "not_retryable", "Not retryable",
                      "the job is in the dead letter queue: replay it instead",
                      job_status=status)
    if outcome == "conflict":
        detail = (f"the job is {status}" if status != "scheduled"
                  else "the job is waiting for its parents")
        raise Problem(409, "not_retryable", "Not retryable",
                      f"{detail}; only a job waiting to retry or scheduled can be run now",
                      job_status=status)
    if outcome == "not_found":
        raise Problem(404, "not_found", "Not found", "job not found")
    raise _unexpected(outcome, status)
