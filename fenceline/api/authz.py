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

from fenceline.api import auth
from fenceline.api.auth import Caller
from fenceline.api.problems import Problem
from fenceline.api.statements import Statement

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


def roles_from(needed: str) -> list[str]:
    """``needed`` and every role above it."""
    return list(ROLES[ROLES.index(needed):])


def statement_sql(caller_sql: str, kind: str | None) -> str:
    """The caller behind %(token)s and, for a ``kind``, the entity %(id)s and the caller's
    role there, as one row (user_id, session_id, key_id, key_project, key_role, org_id,
    project_id, eid, role); no row when the token is unknown, expired or revoked."""
    if kind is None:
        return caller_sql
    return (
        "select c.user_id, c.session_id, c.key_id, c.key_project, c.key_role,"
        "       s.org_id, s.project_id, s.eid, s.role"
        f"  from ({caller_sql}) as c(user_id, session_id, key_id, key_project, key_role)"
        "  left join lateral ("
        + _role_in(SCOPES[kind], "c.user_id", "c.key_project", "c.key_role")
        + ") as s(org_id, project_id, eid, role) on true")


# The SQL type of %(id)s per kind of entity.
ID_TYPES = {"job": "bigint"}

_STATEMENTS: dict[tuple[str, str | None], Statement] = {}


def _statement(caller_sql: str, kind: str | None) -> Statement:
    got = _STATEMENTS.get((caller_sql, kind))
    if got is None:
        types = {"token": "bytea"}
        if kind is not None:
            types["id"] = ID_TYPES.get(kind, "uuid")
        got = _STATEMENTS[(caller_sql, kind)] = Statement(statement_sql(caller_sql, kind), types)
    return got


def caller_sql_of(token: str | None) -> str:
    """The caller query for ``token``'s kind; 401 when no such token can exist."""
    caller_sql = auth.caller_query(token)
    if caller_sql is None:
        raise auth.unauthenticated() if token is None else auth.unauthenticated(
            "the token is unknown, expired or revoked")
    return caller_sql


def decide(row: Any, kind: str | None, needed: str, *,
           users_only: bool = False) -> tuple[Caller, Scope | None]:
    """The answer to the statement's row, in order: 401, 403 (people only), 404, 403."""
    if row is None:
        raise auth.unauthenticated("the token is unknown, expired or revoked")
    caller = (Caller(user_id=row[0], session_id=row[1]) if row[0] is not None
              else Caller(key_id=row[2], key_project=row[3], key_role=row[4]))
    if users_only and not caller.is_user:
        raise Problem(403, "forbidden", "Forbidden", "API keys cannot do this; log in")
    if kind is None:
        return caller, None
    return caller, _check(kind, row[5:9], needed)


async def authorise(conn: psycopg.AsyncConnection[Any], token: str | None,
                    scope: tuple[str, Any] | None, needed: str, *, users_only: bool = False,
                    prefix: str = "") -> tuple[Caller, Scope | None]:
    """Authenticate ``token`` and resolve ``scope`` (kind, entity id) in ONE statement.

    Answers, in this order: 401 (no such token, expired or revoked), 403 (an API key where
    only people may call), 404 (no such entity, or not the caller's), 403 (role below
    ``needed``).
    ``prefix`` is SQL sent ahead of the statement in the same round trip (the request path's
    ``begin``); the statement is a prepared one run with ``EXECUTE`` and its values as
    literals (psycopg's client-side binding, the server's own quoting rules), as one
    simple-protocol query (fenceline/api/statements.py).
    """
    caller_sql = caller_sql_of(token)
    assert token is not None
    kind = None if scope is None else scope[0]
    values: dict[str, Any] = {"token": auth.token_hash(token)}
    if scope is not None:
        values["id"] = scope[1]
    cur = await _statement(caller_sql, kind).execute(conn, values, prefix)
    return decide(await cur.fetchone(), kind, needed, users_only=users_only)


async def resolve(conn: psycopg.AsyncConnection[Any], caller: Caller, kind: str,
                  entity_id: Any, needed: str) -> Scope:
    """The scope of ``entity_id``; 404 when missing or not the caller's, 403 below ``needed``."""
    query = _role_in(SCOPES[kind], "%(user)s", "%(kproject)s", "%(krole)s")
    cur = await conn.execute(query, {"id": entity_id, "user": caller.user_id,
                                     "kproject": caller.key_project, "krole": caller.key_role})
    return _check(kind, await cur.fetchone(), needed)
