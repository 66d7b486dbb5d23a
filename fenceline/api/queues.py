"""Queues: configuration, the runtime figures of one queue, pause and resume.

Limits are nullable and PATCH tells absent (unchanged) from null (cleared, reference W23):
``max_concurrency``, ``max_depth``, the rate limit and ``aging_step_ms`` can be switched off
again. The rate limit is two fields that live together: ``rl_rate`` jobs per second and a
bucket of ``rl_burst`` jobs, both set or both null; a bucket below one token would admit
nothing, ever, and is refused (reference W17).

``retry_policy_id`` must name a policy of the queue's own project; a policy of another
project, visible to the caller or not, gets the same 400 as a policy that does not exist, so
the answer tells nothing about other tenants.

Pause and resume are idempotent. A change writes a ``queue.paused`` / ``queue.resumed`` event
and wakes the queue's listeners (``pg_notify('fl_queue', id)``) in the same transaction;
repeating it changes nothing and writes no event (the audit row is written either way).
"""

from __future__ import annotations

import uuid
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb

from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.pagination import decode_cursor, make_page, page_limit, page_query, page_schema
from fenceline.api.problems import Problem
from fenceline.api.records import (
    NAME,
    assignments,
    clean_name,
    dict_row,
    dict_rows,
    name_taken,
    write_unique,
)
from fenceline.api.validation import (
    INT32_MAX,
    Schema,
    boolean,
    integer,
    invalid,
    number,
    obj,
    string,
    timestamp,
    uuid_string,
)

resource = Resource("queues", "Queues")

MAX_RATE = 1_000_000.0

# Every writable field, with the ranges of the table's checks.
FIELDS: dict[str, Schema] = {
    "name": NAME,
    "retry_policy_id": uuid_string(description="A retry policy of the same project."),
    "default_priority": integer(description="Priority of jobs that give none; default 0."),
    "default_timeout_ms": integer(1, description="Timeout of jobs that give none; default "
                                                 "300,000."),
    "max_concurrency": integer(1, nullable=True,
                               description="Jobs running at once; null = no cap (default)."),
    "max_depth": integer(1, nullable=True,
                         description="Jobs waiting, checked on submit; null = no cap (default)."),
    "rl_rate": number(0.001, MAX_RATE, nullable=True,
                      description="Rate limit in jobs per second (with rl_burst); null = none."),
    "rl_burst": number(1, MAX_RATE, nullable=True,
                       description="Token bucket size, at least 1 (with rl_rate)."),
    "breaker_enabled": boolean("Circuit breaker on; default true."),
    "breaker_failure_ratio": number(0.01, 1, description="Default 0.5."),
    "breaker_min_volume": integer(1, description="Failures before it can trip; default 20."),
    "breaker_window_ms": integer(1, description="Default 60,000."),
    "breaker_cooldown_ms": integer(1, description="Default 30,000."),
    "aging_step_ms": integer(1, 86_400_000, nullable=True,
                             description="Priority aging: +1 level per this many ms waited; "
                                         "null = off (default)."),
    "aging_max_boost": integer(1, 1000, description="Most levels aging adds; default 10."),
}

RUNTIME = obj({"in_flight": integer(0, INT32_MAX, description="Jobs holding a lease."),
               "queued": integer(0, None, description="Jobs due and waiting for a worker."),
               "breaker_state": string(enum=("closed", "open", "half_open"))},
              ["in_flight", "queued", "breaker_state"])

VIEW_FIELDS = {"id": uuid_string(), "project_id": uuid_string(), "paused": boolean(),
               **FIELDS, "created_at": timestamp()}
QUEUE = obj(VIEW_FIELDS, list(VIEW_FIELDS))
QUEUE_DETAIL = obj({**VIEW_FIELDS, "runtime": RUNTIME}, [*VIEW_FIELDS, "runtime"])

COLUMNS = ", ".join(["id", "project_id", "paused", *FIELDS, "created_at"])


def _missing() -> Problem:
    return Problem(404, "not_found", "Not found", "queue not found")


def _project_id(call: Call) -> uuid.UUID:
    assert call.scope is not None and call.scope.project_id is not None
    return call.scope.project_id


async def _check_policy(call: Call, policy_id: uuid.UUID) -> None:
    cur = await call.conn.execute(
        "select 1 from fl.retry_policies where id = %s and project_id = %s",
        (policy_id, _project_id(call)))
    if await cur.fetchone() is None:
        raise invalid("retry_policy_id", "no such retry policy in this project")


def _check_rate(rate: float | None, burst: float | None) -> None:
    if (rate is None) != (burst is None):
        missing = "rl_burst" if burst is None else "rl_rate"
        raise invalid(missing, "rl_rate and rl_burst are set together, or both null")


async def _detail(call: Call, queue_id: uuid.UUID) -> dict[str, Any]:
    cur = await call.conn.execute(
        f"select {COLUMNS},"
        "       (select count(*) from fl.leases l where l.queue_id = q.id) as in_flight,"
        "       (select count(*) from fl.jobs j"
        "         where j.queue_id = q.id and j.status = 'queued') as queued,"
        "       coalesce(s.breaker_state::text, 'closed') as breaker_state"
        "  from fl.queues q left join fl.queue_state s on s.queue_id = q.id"
        " where q.id = %s", (queue_id,))
    queue = await dict_row(cur, _missing())
    queue["runtime"] = {k: queue.pop(k) for k in ("in_flight", "queued", "breaker_state")}
    return queue


