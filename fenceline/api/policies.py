"""Retry policies: what happens after a failed attempt, and the ceilings that end a job.

The schema carries the table's ranges, so an out-of-range value is a 400 naming the field
before anything is read; the one cross-field rule (max_delay_ms >= base_delay_ms) is checked
here against the merged values of a PATCH. No field is nullable: an explicit null is a 400.

A policy still referenced by a queue or a job cannot be deleted (409 ``policy_in_use``):
queues are checked first (indexed); jobs through the deferred foreign key, made immediate
inside a savepoint, so a job submitted concurrently is caught too.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg import sql

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
    Schema,
    boolean,
    integer,
    invalid,
    obj,
    string,
    timestamp,
    uuid_string,
)

resource = Resource("policies", "Retry policies")

MAX_DELAY = 31_536_000_000   # one year, in ms (retry_policies_delays)

FIELDS: dict[str, Schema] = {
    "name": NAME,
    "kind": string(enum=("fixed", "linear", "exponential"),
                   description="Backoff shape; default exponential."),
    "base_delay_ms": integer(0, MAX_DELAY, description="Default 1000."),
    "max_delay_ms": integer(0, MAX_DELAY,
                            description="At least base_delay_ms; default 3,600,000."),
    "jitter": boolean("Spread delays randomly; default true."),
    "max_attempts": integer(1, 1000, description="Charged attempts per job; default 5."),
    "max_lost": integer(1, 1000, description="Attempts lost with their worker; default 3."),
    "max_timeouts": integer(1, 1000, description="Attempts that timed out; default 3."),
    "max_snoozes": integer(0, 100_000, description="Snoozes per job; default 100."),
}

POLICY = obj({"id": uuid_string(), "project_id": uuid_string(), **FIELDS,
              "created_at": timestamp()},
             ["id", "project_id", *FIELDS, "created_at"])

COLUMNS = ("id, project_id, name, kind::text as kind, base_delay_ms, max_delay_ms, jitter,"
           " max_attempts, max_lost, max_timeouts, max_snoozes, created_at")


def _missing() -> Problem:
    return Problem(404, "not_found", "Not found", "retry policy not found")


def _check_delays(base: int, most: int) -> None:
    if most < base:
        raise invalid("max_delay_ms", f"must be at least base_delay_ms ({base})")


def _scope_ids(call: Call) -> tuple[uuid.UUID, str]:
    assert call.scope is not None and call.scope.project_id is not None
    return call.scope.project_id, call.scope.entity_id


@resource.route("POST", "/projects/{project_id}/retry-policies", summary="Create a retry policy",
                role="admin", scope=("project", "project_id"), body=obj(FIELDS, ["name"]),
                responses={201: POLICY}, problems=(409,), audit="policy.create")
async def create_policy(call: Call) -> Reply:
    project_id, _ = _scope_ids(call)
    values: dict[str, Any] = dict(call.body)
    values["name"] = clean_name(values["name"])
    _check_delays(values.get("base_delay_ms", 1000), values.get("max_delay_ms", 3_600_000))
    names = ["project_id", *values]
    query = sql.SQL("insert into fl.retry_policies ({}) values ({}) returning {}").format(
        sql.SQL(", ").join(map(sql.Identifier, names)),
        sql.SQL(", ").join(sql.Placeholder() * len(names)), sql.SQL(COLUMNS))
    cur = await write_unique(call, query, [project_id, *values.values()], name_taken("policy"))
    policy = await dict_row(cur, _missing())
    call.audit_entity_id = str(policy["id"])
    call.audit_detail = values
    return Reply(201, policy)


@resource.route("GET", "/projects/{project_id}/retry-policies",
                summary="Retry policies of a project, by name", role="viewer",
                scope=("project", "project_id"), query=page_query(),
                responses={200: page_schema(POLICY)})
async def list_policies(call: Call) -> Reply:
    project_id, _ = _scope_ids(call)
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("str",))
    cur = await call.conn.execute(
        f"select {COLUMNS} from fl.retry_policies"
        " where project_id = %(p)s and (%(after)s::text is null or name > %(after)s)"
        " order by name limit %(n)s",
        {"p": project_id, "after": after[0] if after else None, "n": limit + 1})
    items, nxt = make_page(await dict_rows(cur), limit, lambda r: [r["name"]])
    return Reply(200, {"items": items, "next_cursor": nxt})


@resource.route("GET", "/retry-policies/{policy_id}", summary="One retry policy", role="viewer",
                scope=("policy", "policy_id"), responses={200: POLICY})
async def get_policy(call: Call) -> Reply:
    cur = await call.conn.execute(f"select {COLUMNS} from fl.retry_policies where id = %s",
                                  (call.params["policy_id"],))
    return Reply(200, await dict_row(cur, _missing()))


@resource.route("PATCH", "/retry-policies/{policy_id}",
                summary="Change a retry policy (absent fields stay as they are)", role="admin",
                scope=("policy", "policy_id"), body=obj(FIELDS), responses={200: POLICY},
                problems=(409,), audit="policy.update")
async def update_policy(call: Call) -> Reply:
    policy_id = call.params["policy_id"]
    changes: dict[str, Any] = dict(call.body)
    if "name" in changes:
        changes["name"] = clean_name(changes["name"])
    cur = await call.conn.execute(
        "select base_delay_ms, max_delay_ms from fl.retry_policies where id = %s for update",
        (policy_id,))
    row = await cur.fetchone()
    if row is None:
        raise _missing()
    _check_delays(changes.get("base_delay_ms", row[0]), changes.get("max_delay_ms", row[1]))
    if changes:
        query = sql.SQL("update fl.retry_policies set {} where id = {} returning {}").format(
            assignments(changes),
            sql.Placeholder(), sql.SQL(COLUMNS))
        cur = await write_unique(call, query, [*changes.values(), policy_id],
                                 name_taken("policy"))
    else:
        cur = await call.conn.execute(
            f"select {COLUMNS} from fl.retry_policies where id = %s", (policy_id,))
    call.audit_detail = changes
    return Reply(200, await dict_row(cur, _missing()))


@resource.route("DELETE", "/retry-policies/{policy_id}",
                summary="Delete a retry policy no queue or job uses", role="admin",
                scope=("policy", "policy_id"), responses={204: None}, problems=(409,),
                audit="policy.delete")
async def delete_policy(call: Call) -> Reply:
    policy_id = call.params["policy_id"]
    cur = await call.conn.execute(
        "select name from fl.queues where retry_policy_id = %s order by name limit 1",
        (policy_id,))
    queue = await cur.fetchone()
    if queue is not None:
        raise _in_use(f"queue {queue[0]!r} uses it; point the queue at another policy first")
    try:
        async with call.conn.transaction():
            cur = await call.conn.execute(
                "delete from fl.retry_policies where id = %s returning name", (policy_id,))
            row = await cur.fetchone()
            await call.conn.execute("set constraints all immediate")
    except psycopg.errors.ForeignKeyViolation:
        raise _in_use("jobs still use it (their own or their queue's policy)") from None
    call.audit_detail = {"name": row[0] if row else None}
    return Reply(204)


def _in_use(detail: str) -> Problem:
    return Problem(409, "policy_in_use", "Policy in use", detail)
