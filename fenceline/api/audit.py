"""Reading the audit trail: one row per privileged mutation, newest first.

A project's trail is what happened inside it (queues, policies, keys, the project itself); an
organization's is all of that for every project, deleted ones included, plus the
organization-level rows (renames, members, project creation and deletion). Both are for
admins; the organization's is for people only.
"""

from __future__ import annotations

from typing import Any

from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.pagination import decode_cursor, make_page, page_limit, page_query, page_schema
from fenceline.api.records import dict_rows
from fenceline.api.validation import INT64_MAX, integer, obj, string, timestamp, uuid_string

resource = Resource("audit", "Audit")

ENTRY = obj({"id": integer(1, INT64_MAX), "action": string(), "entity": string(),
             "entity_id": string(nullable=True),
             "actor_user": uuid_string(nullable=True, description="The user, if a person."),
             "actor_key": uuid_string(nullable=True, description="The API key, if a program."),
             "project_id": uuid_string(nullable=True,
                                       description="Null for organization-level rows."),
             "detail": {"type": "object", "description": "What changed."},
             "request_id": string(nullable=True), "created_at": timestamp()},
            ["id", "action", "entity", "entity_id", "actor_user", "actor_key", "project_id",
             "detail", "request_id", "created_at"])

COLUMNS = ("id, action, entity, entity_id, actor_user, actor_key, project_id, detail,"
           " request_id, created_at")


async def _page(call: Call, where: str, value: Any) -> Reply:
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("int",))
    cur = await call.conn.execute(
        f"select {COLUMNS} from fl.audit_log"
        f" where {where} = %(v)s and (%(after)s::bigint is null or id < %(after)s)"
        " order by id desc limit %(n)s",
        {"v": value, "after": after[0] if after else None, "n": limit + 1})
    items, nxt = make_page(await dict_rows(cur), limit, lambda r: [r["id"]])
    return Reply(200, {"items": items, "next_cursor": nxt})


@resource.route("GET", "/projects/{project_id}/audit", summary="A project's audit trail",
                role="admin", scope=("project", "project_id"), query=page_query(),
                responses={200: page_schema(ENTRY)})
async def project_audit(call: Call) -> Reply:
    assert call.scope is not None
    return await _page(call, "project_id", call.scope.project_id)


@resource.route("GET", "/orgs/{org_id}/audit",
                summary="An organization's audit trail, its projects' included",
                role="admin", scope=("org", "org_id"), users_only=True, query=page_query(),
                responses={200: page_schema(ENTRY)})
async def org_audit(call: Call) -> Reply:
    assert call.scope is not None
    return await _page(call, "org_id", call.scope.org_id)
