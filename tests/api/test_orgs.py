"""Organizations: create, list, read, rename, delete (also after work has run, reference W5)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from fenceline.api import auth
from tests.api.conftest import Api, Tenant

COUNTS = "select (select count(*) from fl.organizations), (select count(*) from fl.org_members)," \
         " (select count(*) from fl.audit_log)"


async def audit(api: Api, action: str) -> list[tuple[Any, ...]]:
    return await api.sql(
        "select org_id, project_id, actor_user, actor_key, entity, entity_id, detail"
        "  from fl.audit_log where action = %s", action)


async def make_key(api: Api, project: uuid.UUID, role: str = "admin") -> str:
    token, digest = auth.new_token(auth.KEY_PREFIX)
    await api.sql("insert into fl.api_keys (project_id, name, role, token_hash, prefix)"
                  " values (%s, 'k', %s, %s, %s)", project, role, digest, token[:12])
    return token


async def test_create_makes_the_caller_owner_and_audits(api: Api) -> None:
    user, token = await api.user("ann")
    answer = await api.post("orgs", {"name": "  Initech  "}, token=token)
    assert answer.status == 201, answer
    assert answer.body["name"] == "Initech" and answer.body["role"] == "owner"
    org = uuid.UUID(answer.body["id"])
    assert await api.sql("select user_id, role::text from fl.org_members where org_id = %s",
                         org) == [(user, "owner")]
    assert await audit(api, "org.create") == [
        (org, None, user, None, "org", str(org), {"name": "Initech"})]
    read = await api.get(f"orgs/{org}", token=token)
    assert read.status == 200 and read.body == answer.body


@pytest.mark.parametrize(("body", "field"), [
    ({}, "name"),
    ({"name": ""}, "name"),
    ({"name": "   "}, "name"),
    ({"name": "x" * 201}, "name"),
    ({"name": 7}, "name"),
    ({"name": None}, "name"),
    ({"name": "ok", "plan": "gold"}, "plan"),
    ([], "body"),
])
async def test_bad_create_bodies_change_nothing(api: Api, body: Any, field: str) -> None:
    _, token = await api.user("ann")
    answer = await api.post("orgs", body, token=token)
    assert answer.status == 400, answer
    assert answer.code == "invalid_input" and answer.body["field"] == field
    assert await api.sql(COUNTS) == [(0, 0, 0)]


async def test_create_needs_a_person(api: Api, tenant: Tenant) -> None:
    before = await api.sql(COUNTS)
    assert (await api.post("orgs", {"name": "x"})).status == 401
    key = await make_key(api, tenant.project_id)
    answer = await api.post("orgs", {"name": "x"}, token=key)
    assert answer.status == 403 and answer.code == "forbidden"
    assert await api.sql(COUNTS) == before


async def test_list_is_mine_newest_first_and_paged(api: Api, tenant: Tenant) -> None:
    token = tenant.tokens["viewer"]
    made = []
    for name in ("b1", "b2", "b3"):
        answer = await api.post("orgs", {"name": name}, token=token)
        made.append(answer.body["id"])
    first = await api.get("orgs", token=token, query={"limit": 2})
    assert first.status == 200
    assert [o["id"] for o in first.body["items"]] == made[::-1][:2]
    assert first.body["next_cursor"]
    second = await api.get("orgs", token=token,
                           query={"limit": 2, "cursor": first.body["next_cursor"]})
    assert [(o["name"], o["role"]) for o in second.body["items"]] == [("b1", "owner"),
                                                                      ("acme", "viewer")]
    assert second.body["next_cursor"] is None
    everything = await api.get("orgs", token=token)
    assert len(everything.body["items"]) == 4 and everything.body["next_cursor"] is None
    # The outsider's organization is not listed for acme's people, and the reverse.
    theirs = await api.get("orgs", token=tenant.tokens["outsider"])
    assert [o["name"] for o in theirs.body["items"]] == ["globex"]


@pytest.mark.parametrize(("query", "code"), [
    ({"limit": 0}, "invalid_input"), ({"limit": 101}, "invalid_input"),
    ({"limit": "ten"}, "invalid_input"), ({"cursor": "nope"}, "invalid_cursor"),
    ({"cursor": ""}, "invalid_input"), ({"sort": "name"}, "invalid_input"),
])
async def test_bad_list_queries(api: Api, tenant: Tenant, query: dict[str, Any],
                                code: str) -> None:
    answer = await api.get("orgs", token=tenant.tokens["owner"], query=query)
    assert answer.status == 400 and answer.code == code, answer


async def test_read_by_role_and_tenant(api: Api, tenant: Tenant) -> None:
    for role in ("owner", "admin", "member", "viewer"):
        answer = await api.get(f"orgs/{tenant.org_id}", token=tenant.tokens[role])
        assert answer.status == 200 and answer.body["role"] == role
        assert answer.body["name"] == "acme"
    assert (await api.get(f"orgs/{tenant.org_id}", token=tenant.tokens["outsider"])).status == 404
    assert (await api.get(f"orgs/{tenant.other_org_id}",
                          token=tenant.tokens["owner"])).status == 404
    assert (await api.get(f"orgs/{uuid.uuid4()}", token=tenant.tokens["owner"])).status == 404
    bad = await api.get("orgs/not-a-uuid", token=tenant.tokens["owner"])
    assert bad.status == 400 and bad.body["field"] == "org_id"
    assert (await api.get(f"orgs/{tenant.org_id}")).status == 401
    key = await make_key(api, tenant.project_id)
    assert (await api.get(f"orgs/{tenant.org_id}", token=key)).status == 403


async def test_rename_needs_admin_and_audits(api: Api, tenant: Tenant) -> None:
    path = f"orgs/{tenant.org_id}"
    for who, status in (("member", 403), ("viewer", 403), ("outsider", 404)):
        answer = await api.patch(path, {"name": "x"}, token=tenant.tokens[who])
        assert answer.status == status, (who, answer)
    assert (await api.patch(path, {"name": "x"})).status == 401
    for body in ({}, {"name": ""}, {"name": "x", "id": str(uuid.uuid4())}, {"name": None}):
        assert (await api.patch(path, body, token=tenant.tokens["admin"])).status == 400
    assert await api.sql("select name from fl.organizations where id = %s",
                         tenant.org_id) == [("acme",)]
    assert await audit(api, "org.update") == []
    answer = await api.patch(path, {"name": "Acme Corp"}, token=tenant.tokens["admin"])
    assert answer.status == 200 and answer.body["name"] == "Acme Corp"
    assert answer.body["role"] == "admin"
    assert await audit(api, "org.update") == [
        (tenant.org_id, None, tenant.users["admin"], None, "org", str(tenant.org_id),
         {"name": "Acme Corp"})]


async def test_delete_needs_the_owner(api: Api, tenant: Tenant) -> None:
    path = f"orgs/{tenant.org_id}"
    for who, status in (("admin", 403), ("member", 403), ("outsider", 404)):
        assert (await api.delete(path, token=tenant.tokens[who])).status == status
    assert (await api.delete(path)).status == 401
    assert (await api.delete(f"orgs/{tenant.other_org_id}",
                             token=tenant.tokens["owner"])).status == 404
    assert (await api.delete("orgs/123", token=tenant.tokens["owner"])).status == 400
    assert await api.sql("select count(*) from fl.organizations") == [(2,)]


async def run_some_work(api: Api, queue: uuid.UUID | None) -> None:
    """Jobs that completed, died, are running (with a log line) and wait, via the engine."""
    [(worker,)] = await api.sql(
        "select fl.register_worker(array[%s]::uuid[], null, 'test-host', 4242, 8)", queue)
    for _ in range(4):
        await api.sql("select * from fl.submit(%s, 't')", queue)
    claimed = await api.sql("select job_id, fence from fl.claim(%s, %s, null, 3, '1 minute')",
                            queue, worker)
    assert len(claimed) == 3, claimed
    (done, f1), (dead, f2), (running, f3) = claimed
    assert await api.sql("select outcome from fl.complete(%s, array[%s]::bigint[],"
                         " array[%s]::bigint[])", worker, done, f1) == [("ok",)]
    [(outcome, *_)] = await api.sql("select * from fl.fail(%s, %s, %s, 'permanent', 'boom')",
                                    worker, dead, f2)
    assert outcome == "dead"
    await api.sql("select fl.append_logs(%s, %s, %s, array['info'], array['hello'])",
                  worker, running, f3)
    for table in ("attempts", "leases", "dead_letters", "events", "attempt_logs"):
        [(n,)] = await api.sql(f"select count(*) from fl.{table}")
        assert n > 0, table


async def remaining(api: Api, project: uuid.UUID | None, queue: uuid.UUID | None,
                    jobs: list[int]) -> dict[str, int]:
    """Rows left anywhere that belonged to ``project`` (with ``queue`` and ``jobs``)."""
    queries = {
        "projects": ("select count(*) from fl.projects where id = %s", project),
        "retry_policies": ("select count(*) from fl.retry_policies where project_id = %s",
                           project),
        "queues": ("select count(*) from fl.queues where project_id = %s", project),
        "api_keys": ("select count(*) from fl.api_keys where project_id = %s", project),
        "jobs": ("select count(*) from fl.jobs where project_id = %s", project),
        "dead_letters": ("select count(*) from fl.dead_letters where project_id = %s", project),
        "queue_state": ("select count(*) from fl.queue_state where queue_id = %s", queue),
        "worker_queues": ("select count(*) from fl.worker_queues where queue_id = %s", queue),
        "leases": ("select count(*) from fl.leases where queue_id = %s", queue),
        "attempts": ("select count(*) from fl.attempts where job_id = any(%s)", jobs),
        "attempt_logs": ("select count(*) from fl.attempt_logs where job_id = any(%s)", jobs),
        "events": ("select count(*) from fl.events where project_id = %s", project),
    }
    out = {}
    for table, (query, value) in queries.items():
        [(n,)] = await api.sql(query, value)
        out[table] = n
    return out


async def test_delete_after_work_ran_removes_everything(api: Api, tenant: Tenant) -> None:
    """Reference W5: deleting failed once executions existed."""
    await run_some_work(api, tenant.queue_id)
    await run_some_work(api, tenant.other_queue_id)
    await make_key(api, tenant.project_id)
    jobs = [r[0] for r in await api.sql("select id from fl.jobs where queue_id = %s",
                                        tenant.queue_id)]
    other_jobs = [r[0] for r in await api.sql("select id from fl.jobs where queue_id = %s",
                                              tenant.other_queue_id)]
    assert all((await remaining(api, tenant.project_id, tenant.queue_id, jobs)).values())
    others_before = await remaining(api, tenant.other_project_id, tenant.other_queue_id,
                                    other_jobs)
    answer = await api.delete(f"orgs/{tenant.org_id}", token=tenant.tokens["owner"])
    assert answer.status == 204, answer
    assert await api.sql("select count(*) from fl.organizations where id = %s",
                         tenant.org_id) == [(0,)]
    left = await remaining(api, tenant.project_id, tenant.queue_id, jobs)
    assert left == dict.fromkeys(left, 0)
    assert await api.sql("select count(*) from fl.org_members where org_id = %s",
                         tenant.org_id) == [(0,)]
    # globex is untouched.
    assert await remaining(api, tenant.other_project_id, tenant.other_queue_id,
                           other_jobs) == others_before
    # The organization's audit trail went with it; the deletion is in no audit row.
    assert await api.sql("select count(*) from fl.audit_log where org_id = %s",
                         tenant.org_id) == [(0,)]
    assert (await api.get(f"orgs/{tenant.org_id}", token=tenant.tokens["owner"])).status == 404
