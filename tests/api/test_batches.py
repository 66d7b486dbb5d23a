"""POST /queues/{queue_id}/jobs/batch and GET /batches/{batch_id}."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import Api, Tenant


def url(queue: Any) -> str:
    return f"queues/{queue}/jobs/batch"


async def count(api: Api, table: str = "fl.jobs") -> int:
    [(n,)] = await api.sql(f"select count(*) from {table}")
    return int(n)


async def test_a_batch_honours_every_field_and_reports_progress(api: Api,
                                                                tenant: Tenant) -> None:
    [(policy,)] = await api.sql("insert into fl.retry_policies (project_id, name) values (%s,"
                                " 'other') returning id", tenant.project_id)
    jobs = [{"type": "extract", "priority": 7, "payload": {"n": 1}},
            {"type": "load", "depends_on_batch": [0], "timeout_ms": 99,
             "retry_policy_id": str(policy)},
            {"type": "later", "run_at": "2099-01-01T00:00:00Z"},
            {"type": "soon", "delay_ms": 1000}]
    answer = await api.post(url(tenant.queue_id), {"jobs": jobs}, token=tenant.tokens["member"])
    assert answer.status == 201, answer
    ids = answer.body["job_ids"]
    assert answer.body["count"] == 4 and len(ids) == 4 and ids == sorted(ids)
    rows = await api.sql("select id, type, status::text, priority, timeout_ms, retry_policy_id,"
                         " pending_deps, batch_id::text from fl.jobs order by id")
    assert [r[:7] for r in rows] == [
        (ids[0], "extract", "queued", 7, 300000, tenant.policy_id, 0),
        (ids[1], "load", "scheduled", 0, 99, policy, 1),
        (ids[2], "later", "scheduled", 0, 300000, tenant.policy_id, 0),
        (ids[3], "soon", "scheduled", 0, 300000, tenant.policy_id, 0)]
    assert {r[7] for r in rows} == {answer.body["batch_id"]}
    [(topic, payload)] = await api.sql("select topic, payload from fl.events")
    assert topic == "jobs.submitted" and [j[0] for j in payload["jobs"]] == ids
    [(action, entity_id)] = await api.sql("select action, entity_id from fl.audit_log")
    assert (action, entity_id) == ("job.submit_batch", answer.body["batch_id"])

    progress = await api.get(f"batches/{answer.body['batch_id']}",
                             token=tenant.tokens["viewer"])
    assert progress.status == 200
    assert progress.body == {"batch_id": answer.body["batch_id"], "total": 4, "done": 0,
                             "complete": False,
                             "status_counts": {"queued": 1, "scheduled": 3}}
    await api.sql("update fl.jobs set status = 'cancelled', finished_at = now(),"
                  " pending_deps = 0 where status <> 'cancelled'")
    done = await api.get(f"batches/{answer.body['batch_id']}", token=tenant.tokens["viewer"])
    assert (done.body["done"], done.body["complete"]) == (4, True)


async def test_bad_batches_are_400_and_change_nothing(api: Api, tenant: Tenant) -> None:
    cases: list[tuple[Any, str]] = [
        ({}, "jobs"),
        ({"jobs": []}, "jobs"),
        ({"jobs": [{"type": "t"}] * 1001}, "jobs"),
        ({"jobs": {"type": "t"}}, "jobs"),
        ({"jobs": [{"type": "t"}, {}]}, "jobs[1].type"),
        ({"jobs": [{"type": "t"}, {"type": "t", "priority": "x"}]}, "jobs[1].priority"),
        ({"jobs": [{"type": "t", "timeout_ms": -1}]}, "jobs[0].timeout_ms"),
        ({"jobs": [{"type": "t", "extra": 1}]}, "jobs[0].extra"),
        ({"jobs": [{"type": "t"}], "extra": 1}, "extra"),
        ({"jobs": [{"type": "t", "depends_on_batch": [0]}]}, "jobs[0].depends_on_batch"),
        ({"jobs": [{"type": "t", "depends_on_batch": [1]}, {"type": "u"}]},
         "jobs[0].depends_on_batch"),
        ({"jobs": [{"type": "t"}, {"type": "u", "depends_on_batch": [0, 0]}]},
         "jobs[1].depends_on_batch"),
        ({"jobs": [{"type": "t", "run_at": "2030-01-01T00:00:00Z", "delay_ms": 1}]},
         "jobs[0].run_at"),
    ]
    for body, field in cases:
        answer = await api.post(url(tenant.queue_id), body, token=tenant.tokens["member"])
        assert (answer.status, answer.code) == (400, "invalid_input"), (body, answer)
        assert answer.body["detail"].startswith(field), (body, answer)
    big = await api.post(url(tenant.queue_id),
                         {"jobs": [{"type": "t"}, {"type": "t", "payload": "x" * 262_200}]},
                         token=tenant.tokens["member"])
    assert (big.status, big.code) == (413, "payload_too_large")
    assert big.body["detail"].startswith("jobs[1].payload")
    assert await count(api) == 0 and await count(api, "fl.audit_log") == 0


async def test_a_thousand_jobs_in_one_request(api: Api, tenant: Tenant) -> None:
    jobs = [{"type": "t", "payload": {"i": i}} for i in range(1000)]
    answer = await api.post(url(tenant.queue_id), {"jobs": jobs}, token=tenant.tokens["member"])
    assert answer.status == 201 and answer.body["count"] == 1000
    assert await count(api) == 1000
    assert await count(api, "fl.events") == 1


async def test_the_depth_cap_refuses_the_whole_batch(api: Api, tenant: Tenant) -> None:
    await api.sql("update fl.queues set max_depth = 3 where id = %s", tenant.queue_id)
    assert (await api.post(url(tenant.queue_id), {"jobs": [{"type": "t"}] * 2},
                           token=tenant.tokens["member"])).status == 201
    answer = await api.post(url(tenant.queue_id), {"jobs": [{"type": "t"}] * 2},
                            token=tenant.tokens["member"])
    assert (answer.status, answer.code) == (429, "queue_full")
    assert answer.headers["Retry-After"] == "1"
    assert await count(api) == 2


async def test_who_may_submit_and_read_batches(api: Api, tenant: Tenant) -> None:
    body = {"jobs": [{"type": "t"}]}
    assert (await api.post(url(tenant.queue_id), body,
                           token=tenant.tokens["viewer"])).status == 403
    assert (await api.post(url(tenant.queue_id), body)).status == 401
    assert (await api.post(url(tenant.queue_id), body,
                           token=tenant.tokens["outsider"])).status == 404
    assert (await api.post(url(tenant.other_queue_id), body,
                           token=tenant.tokens["member"])).status == 404
    assert (await api.post(url("zzz"), body, token=tenant.tokens["member"])).status == 400
    assert await count(api) == 0
    ours = await api.post(url(tenant.queue_id), body, token=tenant.tokens["member"])
    theirs = await api.post(url(tenant.other_queue_id), body, token=tenant.tokens["outsider"])
    assert ours.status == theirs.status == 201
    batch, other = ours.body["batch_id"], theirs.body["batch_id"]
    assert (await api.get(f"batches/{batch}", token=tenant.tokens["viewer"])).status == 200
    assert (await api.get(f"batches/{batch}")).status == 401
    for answer in (await api.get(f"batches/{batch}", token=tenant.tokens["outsider"]),
                   await api.get(f"batches/{other}", token=tenant.tokens["owner"]),
                   await api.get("batches/0190a6c1-0000-7000-8000-000000000000",
                                 token=tenant.tokens["owner"])):
        assert (answer.status, answer.code) == (404, "not_found")
    malformed = await api.get("batches/123", token=tenant.tokens["owner"])
    assert (malformed.status, malformed.code) == (400, "invalid_input")
