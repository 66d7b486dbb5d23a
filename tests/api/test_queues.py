"""Queues: configuration (W17 rate limits, W23 clearing limits), runtime figures, pause/resume."""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any

import pytest

from tests.api.conftest import Api, Tenant
from tests.api.test_orgs import audit, make_key

COUNT = "select count(*) from fl.queues"
STATE = "select * from fl.queues order by id"


def create_path(tenant: Tenant) -> str:
    return f"projects/{tenant.project_id}/queues"


async def test_create_with_defaults_then_read_and_list(api: Api, tenant: Tenant) -> None:
    body = {"name": "emails", "retry_policy_id": str(tenant.policy_id)}
    answer = await api.post(create_path(tenant), body, token=tenant.tokens["admin"])
    assert answer.status == 201, answer
    q = answer.body
    assert (q["name"], q["retry_policy_id"], q["paused"], q["default_priority"],
            q["default_timeout_ms"], q["max_concurrency"], q["max_depth"], q["rl_rate"],
            q["rl_burst"], q["breaker_enabled"], q["aging_step_ms"], q["aging_max_boost"]) == (
        "emails", str(tenant.policy_id), False, 0, 300_000, None, None, None, None, True, None,
        10)
    assert q["runtime"] == {"in_flight": 0, "queued": 0, "breaker_state": "closed"}
    [(org, project, actor, key, entity, entity_id, detail)] = await audit(api, "queue.create")
    assert (org, project, actor, key, entity, entity_id) == (
        tenant.org_id, tenant.project_id, tenant.users["admin"], None, "queue", q["id"])
    assert detail == {"name": "emails", "retry_policy_id": str(tenant.policy_id)}
    read = await api.get(f"queues/{q['id']}", token=tenant.tokens["viewer"])
    assert read.status == 200 and read.body == q
    page = await api.get(create_path(tenant), token=tenant.tokens["viewer"], query={"limit": 1})
    assert [x["name"] for x in page.body["items"]] == ["emails"]
    assert "runtime" not in page.body["items"][0]
    rest = await api.get(create_path(tenant), token=tenant.tokens["viewer"],
                         query={"limit": 1, "cursor": page.body["next_cursor"]})
    assert [x["name"] for x in rest.body["items"]] == ["work"]
    assert rest.body["next_cursor"] is None


async def test_create_with_every_field(api: Api, tenant: Tenant) -> None:
    body = {"name": "all", "retry_policy_id": str(tenant.policy_id), "default_priority": -5,
            "default_timeout_ms": 1000, "max_concurrency": 4, "max_depth": 100, "rl_rate": 2.5,
            "rl_burst": 5, "breaker_enabled": False, "breaker_failure_ratio": 0.25,
            "breaker_min_volume": 3, "breaker_window_ms": 1000, "breaker_cooldown_ms": 2000,
            "aging_step_ms": 500, "aging_max_boost": 7}
    answer = await api.post(create_path(tenant), body, token=tenant.tokens["admin"])
    assert answer.status == 201, answer
    assert {k: answer.body[k] for k in body} == body
    # The bucket starts full.
    assert await api.sql("select rl_tokens from fl.queue_state where queue_id = %s",
                         uuid.UUID(answer.body["id"])) == [(5.0,)]


