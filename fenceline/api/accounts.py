"""Accounts: register, log in, log out, and who am I.

Register answers 202 with the same body whether or not the email is already registered,
after the same work (a password hash), so it cannot be used to find out who has an account
(reference W24). The account exists once it answers; log in to get a token.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from quart import current_app

from fenceline.api import auth
from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.passwords import Passwords
from fenceline.api.problems import Problem
from fenceline.api.validation import email, obj, string, timestamp, uuid_string

resource = Resource("accounts", "Accounts")

PASSWORD = string(8, 1024, description="At least 8 characters.")

USER = obj({"id": uuid_string(), "email": email(), "name": string(nullable=True),
            "created_at": timestamp()}, ["id", "email", "name", "created_at"])


def passwords() -> Passwords:
    hasher: Passwords = current_app.config["FENCELINE_PASSWORDS"]
    return hasher


def normal_email(text: str) -> str:
    return text.strip().lower()


@resource.route(
    "POST", "/auth/register", summary="Create an account", role=None,
    body=obj({"email": email(), "password": PASSWORD, "name": string(1, 200, nullable=True)},
             ["email", "password"]),
    responses={202: obj({"status": string(enum=["accepted"]), "email": email()},
                        ["status", "email"])})
async def register(call: Call) -> Reply:
    address = normal_email(call.body["email"])
    name = (call.body.get("name") or "").strip() or None
    hashed = await passwords().hash(call.body["password"])
    await call.conn.execute(
        "insert into fl.users (email, name, password_hash) values (%s, %s, %s)"
        " on conflict (email) do nothing",
        (address, name, hashed))
    return Reply(202, {"status": "accepted", "email": address})


SESSION = obj({"token": string(description="Bearer token; shown once."),
               "user_id": uuid_string(), "issued_at": timestamp(),
               "expires_at": timestamp()}, ["token", "user_id", "issued_at", "expires_at"])


@resource.route(
    "POST", "/auth/login", summary="Log in and get a session token", role=None,
    body=obj({"email": email(), "password": string(1, 1024)}, ["email", "password"]),
    responses={200: SESSION}, problems=(401,))
async def login(call: Call) -> Reply:
    address = normal_email(call.body["email"])
    cur = await call.conn.execute(
        "select id, password_hash from fl.users where email = %s", (address,))
    row = await cur.fetchone()
    ok, rehashed = await passwords().verify(row[1] if row else None, call.body["password"])
    if row is None or not ok:
        raise auth.unauthenticated("wrong email or password")
    user_id = row[0]
    if rehashed is not None:
        await call.conn.execute("update fl.users set password_hash = %s where id = %s",
                                (rehashed, user_id))
    token, digest = auth.new_token(auth.SESSION_PREFIX)
    cur = await call.conn.execute(
        "insert into fl.sessions (user_id, token_hash, created_at, expires_at)"
        " values (%s, %s, fl.now(), fl.now() + %s) returning created_at, expires_at",
        (user_id, digest, dt.timedelta(days=auth.SESSION_DAYS)))
    issued, expires = await _one(cur)
    return Reply(200, {"token": token, "user_id": user_id, "issued_at": issued,
                       "expires_at": expires})


@resource.route("POST", "/auth/logout", summary="Revoke the session of this request",
                role="user", users_only=True, responses={204: None})
async def logout(call: Call) -> Reply:
    assert call.caller is not None
    await call.conn.execute("update fl.sessions set revoked_at = fl.now() where id = %s",
                            (call.caller.session_id,))
    return Reply(204)


@resource.route("GET", "/me", summary="The account behind the token", role="user",
                users_only=True, responses={200: USER})
async def me(call: Call) -> Reply:
    cur = await call.conn.execute(
        "select id, email, name, created_at from fl.users where id = %s", (call.user_id,))
    row = await _one(cur)
    return Reply(200, dict(zip(("id", "email", "name", "created_at"), row, strict=True)))


async def _one(cur: Any) -> Any:
    row = await cur.fetchone()
    if row is None:
        raise Problem(404, "not_found", "Not found", "gone")
    return row
