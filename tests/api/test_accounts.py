"""Accounts: register, login, logout, sessions as hashed rows."""

from __future__ import annotations

import hashlib

import pytest

from tests.api.conftest import PASSWORD, Api


async def test_register_then_login_then_me(api: Api) -> None:
    reg = await api.post("auth/register", {"email": " Ada@Example.com ", "password": PASSWORD,
                                           "name": "Ada"})
    assert reg.status == 202
    assert reg.body == {"status": "accepted", "email": "ada@example.com"}
    login = await api.post("auth/login", {"email": "ADA@example.com", "password": PASSWORD})
    assert login.status == 200, login
    me = await api.get("me", token=login.body["token"])
    assert me.status == 200
    assert me.body["email"] == "ada@example.com" and me.body["name"] == "Ada"
    assert me.body["id"] == login.body["user_id"]


async def test_register_answers_alike_for_a_known_email(api: Api) -> None:
    first = await api.post("auth/register", {"email": "bo@example.com", "password": PASSWORD})
    again = await api.post("auth/register", {"email": "bo@example.com",
                                             "password": "another password"})
    assert (first.status, first.body) == (again.status, again.body)
    # The first password still stands; the second registration changed nothing.
    assert (await api.post("auth/login", {"email": "bo@example.com",
                                          "password": PASSWORD})).status == 200
    assert (await api.post("auth/login", {"email": "bo@example.com",
                                          "password": "another password"})).status == 401


async def test_wrong_password_and_unknown_email_answer_alike(api: Api) -> None:
    await api.user("cy")
    wrong = await api.post("auth/login", {"email": "cy@example.com", "password": "nope nope"})
    unknown = await api.post("auth/login", {"email": "zz@example.com", "password": "nope nope"})
    assert wrong.status == unknown.status == 401
    assert wrong.body["detail"] == unknown.body["detail"]
    assert wrong.headers["WWW-Authenticate"].startswith("Bearer")


async def test_only_the_token_hash_is_stored(api: Api) -> None:
    _, token = await api.user("dee")
    rows = await api.sql("select token_hash from fl.sessions")
    assert rows == [(hashlib.sha256(token.encode()).digest(),)]
    assert token.encode() not in rows[0][0]


async def test_logout_revokes_the_session(api: Api) -> None:
    _, token = await api.user("eve")
    assert (await api.get("me", token=token)).status == 200
    assert (await api.post("auth/logout", token=token)).status == 204
    after = await api.get("me", token=token)
    assert after.status == 401 and after.code == "unauthenticated"


async def test_expired_session_is_refused(api: Api) -> None:
    _, token = await api.user("fay")
    await api.sql("update fl.sessions set expires_at = fl.now() - interval '1 second'")
    assert (await api.get("me", token=token)).status == 401


async def test_missing_malformed_and_unknown_tokens(api: Api) -> None:
    for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer "},
                    {"Authorization": "Bearer fls_nonsense"},
                    {"Authorization": "Bearer flk_nonsense"}):
        answer = await api.get("me", headers=headers)
        assert answer.status == 401, headers
        assert answer.headers["Content-Type"] == "application/problem+json"


async def test_bad_register_bodies_change_nothing(api: Api) -> None:
    cases = [
        ({"email": "x@example.com"}, "password"),
        ({"email": "x@example.com", "password": "short"}, "password"),
        ({"email": "not-an-email", "password": PASSWORD}, "email"),
        ({"email": 7, "password": PASSWORD}, "email"),
        ({"email": "x@example.com", "password": PASSWORD, "admin": True}, "admin"),
        ([], "body"),
    ]
    for body, field in cases:
        answer = await api.post("auth/register", body)
        assert answer.status == 400, body
        assert answer.body["field"] == field, answer
    bad_json = await api.post("auth/register", raw=b"{nope",
                              headers={"Content-Type": "application/json"})
    assert bad_json.status == 400 and bad_json.code == "invalid_json"
    assert await api.sql("select count(*) from fl.users") == [(0,)]


async def test_request_id_is_echoed(api: Api) -> None:
    answer = await api.get("me", headers={"X-Request-Id": "abc-123"})
    assert answer.headers["X-Request-Id"] == "abc-123"
    assert answer.body["request_id"] == "abc-123"


async def test_unknown_path_and_wrong_method_are_problems(api: Api) -> None:
    missing = await api.get("nowhere")
    assert missing.status == 404 and missing.code == "not_found"
    wrong = await api.call("DELETE", "auth/login")
    assert wrong.status == 405 and wrong.code == "method_not_allowed"



async def test_engine_input_errors_are_400_not_503(api: Api) -> None:
    """psycopg raises SQLSTATE class FL as an OperationalError; it must not read as an outage."""
    import psycopg

    from fenceline.api.endpoint import database_problem

    with pytest.raises(psycopg.OperationalError) as caught:
        await api.sql("select fl._bad_input('FL005', 'n must be between 1 and 1000')")
    problem = database_problem(caught.value)
    assert (problem.status, problem.code) == (400, "invalid_input")
    assert problem.detail == "n must be between 1 and 1000"


async def test_login_upgrades_a_hash_made_with_other_parameters(api: Api) -> None:
    from argon2 import PasswordHasher

    old = PasswordHasher(time_cost=2, memory_cost=16, parallelism=1, hash_len=16,
                         salt_len=8).hash(PASSWORD)
    await api.sql("insert into fl.users (email, password_hash) values ('old@example.com', %s)",
                  old)
    login = await api.post("auth/login", {"email": "old@example.com", "password": PASSWORD})
    assert login.status == 200
    [(stored,)] = await api.sql("select password_hash from fl.users")
    assert stored != old and stored.startswith("$argon2id$v=19$m=8,t=1,p=1$")
    again = await api.post("auth/login", {"email": "old@example.com", "password": PASSWORD})
    assert again.status == 200
