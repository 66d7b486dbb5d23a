"""Projects: the unit that owns queues, policies, jobs and API keys.

Deleting a project deletes everything in it, including jobs that have run (their attempts,
leases, log lines and dead letters): the policy foreign keys are checked at commit, after the
whole cascade (reference W5). Its audit rows stay: ``fl.audit_log.project_id`` has no foreign
key, so the organization's audit keeps who deleted it.

Renaming and deleting a project are for people; an API key, even an admin one, may rename its
project but not delete it.
"""

from __future__ import annotations

import uuid

from fenceline.api.authz import Scope
from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.pagination import decode_cursor, make_page, page_limit, page_query, page_schema
from fenceline.api.problems import Problem
from fenceline.api.records import NAME, clean_name, dict_row, dict_rows, name_taken, write_unique
from fenceline.api.validation import obj, string, timestamp, uuid_string

resource = Resource("projects", "Projects")

PROJECT = obj({"id": uuid_string(), "org_id": uuid_string(), "name": string(),
               "created_at": timestamp()}, ["id", "org_id", "name", "created_at"])

COLUMNS = "id, org_id, name, created_at"


def _missing() -> Problem:
    return Problem(404, "not_found", "Not found", "project not found")


def _project_id(call: Call) -> uuid.UUID:
    assert call.scope is not None and call.scope.project_id is not None
    return call.scope.project_id


@resource.route("POST", "/orgs/{org_id}/projects", summary="Create a project", role="admin",
                scope=("org", "org_id"), users_only=True, body=obj({"name": NAME}, ["name"]),
                responses={201: PROJECT}, problems=(409,), audit="project.create")
async def create_project(call: Call) -> Reply:
    assert call.scope is not None
    name = clean_name(call.body["name"])
    cur = await write_unique(
        call, f"insert into fl.projects (org_id, name) values (%s, %s) returning {COLUMNS}",
        (call.scope.org_id, name), name_taken("project"))
    project = await dict_row(cur, _missing())
    # The row belongs to the new project, so the project's own audit shows its creation.
    call.audit_scope = Scope("project", str(project["id"]), call.scope.org_id, project["id"],
                             call.scope.role)
    call.audit_detail = {"name": name}
    return Reply(201, project)


@resource.route("GET", "/orgs/{org_id}/projects", summary="Projects of an organization, by name",
                role="viewer", scope=("org", "org_id"), users_only=True, query=page_query(),
                responses={200: page_schema(PROJECT)})
async def list_projects(call: Call) -> Reply:
    assert call.scope is not None
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("str",))
    cur = await call.conn.execute(
        f"select {COLUMNS} from fl.projects"
        " where org_id = %(org)s and (%(after)s::text is null or name > %(after)s)"
        " order by name limit %(n)s",
        {"org": call.scope.org_id, "after": after[0] if after else None, "n": limit + 1})
    items, nxt = make_page(await dict_rows(cur), limit, lambda r: [r["name"]])
    return Reply(200, {"items": items, "next_cursor": nxt})


@resource.route("GET", "/projects/{project_id}", summary="One project", role="viewer",
                scope=("project", "project_id"), responses={200: PROJECT})
async def get_project(call: Call) -> Reply:
    cur = await call.conn.execute(f"select {COLUMNS} from fl.projects where id = %s",
                                  (_project_id(call),))
    return Reply(200, await dict_row(cur, _missing()))


@resource.route("PATCH", "/projects/{project_id}", summary="Rename a project", role="admin",
                scope=("project", "project_id"), body=obj({"name": NAME}, ["name"]),
                responses={200: PROJECT}, problems=(409,), audit="project.update")
async def update_project(call: Call) -> Reply:
    name = clean_name(call.body["name"])
    cur = await write_unique(
        call, f"update fl.projects set name = %s where id = %s returning {COLUMNS}",
        (name, _project_id(call)), name_taken("project"))
    call.audit_detail = {"name": name}
    return Reply(200, await dict_row(cur, _missing()))


@resource.route("DELETE", "/projects/{project_id}",
                summary="Delete a project with its queues, policies, jobs and API keys",
                role="admin", scope=("project", "project_id"), users_only=True,
                responses={204: None}, audit="project.delete")
async def delete_project(call: Call) -> Reply:
    cur = await call.conn.execute("delete from fl.projects where id = %s returning name",
                                  (_project_id(call),))
    row = await cur.fetchone()
    call.audit_detail = {"name": row[0] if row else None}
    return Reply(204)
