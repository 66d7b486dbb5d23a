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
from psycopg import AsyncClientCursor

from fenceline.api import auth
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


def _role_in(scope_sql: str, user: str, kproject: str, krole: str) -> str:
    """The scope query of one kind joined to the caller's role: (org, project, eid, role)."""
    return (
        "select s.org_id, s.project_id, s.eid,"
        f"       coalesce(m.role::text, case when s.project_id = {kproject} then {krole} end)"
        f"  from ({scope_sql}) as s(org_id, project_id, eid)"
        f"  left join fl.org_members m on m.org_id = s.org_id and m.user_id = {user}"
    )


def _check(kind: str, row: Any, needed: str) -> Scope:
    if row is None or row[3] is None:
        raise not_found(kind)
    org_id, project_id, eid, role = row
    if not at_least(role, needed):
        raise Problem(403, "forbidden", "Forbidden",
                      f"this needs the {needed} role; you are {role}")
    return Scope(kind, eid, org_id, project_id, role)


async def authorise(conn: psycopg.AsyncConnection[Any], token: str | None,
                    scope: tuple[str, Any] | None, needed: str, *, users_only: bool = False,
                    prefix: str = "") -> tuple[Caller, Scope | None]:
    """Authenticate ``token`` and resolve ``scope`` (kind, entity id) in ONE statement.

    Answers, in this order: 401 (no such token, expired or revoked), 403 (an API key where
    only people may call), 404 (no such entity, or not the caller's), 403 (role below
    ``needed``).
    ``prefix`` is SQL sent ahead of the statement in the same round trip (the request path's
    ``begin``); the statement is then sent with its values as literals (psycopg's client-side
    binding, the server's own quoting rules), as one simple-protocol query.
    """
    caller_sql = auth.caller_query(token)
    if caller_sql is None or token is None:
        raise auth.unauthenticated() if token is None else auth.unauthenticated(
            "the token is unknown, expired or revoked")
    if scope is None:
        query = caller_sql
    else:
        kind = scope[0]
        query = (
            "select c.user_id, c.session_id, c.key_id, c.key_project, c.key_role,"
            "       s.org_id, s.project_id, s.eid, s.role"
            f"  from ({caller_sql}) as c(user_id, session_id, key_id, key_project, key_role)"
            "  left join lateral ("
            + _role_in(SCOPES[kind], "c.user_id", "c.key_project", "c.key_role")
            + ") as s(org_id, project_id, eid, role) on true")
    text = AsyncClientCursor(conn).mogrify(
        query, {"token": auth.token_hash(token), "id": None if scope is None else scope[1]})
    cur = await conn.execute(prefix + text)
    if prefix:
        cur.nextset()
    row = await cur.fetchone()
    if row is None:
        raise auth.unauthenticated("the token is unknown, expired or revoked")
    caller = (Caller(user_id=row[0], session_id=row[1]) if row[0] is not None
              else Caller(key_id=row[2], key_project=row[3], key_role=row[4]))
    if users_only and not caller.is_user:
        raise Problem(403, "forbidden", "Forbidden", "API keys cannot do this; log in")
    if scope is None:
        return caller, None
    return caller, _check(scope[0], row[5:], needed)


async def resolve(conn: psycopg.AsyncConnection[Any], caller: Caller, kind: str,
                  entity_id: Any, needed: str) -> Scope:
    """The scope of ``entity_id``; 404 when missing or not the caller's, 403 below ``needed``."""
    query = _role_in(SCOPES[kind], "%(user)s", "%(kproject)s", "%(krole)s")
    cur = await conn.execute(query, {"id": entity_id, "user": caller.user_id,
                                     "kproject": caller.key_project, "krole": caller.key_role})
    return _check(kind, await cur.fetchone(), needed)
