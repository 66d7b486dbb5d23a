"""API keys: bearer tokens for programs, acting inside one project with a role below owner.

The token is shown once, in the answer that creates it; only its SHA-256 and its first
characters (``prefix``, to tell keys apart in a list) are stored. Keys are managed by people
only: a key cannot mint, list or revoke keys, so a leaked key cannot make itself permanent.
Revoking sets ``revoked_at``; the key is refused from the next request on (it is read on
every request). Revoking a revoked key changes nothing and answers 204 again.
"""

from __future__ import annotations

import uuid

from fenceline.api import auth
from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.pagination import decode_cursor, make_page, page_limit, page_query, page_schema
from fenceline.api.problems import Problem
from fenceline.api.records import NAME, clean_name, dict_row, dict_rows
from fenceline.api.validation import invalid, obj, string, timestamp, uuid_string

resource = Resource("api_keys", "API keys")

KEY_ROLES = ("viewer", "member", "admin")
PREFIX_LENGTH = 12   # "flk_" and 8 characters of the random part

KEY_FIELDS = {"id": uuid_string(), "project_id": uuid_string(), "name": string(),
              "role": string(enum=KEY_ROLES), "prefix": string(),
              "created_by": uuid_string(nullable=True), "created_at": timestamp(),
              "expires_at": timestamp(nullable=True), "revoked_at": timestamp(nullable=True)}
KEY = obj(KEY_FIELDS, list(KEY_FIELDS))
NEW_KEY = obj({**KEY_FIELDS, "token": string(description="The bearer token; shown only here.")},
              [*KEY_FIELDS, "token"])

COLUMNS = ("id, project_id, name, role::text as role, prefix, created_by, created_at,"
           " expires_at, revoked_at")


def _project_id(call: Call) -> uuid.UUID:
    assert call.scope is not None and call.scope.project_id is not None
    return call.scope.project_id


@resource.route("POST", "/projects/{project_id}/api-keys",
                summary="Create an API key for a project (the token is shown once)",
                role="admin", scope=("project", "project_id"), users_only=True,
                body=obj({"name": NAME, "role": string(enum=KEY_ROLES),
                          "expires_at": timestamp(nullable=True,
                                                  description="Null or absent = no expiry.")},
                         ["name", "role"]),
                responses={201: NEW_KEY}, audit="api_key.create")
async def create_key(call: Call) -> Reply:
    name = clean_name(call.body["name"])
    expires = call.body.get("expires_at")
    if expires is not None:
        cur = await call.conn.execute("select %s::timestamptz > fl.now()", (expires,))
        row = await cur.fetchone()
        if row is None or not row[0]:
            raise invalid("expires_at", "must be in the future")
    token, digest = auth.new_token(auth.KEY_PREFIX)
    cur = await call.conn.execute(
        "insert into fl.api_keys (project_id, name, role, token_hash, prefix, created_by,"
        "                         expires_at)"
        f" values (%s, %s, %s, %s, %s, %s, %s) returning {COLUMNS}",
        (_project_id(call), name, call.body["role"], digest, token[:PREFIX_LENGTH],
         call.user_id, expires))
    key = await dict_row(cur, Problem(500, "internal_error", "Internal Server Error"))
    call.audit_entity_id = str(key["id"])
    call.audit_detail = {"name": name, "role": call.body["role"], "prefix": key["prefix"],
                         "expires_at": expires}
    return Reply(201, {**key, "token": token})


@resource.route("GET", "/projects/{project_id}/api-keys",
                summary="API keys of a project, newest first (never the token)", role="admin",
                scope=("project", "project_id"), users_only=True, query=page_query(),
                responses={200: page_schema(KEY)})
async def list_keys(call: Call) -> Reply:
    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("timestamp", "uuid"))
    cur = await call.conn.execute(
        f"select {COLUMNS} from fl.api_keys"
        " where project_id = %(p)s"
        "   and (%(at)s::timestamptz is null or (created_at, id) < (%(at)s, %(id)s::uuid))"
        " order by created_at desc, id desc limit %(n)s",
        {"p": _project_id(call), "at": after[0] if after else None,
         "id": after[1] if after else None, "n": limit + 1})
    items, nxt = make_page(await dict_rows(cur), limit, lambda r: [r["created_at"], r["id"]])
    return Reply(200, {"items": items, "next_cursor": nxt})


@resource.route("DELETE", "/api-keys/{key_id}", summary="Revoke an API key", role="admin",
                scope=("api_key", "key_id"), users_only=True, responses={204: None},
                audit="api_key.revoke")
async def revoke_key(call: Call) -> Reply:
    cur = await call.conn.execute(
        "update fl.api_keys set revoked_at = fl.now()"
        " where id = %s and revoked_at is null returning prefix", (call.params["key_id"],))
    row = await cur.fetchone()
    call.audit_detail = {"changed": row is not None}
    return Reply(204)