@pytest.mark.parametrize(("change", "field"), [
    ({"name": ""}, "name"), ({"name": None}, "name"),
    ({"retry_policy_id": "nope"}, "retry_policy_id"),
    ({"retry_policy_id": None}, "retry_policy_id"),
    ({"default_priority": 2**31}, "default_priority"),
    ({"default_priority": None}, "default_priority"),
    ({"default_timeout_ms": 0}, "default_timeout_ms"),
    ({"max_concurrency": 0}, "max_concurrency"), ({"max_concurrency": "3"}, "max_concurrency"),
    ({"max_depth": -1}, "max_depth"), ({"max_depth": 2**31}, "max_depth"),
    ({"rl_rate": 1, "rl_burst": 0.5}, "rl_burst"),          # W17: bucket under one token
    ({"rl_rate": 1, "rl_burst": 0}, "rl_burst"),
    ({"rl_rate": 0, "rl_burst": 5}, "rl_rate"),
    ({"rl_rate": 1_000_001, "rl_burst": 5}, "rl_rate"),
    ({"rl_rate": 5}, "rl_burst"),                            # a rate needs a bucket
    ({"rl_burst": 5}, "rl_rate"),
    ({"breaker_failure_ratio": 0}, "breaker_failure_ratio"),
    ({"breaker_failure_ratio": 1.5}, "breaker_failure_ratio"),
    ({"breaker_enabled": None}, "breaker_enabled"),
    ({"breaker_min_volume": 0}, "breaker_min_volume"),
    ({"aging_step_ms": 0}, "aging_step_ms"), ({"aging_step_ms": 86_400_001}, "aging_step_ms"),
    ({"aging_max_boost": 1001}, "aging_max_boost"),
    ({"paused": True}, "paused"), ({"shards": 2}, "shards"),
])
async def test_bad_values_name_the_field_and_change_nothing(api: Api, tenant: Tenant,
                                                            change: dict[str, Any],
                                                            field: str) -> None:
    before = await api.sql(STATE)
    body = {"name": "q", "retry_policy_id": str(tenant.policy_id), **change}
    created = await api.post(create_path(tenant), body, token=tenant.tokens["admin"])
    patched = await api.patch(f"queues/{tenant.queue_id}", change, token=tenant.tokens["admin"])
    for answer in (created, patched):
        assert answer.status == 400 and answer.code == "invalid_input", answer
        assert answer.body["field"] == field
    assert await api.sql(STATE) == before
    assert await api.sql("select count(*) from fl.audit_log") == [(0,)]


async def test_policy_must_be_of_the_same_project_and_foreign_ones_do_not_leak(
        api: Api, tenant: Tenant) -> None:
    [(foreign,)] = await api.sql("select id from fl.retry_policies where project_id = %s",
                                 tenant.other_project_id)
    # A policy of another project in acme (visible to this admin) and one of globex.
    second = await api.post(f"orgs/{tenant.org_id}/projects", {"name": "second"},
                            token=tenant.tokens["admin"])
    sibling = await api.post(f"projects/{second.body['id']}/retry-policies", {"name": "s"},
                             token=tenant.tokens["admin"])
    answers = []
    for policy in (foreign, sibling.body["id"], uuid.uuid4()):
        body = {"name": "q", "retry_policy_id": str(policy)}
        created = await api.post(create_path(tenant), body, token=tenant.tokens["admin"])
        patched = await api.patch(f"queues/{tenant.queue_id}", {"retry_policy_id": str(policy)},
                                  token=tenant.tokens["admin"])
        answers += [(created.status, created.body["detail"]),
                    (patched.status, patched.body["detail"])]
    assert len(set(answers)) == 1 and answers[0][0] == 400, answers
    assert await api.sql("select count(*) from fl.queues where project_id = %s",
                         tenant.project_id) == [(1,)]


