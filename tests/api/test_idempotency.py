"""Idempotency-Key on both submissions."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
import trio

from fenceline.config import Settings
from fenceline.db.pool import open_pool
from fenceline.readiness import Readiness
from fenceline.scheduler.sweeps import SWEEPS, run_once
from fenceline.service import ServiceContext
from tests.api.conftest import Api, Tenant


def url(queue: Any) -> str:
    return f"queues/{queue}/jobs"


async def count(api: Api, table: str = "fl.jobs") -> int:
    [(n,)] = await api.sql(f"select count(*) from {table}")
    return int(n)


async def post(api: Api, tenant: Tenant, body: Any, key: str | None, path: str = "",
               queue: Any = None) -> Any:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return await api.post(url(queue or tenant.queue_id) + path, body, headers=headers,
                          token=tenant.tokens["member"])


async def test_same_key_same_request_is_the_same_job(api: Api, tenant: Tenant) -> None:
    body = {"type": "t", "payload": {"b": 1, "a": [1, 2]}, "depends_on": []}
    first = await post(api, tenant, body, "order-1")
    assert first.status == 201
    # Keys in another order, null for absent fields: the same request.
    again = await post(api, tenant, {"payload": {"a": [1, 2], "b": 1}, "type": "t",
                                     "priority": None}, "order-1")
    assert again.status == 200 and again.body == first.body
    assert await count(api) == 1
    audits = await api.sql("select detail->>'replayed' from fl.audit_log order by id")
    assert audits == [("false",), ("true",)]


async def test_same_key_different_request_is_409(api: Api, tenant: Tenant) -> None:
    assert (await post(api, tenant, {"type": "t", "payload": {"n": 1}}, "k")).status == 201
    for body in ({"type": "t", "payload": {"n": 2}}, {"type": "u", "payload": {"n": 1}},
                 {"type": "t", "payload": {"n": 1}, "priority": 0}):
        answer = await post(api, tenant, body, "k")
        assert (answer.status, answer.code) == (409, "idempotency_conflict"), body
    assert await count(api) == 1


async def test_a_changed_queue_default_is_not_a_conflict(api: Api, tenant: Tenant) -> None:
    first = await post(api, tenant, {"type": "t"}, "k")
    await api.sql("update fl.queues set default_priority = 9, default_timeout_ms = 7")
    again = await post(api, tenant, {"type": "t"}, "k")
    assert again.status == 200 and again.body["id"] == first.body["id"]


async def test_a_retry_after_the_queue_filled_gets_its_job(api: Api, tenant: Tenant) -> None:
    """Reference W14: the key is looked up before the depth cap."""
    await api.sql("update fl.queues set max_depth = 1")
    first = await post(api, tenant, {"type": "t"}, "k")
    assert first.status == 201
    assert (await post(api, tenant, {"type": "t"}, None)).status == 429
    again = await post(api, tenant, {"type": "t"}, "k")
    assert again.status == 200 and again.body["id"] == first.body["id"]


async def test_keys_are_per_queue_and_expire(api: Api, tenant: Tenant) -> None:
    [(second_queue,)] = await api.sql(
        "insert into fl.queues (project_id, name, retry_policy_id) values (%s, 'two', %s)"
        " returning id", tenant.project_id, tenant.policy_id)
    a = await post(api, tenant, {"type": "t"}, "k")
    b = await post(api, tenant, {"type": "t"}, "k", queue=second_queue)
    assert a.status == b.status == 201 and a.body["id"] != b.body["id"]
    await api.sql("update fl.idempotency_keys set expires_at = now() - interval '1 second'")
    c = await post(api, tenant, {"type": "other"}, "k")
    assert c.status == 201
    assert await count(api, "fl.idempotency_keys") == 2


async def test_a_sweep_deletes_expired_keys_that_were_never_used_again(
        api: Api, tenant: Tenant, dsn: str) -> None:
    # The scheduler's idempotency-keys sweep: a key a client never sends again would otherwise
    # stay for ever (a submission deletes only its own expired key).
    for key in ("a", "b", "c"):
        assert (await post(api, tenant, {"type": "t"}, key)).status == 201
    await api.sql("update fl.idempotency_keys set expires_at = now() - interval '1 second'"
                  " where key <> 'c'")
    async with open_pool(dsn, max_size=1) as pool:
        ctx = ServiceContext(Settings(), Readiness(), pool)
        assert await run_once(ctx, next(s for s in SWEEPS if s.name == "idempotency-keys")) == 2
    assert await api.sql("select fl.prune_idempotency_keys(100)") == [(0,)]
    assert await api.sql("select key from fl.idempotency_keys") == [("c",)]
    # The live key still answers with its job; a pruned one is new again.
    assert (await post(api, tenant, {"type": "t"}, "c")).status == 200
    assert (await post(api, tenant, {"type": "other"}, "a")).status == 201
    for bad in (0, None, 1000001):
        with pytest.raises(psycopg.Error) as refused:
            await api.sql("select fl.prune_idempotency_keys(%s)", bad)
        assert refused.value.sqlstate == "FL005"


async def test_bad_keys_are_400(api: Api, tenant: Tenant) -> None:
    for key in ("", "   ", "x" * 201, "tab\there"):
        answer = await post(api, tenant, {"type": "t"}, key)
        assert (answer.status, answer.code) == (400, "invalid_input"), key
    assert await count(api) == 0


async def test_batches_honour_the_key(api: Api, tenant: Tenant) -> None:
    body = {"jobs": [{"type": "a"}, {"type": "b", "depends_on_batch": [0]}]}
    first = await post(api, tenant, body, "batch-1", "/batch")
    assert first.status == 201
    again = await post(api, tenant, body, "batch-1", "/batch")
    assert again.status == 200 and again.body == first.body
    other = await post(api, tenant, {"jobs": [{"type": "a"}]}, "batch-1", "/batch")
    assert (other.status, other.code) == (409, "idempotency_conflict")
    single = await post(api, tenant, {"type": "a"}, "batch-1")
    assert (single.status, single.code) == (409, "idempotency_conflict")
    assert await count(api) == 2


async def test_two_concurrent_first_uses_make_one_job(api: Api, tenant: Tenant) -> None:
    """Both requests pass the key lookup before either commits; exactly one job results."""
    parent = await post(api, tenant, {"type": "p"}, None)
    body = {"type": "t", "depends_on": [parent.body["id"]]}
    answers: list[Any] = []

    async def one() -> None:
        answers.append(await post(api, tenant, body, "race"))

    # Hold the parent row: both submissions stop at the parent lock, after their key lookup.
    await api.conn.execute("begin")
    await api.conn.execute("select 1 from fl.jobs where id = %s for update",
                           (parent.body["id"],))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
        with trio.fail_after(10):
            while True:
                await api.conn.execute("select pg_stat_clear_snapshot()")
                cur = await api.conn.execute(
                    "select count(distinct l.pid) from pg_locks l"
                    " join pg_stat_activity a on a.pid = l.pid"
                    " where not l.granted and a.datname = current_database()")
                row = await cur.fetchone()
                if row is not None and row[0] == 2:
                    break
                await trio.sleep(0.01)
        await api.conn.execute("commit")
    assert sorted(a.status for a in answers) == [200, 201]
    assert answers[0].body["id"] == answers[1].body["id"]
    [(n,)] = await api.sql("select count(*) from fl.jobs where type = 't'")
    assert n == 1
