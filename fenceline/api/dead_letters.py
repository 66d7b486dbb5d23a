"""The dead letter queue: list deaths, read one with its attempt history, replay.

A job that dies gets one fl.dead_letters row per death (per replay generation), with the whole
ledger at that moment; replay (fl.replay) puts it back to ``queued`` with fresh counters and a
new generation, and the history stays. Bulk replay (fl.replay_dead_paced, migrations/0007)
takes the oldest deaths first within the room the queue's depth cap leaves, may stagger their
start times, and is accepted at most once per queue per second.

Lists are keyset-paged newest death first, on the dead letter's id (an identity, so it grows
with time), from the index ``dead_letters_list (queue_id, id)``.
"""

from __future__ import annotations

import datetime as dt

from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.jobs import JOB_ID, SCOPE_QUERY, STATUS, engine_rows, list_scope
from fenceline.api.pagination import decode_cursor, make_page, page_limit, page_query, page_schema
from fenceline.api.problems import Problem
from fenceline.api.validation import (
    INT64_MAX,
    array,
    boolean,
    integer,
    number,
    obj,
    string,
    timestamp,
    uuid_string,
)

resource = Resource("dead_letters", "Dead letters")

# One bulk replay per queue per this many seconds.
BULK_REPLAY_GAP_S = 1

REASONS = ("permanent_error", "attempts_exhausted", "lost_exhausted", "timeout_exhausted",
           "snoozes_exhausted")

ITEM_FIELDS = ("job_id", "queue_id", "type", "replay_generation", "reason", "error_class",
               "error_message", "dead_at", "replayed_at", "attempts")
ITEM_SCHEMAS = {
    "job_id": JOB_ID, "queue_id": uuid_string(), "type": string(1, 200),
    "replay_generation": integer(0, description="The generation that died."),
    "reason": string(enum=REASONS), "error_class": string(nullable=True),
    "error_message": string(nullable=True), "dead_at": timestamp(),
    "replayed_at": timestamp(nullable=True, description="Set once this death was replayed."),
    "attempts": integer(0, description="Attempts charged in the generation that died.")}
ITEM = obj(ITEM_SCHEMAS, ITEM_FIELDS)

# The columns behind ITEM_FIELDS, over fl.dead_letters d joined to fl.jobs j.
_ITEM_SQL = (
    "d.job_id, d.queue_id, j.type, d.replay_generation, d.reason, d.error_class,"
    " d.error_message, d.dead_at, d.replayed_at,"
    " (select count(*)::int from jsonb_array_elements(d.attempt_history) e"
    "   where (e->>'generation')::int = d.replay_generation"
    "     and e->>'outcome' not in ('snoozed', 'released'))")

HISTORY_ENTRY = obj({
    "fence": integer(1, INT64_MAX), "generation": integer(0), "attempt": integer(0),
    "worker": uuid_string(), "started_at": timestamp(), "finished_at": timestamp(nullable=True),
    "outcome": string(nullable=True), "error_class": string(nullable=True),
    "error_message": string(nullable=True)}, additional=True)

DETAIL = obj({**ITEM_SCHEMAS, "job_status": STATUS,
              "deaths": integer(1, description="How many times this job has died."),
              "attempt_history": array(HISTORY_ENTRY,
                                       description="Every attempt of every generation, as "
                                                   "recorded at this death.")},
             (*ITEM_FIELDS, "job_status", "deaths", "attempt_history"))


@resource.route(
    "GET", "/dead-letters", summary="List deaths of a project's or a queue's jobs, newest first",
    role="viewer", query=page_query(**SCOPE_QUERY), responses={200: page_schema(ITEM)},
    problems=(403, 404))
async def list_dead_letters(call: Call) -> Reply:
    project, queue = await list_scope(call)
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("int",))
    cur = await call.conn.execute(
        f"select d.id, {_ITEM_SQL}"
        "  from fl.queues q"
        " cross join lateral ("
        "       select * from fl.dead_letters x"
        "        where x.queue_id = q.id and x.id < %(after)s"
        "        order by x.id desc limit %(n)s) d"
        "  join fl.jobs j on j.id = d.job_id"
        " where q.project_id = %(project)s and (%(queue)s::uuid is null or q.id = %(queue)s)"
        " order by d.id desc limit %(n)s",
        {"after": after[0] if after else INT64_MAX, "n": limit + 1, "project": project,
         "queue": queue})
    rows = await cur.fetchall()
    items, next_cursor = make_page(rows, limit, lambda r: [r[0]])
    return Reply(200, {"items": [dict(zip(ITEM_FIELDS, r[1:], strict=True)) for r in items],
                       "next_cursor": next_cursor})