async def test_patch_absent_keeps_null_clears(api: Api, tenant: Tenant) -> None:
    path, admin = f"queues/{tenant.queue_id}", tenant.tokens["admin"]
    set_all = await api.patch(path, {"max_concurrency": 3, "max_depth": 10, "rl_rate": 1,
                                     "rl_burst": 2, "aging_step_ms": 100}, token=admin)
    assert set_all.status == 200, set_all
    kept = await api.patch(path, {"default_priority": 4}, token=admin)
    assert (kept.body["max_concurrency"], kept.body["max_depth"], kept.body["rl_rate"],
            kept.body["rl_burst"], kept.body["aging_step_ms"], kept.body["default_priority"]) == (
        3, 10, 1, 2, 100, 4)
    # Clearing one half of the rate limit alone is refused; both together clear it.
    half = await api.patch(path, {"rl_rate": None}, token=admin)
    assert half.status == 400 and half.body["field"] == "rl_rate"
    cleared = await api.patch(path, {"max_concurrency": None, "max_depth": None, "rl_rate": None,
                                     "rl_burst": None, "aging_step_ms": None}, token=admin)
    assert cleared.status == 200
    assert await api.sql("select max_concurrency, max_depth, rl_rate, rl_burst, aging_step_ms,"
                         " default_priority from fl.queues where id = %s",
                         tenant.queue_id) == [(None, None, None, None, None, 4)]
    details = [r[6] for r in await api.sql(
        "select org_id, project_id, actor_user, actor_key, entity, entity_id, detail"
        "  from fl.audit_log where action = 'queue.update' order by id")]
    assert details == [{"max_concurrency": 3, "max_depth": 10, "rl_rate": 1, "rl_burst": 2,
                        "aging_step_ms": 100}, {"default_priority": 4},
                       {"max_concurrency": None, "max_depth": None, "rl_rate": None,
                        "rl_burst": None, "aging_step_ms": None}]
    await api.post(create_path(tenant), {"name": "other", "retry_policy_id":
                                         str(tenant.policy_id)}, token=admin)
    taken = await api.patch(path, {"name": "other"}, token=admin)
    assert taken.status == 409 and taken.code == "name_taken"
    dup = await api.post(create_path(tenant), {"name": "work", "retry_policy_id":
                                               str(tenant.policy_id)}, token=admin)
    assert dup.status == 409 and dup.code == "name_taken"


async def test_runtime_figures(api: Api, tenant: Tenant) -> None:
    for _ in range(5):
        await api.sql("select * from fl.submit(%s, 't')", tenant.queue_id)
    [(worker,)] = await api.sql(
        "select fl.register_worker(array[%s]::uuid[], null, 'h', 1, 8)", tenant.queue_id)
    claimed = await api.sql("select job_id from fl.claim(%s, %s, null, 2, '1 minute')",
                            tenant.queue_id, worker)
    assert len(claimed) == 2
    await api.sql("update fl.queue_state set breaker_state = 'open',"
                  " breaker_open_until = fl.now() + interval '1 minute' where queue_id = %s",
                  tenant.queue_id)
    answer = await api.get(f"queues/{tenant.queue_id}", token=tenant.tokens["viewer"])
    assert answer.body["runtime"] == {"in_flight": 2, "queued": 3, "breaker_state": "open"}


async def test_pause_and_resume_are_idempotent_with_events_and_wakeups(
        api: Api, tenant: Tenant) -> None:
    queue = tenant.queue_id
    await api.conn.execute("listen fl_queue")

    async def wakeups() -> list[str]:
        async with aclosing(api.conn.notifies(timeout=0.3)) as gen:
            return [n.payload async for n in gen]

    for action, paused, topic in (("pause", True, "queue.paused"),
                                  ("resume", False, "queue.resumed")):
        first = await api.post(f"queues/{queue}/{action}", token=tenant.tokens["member"])
        assert first.status == 200, first
        assert first.body == {"id": str(queue), "paused": paused, "changed": True}
        assert await wakeups() == [str(queue)]
        again = await api.post(f"queues/{queue}/{action}", token=tenant.tokens["member"])
        assert again.body == {"id": str(queue), "paused": paused, "changed": False}
        assert await wakeups() == []
        assert await api.sql("select paused from fl.queues where id = %s", queue) == [(paused,)]
        assert await api.sql("select project_id, payload from fl.events"
                             " where topic = %s and queue_id = %s", topic, queue) == [
            (tenant.project_id, {"paused": paused})]
        rows = await audit(api, f"queue.{action}")
        assert [(r[2], r[5], r[6]) for r in rows] == [
            (tenant.users["member"], str(queue), {"changed": True}),
            (tenant.users["member"], str(queue), {"changed": False})]
    # A paused queue admits nothing.
    await api.post(f"queues/{queue}/pause", token=tenant.tokens["member"])
    await api.sql("select * from fl.submit(%s, 't')", queue)
    [(worker,)] = await api.sql("select fl.register_worker(array[%s]::uuid[], null, 'h', 1, 8)",
                                queue)
    [(outcome,)] = await api.sql("select outcome from fl.claim(%s, %s, null, 1, '1 minute')",
                                 queue, worker)
    assert outcome == "paused"


