"""The one-statement single submission against the path it replaces.

- POST /queues/{id}/jobs answered by its direct handler (one prepared statement) against the
  endpoint's ordinary path (BEGIN + authorisation, handler, audit + COMMIT): the same answers
  in the same order, the same audit rows;
- the prepared statements: prepared once per connection, prepared again on a new one,
  recovered when the server forgot them, and the same answers with preparing off.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from fenceline.api import authz, statements, submission
from fenceline.api.app import create_app
from fenceline.api.endpoint import Endpoint
from fenceline.config import Settings
from fenceline.db.connection import TrioConnection
from fenceline.db.pool import Pool
from fenceline.readiness import Readiness
from tests.api.conftest import Api, Tenant

# -- the direct handler against the ordinary path -------------------------------------------


def _endpoint() -> Endpoint:
    [ep] = [e for e in submission.resource.endpoints
            if e.method == "POST" and e.path == "/queues/{queue_id}/jobs"]
    return ep


async def _sequence(api: Api, tenant: Tenant, queue: uuid.UUID, key_token: str,
                    foreign_key_token: str) -> list[Any]:
    """A run of requests through every kind of answer; normalised answers and audit rows."""
    tokens = tenant.tokens
    url = f"queues/{queue}/jobs"
    sent: list[tuple[str | None, Any, dict[str, str]]] = [
        (tokens["member"], {"type": "a"}, {}),
        (tokens["owner"], {"type": " b ", "payload": [1, None], "priority": 3,
                           "timeout_ms": 9, "delay_ms": 60_000}, {}),
        (tokens["admin"], {"type": "c", "run_at": "2001-01-01T00:00:00Z"}, {}),
        (key_token, {"type": "d", "payload": {"k": "v"}}, {}),
        (tokens["member"], {"type": "e"}, {"Idempotency-Key": "k1"}),
        (tokens["member"], {"type": "e"}, {"Idempotency-Key": "k1"}),
        (tokens["member"], {"type": "f"}, {"Idempotency-Key": "k1"}),
        (tokens["member"], {"type": "g", "depends_on": [2**62]}, {}),
        (tokens["member"], {"type": "h", "timeout_ms": 0}, {}),
        (tokens["member"], {"type": "i", "retry_policy_id": str(uuid.UUID(int=5))}, {}),
        (tokens["member"], {"type": "   "}, {}),
        (tokens["viewer"], {"type": "   "}, {}),
        (tokens["outsider"], {"type": "   "}, {}),
        (tokens["member"], {"type": "x", "run_at": "2001-01-01T00:00:00Z", "delay_ms": 1}, {}),
        (tokens["member"], {"type": "x"}, {"Idempotency-Key": " "}),
        (tokens["viewer"], {"type": "x"}, {"Idempotency-Key": " "}),
        (tokens["viewer"], {"type": "x"}, {}),
        (tokens["outsider"], {"type": "x"}, {}),
        (foreign_key_token, {"type": "x"}, {}),
        ("fls_unknown", {"type": "x"}, {}),
        ("flk_unknown", {"type": "x"}, {}),
        ("nonsense", {"type": "x"}, {}),
        (None, {"type": "x"}, {}),
    ]
    answers: list[Any] = []
    for token, body, headers in sent:
        answer = await api.post(url, body, token=token, headers=headers)
        if answer.status < 300:
            got = {k: v for k, v in answer.body.items()
                   if k not in ("id", "queue_id", "run_at", "created_at")}
        else:
            got = {k: v for k, v in answer.body.items() if k != "request_id"}
        answers.append((answer.status, got, answer.headers.get("Retry-After")))
    await api.sql("update fl.queues set max_depth = 1 where id = %s", queue)
    answer = await api.post(url, {"type": "full"}, token=tokens["member"])
    answers.append((answer.status, answer.code, answer.body["detail"]))
    audit = await api.sql(
        "select a.org_id, a.project_id, a.actor_user, a.actor_key is not null, a.action,"
        "       a.entity, j.type, a.detail - 'queue_id', a.detail ->> 'queue_id' = %s"
        "  from fl.audit_log a left join fl.jobs j on j.id::text = a.entity_id"
        " where a.action like 'job.%%' and a.detail ->> 'queue_id' = %s order by a.id",
        str(queue), str(queue))
    return [answers, audit]


async def _key(api: Api, project: uuid.UUID, token: str) -> str:
    answer = await api.post(f"projects/{project}/api-keys", {"name": "k", "role": "member"},
                            token=token)
    assert answer.status == 201, answer
    return str(answer.body["token"])


async def test_the_direct_handler_answers_as_the_ordinary_path(
        api: Api, tenant: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    key = await _key(api, tenant.project_id, tenant.tokens["owner"])
    foreign = await _key(api, tenant.other_project_id, tenant.tokens["outsider"])
    [(queue2,)] = await api.sql(
        "insert into fl.queues (project_id, name, retry_policy_id) values (%s, 'two', %s)"
        " returning id", tenant.project_id, tenant.policy_id)
    direct = await _sequence(api, tenant, tenant.queue_id, key, foreign)
    monkeypatch.setattr(_endpoint(), "direct", None)
    plain = await _sequence(api, tenant, queue2, key, foreign)
    assert direct == plain
    statuses = [a[0] for a in direct[0]]
    assert statuses == [201, 201, 201, 201, 201, 200, 409, 400, 400, 400, 400, 403, 404, 400,
                        400, 403, 403, 404, 404, 401, 401, 401, 401, 429]
    assert len(direct[1]) == 6   # a, b, c, d, e and e's replay


async def test_direct_statement_writes_nothing_when_refused(api: Api, tenant: Tenant) -> None:
    before = await api.sql("select (select count(*) from fl.jobs), (select count(*) from"
                           " fl.audit_log), (select count(*) from fl.events)")
    for who in ("viewer", "outsider"):
        answer = await api.post(f"queues/{tenant.queue_id}/jobs", {"type": "x"},
                                token=tenant.tokens[who])
        assert answer.status in (403, 404)
    answer = await api.post(f"queues/{tenant.queue_id}/jobs", {"type": "x", "timeout_ms": 0},
                            token=tenant.tokens["member"])
    assert answer.status == 400
    after = await api.sql("select (select count(*) from fl.jobs), (select count(*) from"
                          " fl.audit_log), (select count(*) from fl.events)")
    assert before == after


# -- prepared statements ---------------------------------------------------------------------


async def _prepared_names(conn: TrioConnection[Any]) -> set[str]:
    cur = await conn.execute("select name from pg_prepared_statements")
    return {r[0] for r in await cur.fetchall()}


async def test_prepared_once_per_connection_and_again_on_a_new_one(
        pool: Pool, api: Api, tenant: Tenant) -> None:
    url = f"queues/{tenant.queue_id}/jobs"
    statement = submission.SUBMIT_STATEMENTS[submission.auth.SESSION_CALLER]
    try:
        for _ in range(3):
            answer = await api.post(url, {"type": "x"}, token=tenant.tokens["member"])
            assert answer.status == 201
        async with pool.connection() as conn:
            assert statement.name in await _prepared_names(conn)
            # The server forgets (a pooler's other session, DEALLOCATE): recovered, no error.
            await conn.execute("deallocate all")
        for _ in range(3):
            answer = await api.post(url, {"type": "y"}, token=tenant.tokens["member"])
            assert answer.status == 201
        async with pool.connection() as conn:
            assert statement.name in await _prepared_names(conn)
            await conn.close()   # the pool replaces it: the new connection prepares again
        for _ in range(3):
            answer = await api.post(url, {"type": "z"}, token=tenant.tokens["member"])
            assert answer.status == 201
        async with pool.connection() as conn:
            assert statement.name in await _prepared_names(conn)
        [(n,)] = await api.sql("select count(*) from fl.audit_log where action = 'job.submit'")
        assert n == 9
        assert statements.enabled()
    finally:
        statements.set_enabled(True)   # resets the process-wide count of losses


async def test_vanishing_statements_switch_preparing_off(pool: Pool, api: Api,
                                                         tenant: Tenant) -> None:
    url = f"queues/{tenant.queue_id}/jobs"
    try:
        for _ in range(4 * statements.MAX_LOST):
            answer = await api.post(url, {"type": "x"}, token=tenant.tokens["member"])
            assert answer.status == 201
            if not statements.enabled():
                break
            async with pool.connection() as conn:
                await conn.execute("deallocate all")
        assert not statements.enabled()
        async with pool.connection() as conn:
            await conn.execute("deallocate all")
        answer = await api.post(url, {"type": "x"}, token=tenant.tokens["member"])
        assert answer.status == 201
        async with pool.connection() as conn:
            assert await _prepared_names(conn) == set()
    finally:
        statements.set_enabled(True)


async def test_unprepared_answers_alike(api: Api, tenant: Tenant) -> None:
    key = await _key(api, tenant.project_id, tenant.tokens["owner"])
    foreign = await _key(api, tenant.other_project_id, tenant.tokens["outsider"])
    [(queue2,)] = await api.sql(
        "insert into fl.queues (project_id, name, retry_policy_id) values (%s, 'two', %s)"
        " returning id", tenant.project_id, tenant.policy_id)
    prepared = await _sequence(api, tenant, tenant.queue_id, key, foreign)
    statements.set_enabled(False)
    try:
        plain = await _sequence(api, tenant, queue2, key, foreign)
    finally:
        statements.set_enabled(True)
    assert prepared == plain


async def test_inside_an_open_transaction_statements_go_as_text(pool: Pool, api: Api,
                                                                tenant: Tenant) -> None:
    token = tenant.tokens["member"]
    async with pool.connection() as conn:
        await conn.execute("deallocate all")
        async with conn.transaction():
            _, scope = await authz.authorise(conn, token, ("queue", tenant.queue_id),
                                             "viewer")
            assert scope is not None and scope.role == "member"
            assert await _prepared_names(conn) == set()
        # Between transactions it is prepared (and, after begin, run from the statement).
        await authz.authorise(conn, token, ("queue", tenant.queue_id), "viewer",
                              prefix="begin; ")
        assert len(await _prepared_names(conn)) == 1
        await conn.execute("rollback")
        await conn.execute("deallocate all")
        async with conn.transaction():
            # The server forgot it, and a transaction is open: still answered, as text.
            await authz.authorise(conn, token, ("queue", tenant.queue_id), "viewer")
    statements.set_enabled(True)


async def test_the_api_prepare_setting_switches_preparing(pool: Pool) -> None:
    try:
        create_app(Readiness(pool=pool, reason=None),
                   Settings(password_profile="minimal", api_prepare="off"))
        assert not statements.enabled()
        create_app(Readiness(pool=pool, reason=None),
                   Settings(password_profile="minimal", api_prepare="on"))
        assert statements.enabled()
    finally:
        statements.set_enabled(True)