@resource.route(
    "GET", "/dead-letters/{job_id}",
    summary="A job's latest death, with the attempt history recorded then", role="viewer",
    scope=("job", "job_id"), responses={200: DETAIL})
async def get_dead_letter(call: Call) -> Reply:
    cur = await call.conn.execute(
        f"select {_ITEM_SQL}, j.status::text,"
        "       (select count(*)::int from fl.dead_letters c where c.job_id = d.job_id),"
        "       d.attempt_history"
        "  from fl.dead_letters d join fl.jobs j on j.id = d.job_id"
        " where d.job_id = %s order by d.replay_generation desc limit 1",
        (call.params["job_id"],))
    row = await cur.fetchone()
    if row is None:
        raise Problem(404, "not_found", "Not found", "this job has never been dead-lettered")
    return Reply(200, dict(zip((*ITEM_FIELDS, "job_status", "deaths", "attempt_history"), row,
                               strict=True)))


REPLAYED = obj({"id": JOB_ID, "status": string(enum=["queued"]),
                "replay_generation": integer(1)}, ["id", "status", "replay_generation"])


@resource.route(
    "POST", "/jobs/{job_id}/replay",
    summary="Replay a dead job: queued again with fresh counters, history kept",
    role="member", scope=("job", "job_id"), responses={200: REPLAYED}, problems=(409, 429),
    audit="job.replay")
async def replay_job(call: Call) -> Reply:
    job_id = call.params["job_id"]
    [(outcome, status)] = await engine_rows(
        call, "select outcome, status::text from fl.replay(%s)", (job_id,))
    if outcome == "ok":
        # A new statement, so it sees the replay (the job stays locked until commit).
        cur = await call.conn.execute("select replay_generation from fl.jobs where id = %s",
                                      (job_id,))
        (generation,) = await cur.fetchone() or (None,)
        call.audit_detail = {"replay_generation": generation}
        return Reply(200, {"id": job_id, "status": "queued", "replay_generation": generation})
    if outcome == "conflict":
        raise Problem(409, "not_dead", "Not dead",
                      f"the job is {status}, not in the dead letter queue", job_status=status)
    if outcome == "queue_full":
        raise Problem(429, "queue_full", "Queue full",
                      "the queue is at its max_depth; replay when it has drained")
    if outcome == "not_found":
        raise Problem(404, "not_found", "Not found", "job not found")
    raise Problem(409, "conflict", "Conflict", f"the job could not be replayed ({outcome})",
                  job_status=status)


BULK = obj({
    "limit": integer(1, 1000, description="At most this many jobs (default 100)."),
    "rate_per_sec": number(0, 1_000_000, description=(
        "0 (default): every job is due now. Else the k-th job (oldest death first) is due "
        "at now + (k-1)/rate seconds; at least 0.001."))})

BULK_DONE = obj({"replayed": integer(0), "job_ids": array(JOB_ID),
                 "queue_full": boolean(description="The depth cap left no room.")},
                ["replayed", "job_ids", "queue_full"])


@resource.route(
    "POST", "/queues/{queue_id}/dead-letters/replay",
    summary="Replay a queue's dead jobs, oldest death first, optionally staggered",
    role="member", scope=("queue", "queue_id"), body=BULK, responses={200: BULK_DONE},
    problems=(429,), audit="job.replay_bulk")
async def replay_queue(call: Call) -> Reply:
    limit = call.body.get("limit", 100)
    rate = float(call.body.get("rate_per_sec", 0))
    rows = await engine_rows(
        call,
        "select r.outcome, r.job_id, r.retry_at,"
        "       ceil(extract(epoch from r.retry_at - fl.now()))::int"
        "  from fl.replay_dead_paced(%s, %s, %s, %s) r",
        (call.params["queue_id"], limit, rate, dt.timedelta(seconds=BULK_REPLAY_GAP_S)))
    outcomes = {r[0] for r in rows}
    if outcomes == {"rate_limited"}:
        wait = max(1, rows[0][3] or 1)
        raise Problem(429, "rate_limited", "Too many bulk replays",
                      f"one bulk replay per queue every {BULK_REPLAY_GAP_S} s; retry in {wait} s",
                      headers={"Retry-After": str(wait)}, retry_at=rows[0][2])
    if outcomes not in ({"ok"}, {"queue_full"}, {"empty"}):
        raise Problem(409, "conflict", "Conflict",
                      f"bulk replay ended with {sorted(outcomes)}")
    ids = [r[1] for r in rows if r[0] == "ok"]
    call.audit_detail = {"replayed": len(ids), "limit": limit,
                         "rate_per_sec": 0 if rate == 0 else rate}
    return Reply(200, {"replayed": len(ids), "job_ids": ids,
                       "queue_full": outcomes == {"queue_full"}})

