"""What the caller may do to an entity: one join from the entity to the caller's role.

Every entity the API names belongs to exactly one organization (and, below the organization,
to one project). ``resolve`` looks the entity up and, in the same statement, the caller's role
in its organization: a user's membership row, or an API key's role when the entity is in the
key's project. Nothing is cached, so a removed member or a revoked key loses access on the
next request.

Non-members get 404 (existence does not leak across organizations); members below the role
an endpoint needs get 403.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from fenceline.api.auth import Caller
from fenceline.api.problems import Problem

ROLES = ("viewer", "member", "admin", "owner")

# For each kind of entity: a query over %(id)s giving (org_id, project_id, entity id).
# project_id is NULL for the organization itself.
SCOPES: dict[str, str] = {
    "org": "select o.id, null::uuid, o.id::text from fl.organizations o where o.id = %(id)s",
    "project": "select p.org_id, p.id, p.id::text from fl.projects p where p.id = %(id)s",
    "policy": "select p.org_id, p.id, r.id::text from fl.retry_policies r"
              " join fl.projects p on p.id = r.project_id where r.id = %(id)s",
    "queue": "select p.org_id, p.id, q.id::text from fl.queues q"
             " join fl.projects p on p.id = q.project_id where q.id = %(id)s",
    "job": "select p.org_id, p.id, j.id::text from fl.jobs j"
           " join fl.projects p on p.id = j.project_id where j.id = %(id)s",
    "api_key": "select p.org_id, p.id, k.id::text from fl.api_keys k"
               " join fl.projects p on p.id = k.project_id where k.id = %(id)s",
    "batch": "select p.org_id, p.id, j.batch_id::text from fl.jobs j"
             " join fl.projects p on p.id = j.project_id where j.batch_id = %(id)s limit 1",
}

# The word used in a 404, per kind.
LABELS = {"org": "organization", "project": "project", "policy": "retry policy",
          "queue": "queue", "job": "job", "api_key": "API key", "batch": "batch"}


@dataclass(frozen=True)
class Scope:
    """The entity a request addresses, where it lives, and the caller's role there."""

    kind: str
    entity_id: str
    org_id: uuid.UUID
    project_id: uuid.UUID | None
    role: str


def not_found(kind: str) -> Problem:
    label = LABELS.get(kind, kind)
    return Problem(404, "not_found", "Not found", f"{label} not found")


def at_least(role: str, needed: str) -> bool:
    return ROLES.index(role) >= ROLES.index(needed)


async def resolve(conn: psycopg.AsyncConnection[Any], caller: Caller, kind: str,
                  entity_id: Any, needed: str) -> Scope:
    """The scope of ``entity_id``; 404 when missing or not the caller's, 403 below ``needed``."""
    query = (
        "select s.org_id, s.project_id, s.eid,"
        "       coalesce(m.role::text,"
        "                case when s.project_id = %(kproject)s then %(krole)s end)"
        f"  from ({SCOPES[kind]}) as s(org_id, project_id, eid)"
        "  left join fl.org_members m on m.org_id = s.org_id and m.user_id = %(user)s"
    )
    cur = await conn.execute(query, {"id": entity_id, "user": caller.user_id,
                                     "kproject": caller.key_project, "krole": caller.key_role})
    row = await cur.fetchone()
    if row is None or row[3] is None:
        raise not_found(kind)
    org_id, project_id, eid, role = row
    if not at_least(role, needed):
        raise Problem(403, "forbidden", "Forbidden",
                      f"this needs the {needed} role; you are {role}")
    return Scope(kind, eid, org_id, project_id, role)
