"""Workers serving a project's (or one queue's) queues.

Workers are not tenants' rows: a worker registers for queues with the database URL and may
serve queues of several projects. A project's viewer sees the workers subscribed to at least
one of its queues, and of each only what concerns the project: its queues in the project and
the leases it holds there. Keyset-paged on the worker id (uuid v7, so newest registration
first); ``last_seen_at`` moves with every heartbeat, so it cannot be a stable page key.
"""

from __future__ import annotations

import uuid

from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.jobs import SCOPE_QUERY, list_scope
from fenceline.api.pagination import decode_cursor, make_page, page_limit, page_query, page_schema
from fenceline.api.validation import array, integer, obj, string, timestamp, uuid_string

resource = Resource("workers", "Workers")

FIELDS = ("id", "hostname", "pid", "state", "concurrency", "queues", "leases", "started_at",
          "last_seen_at")
WORKER = obj({
    "id": uuid_string(), "hostname": string(1, 255), "pid": integer(1),
    "state": string(enum=["active", "draining", "stopped", "dead"]),
    "concurrency": integer(1), "queues": array(uuid_string(),
                                               description="Its queues in this project."),
    "leases": integer(0, description="Jobs it runs now in this project's queues."),
    "started_at": timestamp(), "last_seen_at": timestamp()}, FIELDS)

LAST_UUID = uuid.UUID(int=2**128 - 1)


@resource.route(
    "GET", "/workers", summary="Workers serving a project's or a queue's jobs", role="viewer",
    query=page_query(**SCOPE_QUERY), responses={200: page_schema(WORKER)}, problems=(403, 404))
async def list_workers(call: Call) -> Reply:
    project, queue = await list_scope(call)
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("uuid",))
    cur = await call.conn.execute(
        "with scoped as ("
        "    select distinct wq.worker_id from fl.worker_queues wq"
        "      join fl.queues q on q.id = wq.queue_id"
        "     where q.project_id = %(project)s and (%(queue)s::uuid is null or q.id = %(queue)s)"
        "       and wq.worker_id < %(after)s"
        "     order by wq.worker_id desc limit %(n)s)"
        " select w.id, w.hostname, w.pid, w.state, w.concurrency,"
        "        array(select wq.queue_id from fl.worker_queues wq"
        "                join fl.queues q on q.id = wq.queue_id"
        "               where wq.worker_id = w.id and q.project_id = %(project)s"
        "               order by wq.queue_id),"
        "        (select count(*)::int from fl.leases l join fl.queues q on q.id = l.queue_id"
        "          where l.worker_id = w.id and q.project_id = %(project)s),"
        "        w.started_at, w.last_seen_at"
        "   from scoped s join fl.workers w on w.id = s.worker_id"
        "  order by w.id desc",
        {"project": project, "queue": queue, "after": after[0] if after else LAST_UUID,
         "n": limit + 1})
    rows = await cur.fetchall()
    items, next_cursor = make_page(rows, limit, lambda r: [r[0]])
    return Reply(200, {"items": [dict(zip(FIELDS, r, strict=True)) for r in items],
                       "next_cursor": next_cursor})