@resource.route("POST", "/projects/{project_id}/queues", summary="Create a queue", role="admin",
                scope=("project", "project_id"), body=obj(FIELDS, ["name", "retry_policy_id"]),
                responses={201: QUEUE_DETAIL}, problems=(409,), audit="queue.create")
async def create_queue(call: Call) -> Reply:
    values: dict[str, Any] = dict(call.body)
    values["name"] = clean_name(values["name"])
    _check_rate(values.get("rl_rate"), values.get("rl_burst"))
    await _check_policy(call, values["retry_policy_id"])
    names = ["project_id", *values]
    query = sql.SQL("insert into fl.queues ({}) values ({}) returning id").format(
        sql.SQL(", ").join(map(sql.Identifier, names)),
        sql.SQL(", ").join(sql.Placeholder() * len(names)))
    cur = await write_unique(call, query, [_project_id(call), *values.values()],
                             name_taken("queue"))
    row = await cur.fetchone()
    assert row is not None
    call.audit_entity_id = str(row[0])
    call.audit_detail = values
    return Reply(201, await _detail(call, row[0]))


@resource.route("GET", "/projects/{project_id}/queues", summary="Queues of a project, by name",
                role="viewer", scope=("project", "project_id"), query=page_query(),
                responses={200: page_schema(QUEUE)})
async def list_queues(call: Call) -> Reply:
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("str",))
    cur = await call.conn.execute(
        f"select {COLUMNS} from fl.queues"
        " where project_id = %(p)s and (%(after)s::text is null or name > %(after)s)"
        " order by name limit %(n)s",
        {"p": _project_id(call), "after": after[0] if after else None, "n": limit + 1})
    items, nxt = make_page(await dict_rows(cur), limit, lambda r: [r["name"]])
    return Reply(200, {"items": items, "next_cursor": nxt})


@resource.route("GET", "/queues/{queue_id}",
                summary="One queue, with its runtime figures (in flight, queued, breaker)",
                role="viewer", scope=("queue", "queue_id"), responses={200: QUEUE_DETAIL})
async def get_queue(call: Call) -> Reply:
    return Reply(200, await _detail(call, call.params["queue_id"]))


@resource.route("PATCH", "/queues/{queue_id}",
                summary="Change a queue (absent = unchanged, null = no limit)", role="admin",
                scope=("queue", "queue_id"), body=obj(FIELDS), responses={200: QUEUE_DETAIL},
                problems=(409,), audit="queue.update")
async def update_queue(call: Call) -> Reply:
    queue_id = call.params["queue_id"]
    changes: dict[str, Any] = dict(call.body)
    if "name" in changes:
        changes["name"] = clean_name(changes["name"])
    cur = await call.conn.execute(
        "select rl_rate, rl_burst from fl.queues where id = %s for update", (queue_id,))
    row = await cur.fetchone()
    if row is None:
        raise _missing()
    _check_rate(changes.get("rl_rate", row[0]), changes.get("rl_burst", row[1]))
    if "retry_policy_id" in changes:
        await _check_policy(call, changes["retry_policy_id"])
    if changes:
        query = sql.SQL("update fl.queues set {} where id = {}").format(
            assignments(changes),
            sql.Placeholder())
        await write_unique(call, query, [*changes.values(), queue_id], name_taken("queue"))
    call.audit_detail = changes
    return Reply(200, await _detail(call, queue_id))


@resource.route("DELETE", "/queues/{queue_id}",
                summary="Delete a queue with its jobs and their history", role="admin",
                scope=("queue", "queue_id"), responses={204: None}, audit="queue.delete")
async def delete_queue(call: Call) -> Reply:
    cur = await call.conn.execute("delete from fl.queues where id = %s returning name",
                                  (call.params["queue_id"],))
    row = await cur.fetchone()
    call.audit_detail = {"name": row[0] if row else None}
    return Reply(204)


PAUSED = obj({"id": uuid_string(), "paused": boolean(),
              "changed": boolean("False when it already was in that state.")},
             ["id", "paused", "changed"])


async def _set_paused(call: Call, paused: bool) -> Reply:
    queue_id = call.params["queue_id"]
    cur = await call.conn.execute(
        "update fl.queues set paused = %s where id = %s and paused <> %s"
        " returning project_id", (paused, queue_id, paused))
    row = await cur.fetchone()
    changed = row is not None
    if row is not None:
        await call.conn.execute(
            "insert into fl.events (project_id, queue_id, topic, payload)"
            " values (%s, %s, %s, %s)",
            (row[0], queue_id, "queue.paused" if paused else "queue.resumed",
             Jsonb({"paused": paused})))
        await call.conn.execute("select pg_notify('fl_queue', %s)", (str(queue_id),))
    call.audit_detail = {"changed": changed}
    return Reply(200, {"id": queue_id, "paused": paused, "changed": changed})


@resource.route("POST", "/queues/{queue_id}/pause",
                summary="Stop admitting jobs (running jobs continue); idempotent",
                role="member", scope=("queue", "queue_id"), responses={200: PAUSED},
                audit="queue.pause")
async def pause_queue(call: Call) -> Reply:
    return await _set_paused(call, True)


@resource.route("POST", "/queues/{queue_id}/resume", summary="Admit jobs again; idempotent",
                role="member", scope=("queue", "queue_id"), responses={200: PAUSED},
                audit="queue.resume")
async def resume_queue(call: Call) -> Reply:
    return await _set_paused(call, False)