async def test_delete_removes_the_queue_and_its_jobs(api: Api, tenant: Tenant) -> None:
    await api.sql("select * from fl.submit(%s, 't')", tenant.queue_id)
    for who, status in (("member", 403), ("viewer", 403), ("outsider", 404)):
        assert (await api.delete(f"queues/{tenant.queue_id}",
                                 token=tenant.tokens[who])).status == status
    assert (await api.delete(f"queues/{tenant.queue_id}")).status == 401
    assert await api.sql(COUNT) == [(2,)]
    answer = await api.delete(f"queues/{tenant.queue_id}", token=tenant.tokens["admin"])
    assert answer.status == 204
    assert await api.sql("select count(*) from fl.jobs where queue_id = %s",
                         tenant.queue_id) == [(0,)]
    assert [r[5:] for r in await audit(api, "queue.delete")] == [
        (str(tenant.queue_id), {"name": "work"})]
    # Now the policy is free to go.
    assert (await api.delete(f"retry-policies/{tenant.policy_id}",
                             token=tenant.tokens["admin"])).status == 204


async def test_roles_tenants_and_malformed_ids(api: Api, tenant: Tenant) -> None:
    tokens, queue, other = tenant.tokens, tenant.queue_id, tenant.other_queue_id
    body = {"name": "n", "retry_policy_id": str(tenant.policy_id)}
    cases: list[tuple[str, str, Any, str | None, int]] = [
        ("POST", create_path(tenant), body, tokens["member"], 403),
        ("POST", create_path(tenant), body, tokens["outsider"], 404),
        ("POST", create_path(tenant), body, None, 401),
        ("POST", f"projects/{tenant.other_project_id}/queues", body, tokens["owner"], 404),
        ("GET", create_path(tenant), None, tokens["outsider"], 404),
        ("GET", f"queues/{queue}", None, tokens["outsider"], 404),
        ("GET", f"queues/{other}", None, tokens["owner"], 404),
        ("GET", f"queues/{uuid.uuid4()}", None, tokens["owner"], 404),
        ("GET", "queues/7", None, tokens["owner"], 400),
        ("GET", f"queues/{queue}", None, None, 401),
        ("PATCH", f"queues/{queue}", {"max_depth": 5}, tokens["member"], 403),
        ("PATCH", f"queues/{queue}", {"max_depth": 5}, tokens["outsider"], 404),
        ("PATCH", f"queues/{other}", {"max_depth": 5}, tokens["owner"], 404),
        ("PATCH", "queues/x", {"max_depth": 5}, tokens["owner"], 400),
        ("POST", f"queues/{queue}/pause", None, tokens["viewer"], 403),
        ("POST", f"queues/{queue}/pause", None, tokens["outsider"], 404),
        ("POST", f"queues/{other}/pause", None, tokens["owner"], 404),
        ("POST", f"queues/{queue}/pause", None, None, 401),
        ("POST", "queues/nope/pause", None, tokens["owner"], 400),
        ("POST", f"queues/{queue}/resume", None, tokens["viewer"], 403),
        ("POST", f"queues/{queue}/pause", {"really": True}, tokens["member"], 400),
        ("DELETE", f"queues/{other}", None, tokens["owner"], 404),
        ("DELETE", "queues/1", None, tokens["owner"], 400),
    ]
    before = await api.sql(STATE)
    for method, path, body_, token, status in cases:
        answer = await api.call(method, path, body_, token=token)
        assert answer.status == status, (method, path, answer)
    assert await api.sql(STATE) == before
    assert await api.sql("select count(*) from fl.audit_log") == [(0,)]
    assert await api.sql("select count(*) from fl.events where topic like 'queue.%%'") == [(0,)]
    # Keys act by their role inside their project.
    viewer_key = await make_key(api, tenant.project_id, "viewer")
    member_key = await make_key(api, tenant.project_id, "member")
    assert (await api.post(f"queues/{queue}/pause", token=viewer_key)).status == 403
    paused = await api.post(f"queues/{queue}/pause", token=member_key)
    assert paused.status == 200
    [row] = await audit(api, "queue.pause")
    assert row[2] is None and row[3] is not None
