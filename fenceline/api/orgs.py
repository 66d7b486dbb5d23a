"""Organizations and their members.

Every endpoint here is for people only (API keys act inside one project and never see the
organization: 403). Membership changes take the organization's membership rows FOR UPDATE
first and re-read the caller's role from them, so two concurrent requests cannot both pass
the last-owner check (reference W6): an organization always keeps at least one owner.

Only an owner can make an owner, demote an owner or remove one; an admin manages the rest;
anyone may leave (remove themself), except the last owner.

Deleting an organization deletes everything in it (projects, queues, jobs and their history,
API keys, memberships) and its audit trail too: ``fl.audit_log.org_id`` cascades, so an
``org.delete`` row could not outlive the organization it names. The deletion is logged
instead (logger ``fenceline.api``, with the organization id, the user and the request id).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fenceline.api.authz import ROLES, Scope, at_least
from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.pagination import decode_cursor, make_page, page_limit, page_query, page_schema
from fenceline.api.problems import Problem
from fenceline.api.records import NAME, clean_name, dict_row, dict_rows
from fenceline.api.validation import email, obj, string, timestamp, uuid_string

log = logging.getLogger("fenceline.api")

resource = Resource("orgs", "Organizations")

ROLE = string(enum=ROLES)

ORG = obj({"id": uuid_string(), "name": string(),
           "role": string(enum=ROLES, description="Your role in it."),
           "created_at": timestamp()}, ["id", "name", "role", "created_at"])

MEMBER = obj({"user_id": uuid_string(), "email": email(), "name": string(nullable=True),
              "role": ROLE, "created_at": timestamp(description="When they joined.")},
             ["user_id", "email", "name", "role", "created_at"])


def forbidden(detail: str) -> Problem:
    return Problem(403, "forbidden", "Forbidden", detail)


# -- organizations -----------------------------------------------------------------------


@resource.route("POST", "/orgs", summary="Create an organization; you become its owner",
                role="user", users_only=True, body=obj({"name": NAME}, ["name"]),
                responses={201: ORG}, audit="org.create")
async def create_org(call: Call) -> Reply:
    name = clean_name(call.body["name"])
    cur = await call.conn.execute(
        "insert into fl.organizations (name) values (%s) returning id, name, created_at",
        (name,))
    org = await dict_row(cur, Problem(500, "internal_error", "Internal Server Error"))
    await call.conn.execute(
        "insert into fl.org_members (org_id, user_id, role) values (%s, %s, 'owner')",
        (org["id"], call.user_id))
    call.audit_scope = Scope("org", str(org["id"]), org["id"], None, "owner")
    call.audit_detail = {"name": name}
    return Reply(201, {**org, "role": "owner"})


@resource.route("GET", "/orgs", summary="The organizations you belong to, newest first",
                role="user", users_only=True, query=page_query(),
                responses={200: page_schema(ORG)})
async def list_orgs(call: Call) -> Reply:
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("uuid",))
    cur = await call.conn.execute(
        "select o.id, o.name, m.role::text as role, o.created_at"
        "  from fl.org_members m join fl.organizations o on o.id = m.org_id"
        " where m.user_id = %(user)s and (%(after)s::uuid is null or o.id < %(after)s)"
        " order by o.id desc limit %(n)s",
        {"user": call.user_id, "after": after[0] if after else None, "n": limit + 1})
    items, nxt = make_page(await dict_rows(cur), limit, lambda r: [r["id"]])
    return Reply(200, {"items": items, "next_cursor": nxt})


def _org_id(call: Call) -> uuid.UUID:
    assert call.scope is not None
    return call.scope.org_id


@resource.route("GET", "/orgs/{org_id}", summary="One organization", role="viewer",
                scope=("org", "org_id"), users_only=True, responses={200: ORG})
async def get_org(call: Call) -> Reply:
    assert call.scope is not None
    cur = await call.conn.execute(
        "select id, name, created_at from fl.organizations where id = %s", (_org_id(call),))
    org = await dict_row(cur, Problem(404, "not_found", "Not found", "organization not found"))
    return Reply(200, {**org, "role": call.scope.role})


@resource.route("PATCH", "/orgs/{org_id}", summary="Rename an organization", role="admin",
                scope=("org", "org_id"), users_only=True, body=obj({"name": NAME}, ["name"]),
                responses={200: ORG}, audit="org.update")
async def update_org(call: Call) -> Reply:
    assert call.scope is not None
    name = clean_name(call.body["name"])
    cur = await call.conn.execute(
        "update fl.organizations set name = %s where id = %s returning id, name, created_at",
        (name, _org_id(call)))
    org = await dict_row(cur, Problem(404, "not_found", "Not found", "organization not found"))
    call.audit_detail = {"name": name}
    return Reply(200, {**org, "role": call.scope.role})


@resource.route("DELETE", "/orgs/{org_id}",
                summary="Delete an organization with everything in it (its audit trail too)",
                role="owner", scope=("org", "org_id"), users_only=True, responses={204: None})
async def delete_org(call: Call) -> Reply:
    org_id = _org_id(call)
    await call.conn.execute("delete from fl.organizations where id = %s", (org_id,))
    log.info("organization deleted", extra={"org_id": str(org_id), "user_id": str(call.user_id),
                                            "request_id": call.request_id})
    return Reply(204)


# -- members -----------------------------------------------------------------------------


async def _lock_members(call: Call) -> dict[uuid.UUID, str]:
    """The org's memberships, locked until commit; re-checks the caller is still a member."""
    cur = await call.conn.execute(
        "select user_id, role::text from fl.org_members where org_id = %s"
        " order by user_id for update", (_org_id(call),))
    members = {row[0]: row[1] for row in await cur.fetchall()}
    if call.user_id not in members:   # removed while this request waited for the lock
        raise Problem(404, "not_found", "Not found", "organization not found")
    return members


def _last_owner() -> Problem:
    return Problem(409, "last_owner", "Last owner",
                   "an organization must keep at least one owner; make someone else owner first")


async def _member_view(call: Call, user_id: uuid.UUID) -> dict[str, Any]:
    cur = await call.conn.execute(
        "select m.user_id, u.email, u.name, m.role::text as role, m.created_at"
        "  from fl.org_members m join fl.users u on u.id = m.user_id"
        " where m.org_id = %s and m.user_id = %s", (_org_id(call), user_id))
    return await dict_row(cur, _no_member())


def _no_member() -> Problem:
    return Problem(404, "not_found", "Not found", "member not found")


@resource.route("GET", "/orgs/{org_id}/members", summary="Members, by email", role="viewer",
                scope=("org", "org_id"), users_only=True, query=page_query(),
                responses={200: page_schema(MEMBER)})
async def list_members(call: Call) -> Reply:
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("str",))
    cur = await call.conn.execute(
        "select m.user_id, u.email, u.name, m.role::text as role, m.created_at"
        "  from fl.org_members m join fl.users u on u.id = m.user_id"
        " where m.org_id = %(org)s and (%(after)s::text is null or u.email > %(after)s)"
        " order by u.email limit %(n)s",
        {"org": _org_id(call), "after": after[0] if after else None, "n": limit + 1})
    items, nxt = make_page(await dict_rows(cur), limit, lambda r: [r["email"]])
    return Reply(200, {"items": items, "next_cursor": nxt})


@resource.route("POST", "/orgs/{org_id}/members",
                summary="Add a registered user (only an owner may add an owner)",
                role="admin", scope=("org", "org_id"), users_only=True,
                body=obj({"email": email(), "role": ROLE}, ["email", "role"]),
                responses={201: MEMBER}, problems=(403, 409), audit="org.add_member")
async def add_member(call: Call) -> Reply:
    members = await _lock_members(call)
    mine = members[call.user_id]
    role = call.body["role"]
    if not at_least(mine, "admin"):
        raise forbidden(f"this needs the admin role; you are {mine}")
    if role == "owner" and mine != "owner":
        raise forbidden("only an owner can make an owner")
    address = call.body["email"].strip().lower()
    cur = await call.conn.execute("select id from fl.users where email = %s", (address,))
    row = await cur.fetchone()
    if row is None:
        # Tells an admin whether an address is registered (reference W24, accepted: admins
        # add people they know; invitations by email are not part of this API).
        raise Problem(404, "user_not_found", "User not found", "no account has that email")
    user_id = row[0]
    if user_id in members:
        raise Problem(409, "already_member", "Already a member",
                      f"that user is already a member ({members[user_id]}); "
                      "change their role instead")
    await call.conn.execute(
        "insert into fl.org_members (org_id, user_id, role) values (%s, %s, %s)",
        (_org_id(call), user_id, role))
    call.audit_detail = {"user_id": user_id, "role": role}
    return Reply(201, await _member_view(call, user_id))


@resource.route("PATCH", "/orgs/{org_id}/members/{user_id}",
                summary="Change a member's role (only an owner may grant or take owner)",
                role="admin", scope=("org", "org_id"), users_only=True,
                body=obj({"role": ROLE}, ["role"]), responses={200: MEMBER},
                problems=(403, 409), audit="org.change_role")
async def change_role(call: Call) -> Reply:
    members = await _lock_members(call)
    mine = members[call.user_id]
    target: uuid.UUID = call.params["user_id"]
    role = call.body["role"]
    if not at_least(mine, "admin"):
        raise forbidden(f"this needs the admin role; you are {mine}")
    if target not in members:
        raise _no_member()
    old = members[target]
    if "owner" in (old, role) and old != role and mine != "owner":
        raise forbidden("only an owner can grant or take the owner role")
    owners = sum(1 for r in members.values() if r == "owner")
    if old == "owner" and role != "owner" and owners <= 1:
        raise _last_owner()
    await call.conn.execute(
        "update fl.org_members set role = %s where org_id = %s and user_id = %s",
        (role, _org_id(call), target))
    call.audit_detail = {"user_id": target, "from": old, "to": role}
    return Reply(200, await _member_view(call, target))


@resource.route("DELETE", "/orgs/{org_id}/members/{user_id}",
                summary="Remove a member (admin), or leave (anyone, yourself)",
                role="viewer", scope=("org", "org_id"), users_only=True,
                responses={204: None}, problems=(403, 409), audit="org.remove_member")
async def remove_member(call: Call) -> Reply:
    members = await _lock_members(call)
    mine = members[call.user_id]
    target: uuid.UUID = call.params["user_id"]
    if target != call.user_id and not at_least(mine, "admin"):
        raise forbidden(f"removing someone else needs the admin role; you are {mine}")
    if target not in members:
        raise _no_member()
    old = members[target]
    if old == "owner" and target != call.user_id and mine != "owner":
        raise forbidden("only an owner can remove an owner")
    if old == "owner" and sum(1 for r in members.values() if r == "owner") <= 1:
        raise _last_owner()
    await call.conn.execute("delete from fl.org_members where org_id = %s and user_id = %s",
                            (_org_id(call), target))
    call.audit_detail = {"user_id": target, "role": old}
    return Reply(204)
