"""POST /queues/{queue_id}/jobs: one job."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import Api, Tenant


def url(queue: Any) -> str:
    return f"queues/{queue}/jobs"


async def count(api: Api, table: str = "fl.jobs") -> int:
    [(n,)] = await api.sql(f"select count(*) from {table}")
    return int(n)


async def test_submit_then_the_job_exists_with_defaults(api: Api, tenant: Tenant) -> None:
    answer = await api.post(url(tenant.queue_id), {"type": " email ", "payload": {"to": "x"}},
                            token=tenant.tokens["member"])
    assert answer.status == 201, answer
    body = answer.body
    assert set(body) == {"id", "queue_id", "type", "status", "priority", "run_at", "created_at"}
    assert (body["queue_id"], body["type"], body["status"], body["priority"]) == (
        str(tenant.queue_id), "email", "queued", 0)
    [row] = await api.sql("select type, payload, timeout_ms, retry_policy_id, batch_id"
                          " from fl.jobs where id = %s", body["id"])
    assert row == ("email", {"to": "x"}, 300000, tenant.policy_id, None)
    [(action, entity_id)] = await api.sql("select action, entity_id from fl.audit_log")
    assert (action, entity_id) == ("job.submit", str(body["id"]))
    [(topic,)] = await api.sql("select topic from fl.events where job_id = %s", body["id"])
    assert topic == "job.submitted"


async def test_every_field_is_honoured(api: Api, tenant: Tenant) -> None:
    [(policy,)] = await api.sql("insert into fl.retry_policies (project_id, name) values (%s,"
                                " 'other') returning id", tenant.project_id)
    answer = await api.post(url(tenant.queue_id), {
        "type": "t", "payload": [1, "two", None], "priority": -3,
        "run_at": "2099-01-01T00:00:00+02:00", "timeout_ms": 5, "retry_policy_id": str(policy),
    }, token=tenant.tokens["owner"])
    assert answer.status == 201, answer
    assert answer.body["status"] == "scheduled" and answer.body["priority"] == -3
    assert answer.body["run_at"] == "2098-12-31T22:00:00Z"
    [row] = await api.sql("select payload, timeout_ms, retry_policy_id from fl.jobs")
    assert row == ([1, "two", None], 5, policy)
    delayed = await api.post(url(tenant.queue_id), {"type": "t", "delay_ms": 60_000},
                             token=tenant.tokens["member"])
    assert delayed.status == 201 and delayed.body["status"] == "scheduled"


async def test_bad_bodies_are_400_and_change_nothing(api: Api, tenant: Tenant) -> None:
    cases: list[tuple[Any, str]] = [
        ({}, "type"),
        ({"type": ""}, "type"),
        ({"type": "   "}, "type"),
        ({"type": 5}, "type"),
        ({"type": "x" * 201}, "type"),
        ({"type": "t", "priority": "high"}, "priority"),
        ({"type": "t", "priority": 2**31}, "priority"),
        ({"type": "t", "priority": 1.5}, "priority"),
        ({"type": "t", "timeout_ms": 0}, "timeout_ms"),
        ({"type": "t", "timeout_ms": 2**31}, "timeout_ms"),
        ({"type": "t", "delay_ms": -1}, "delay_ms"),
        ({"type": "t", "run_at": "tomorrow"}, "run_at"),
        ({"type": "t", "run_at": "2030-01-01T00:00:00"}, "run_at"),
        ({"type": "t", "run_at": "2030-01-01T00:00:00Z", "delay_ms": 5}, "run_at"),
        ({"type": "t", "retry_policy_id": "nope"}, "retry_policy_id"),
        ({"type": "t", "depends_on": "1"}, "depends_on"),
        ({"type": "t", "depends_on": [0]}, "depends_on[0]"),
        ({"type": "t", "depends_on": [1, 1]}, "depends_on"),
        ({"type": "t", "depends_on": [2**63]}, "depends_on[0]"),
        ({"type": "t", "colour": "red"}, "colour"),
        ({"type": "t", "depends_on_batch": [0]}, "depends_on_batch"),
    ]
    for body, field in cases:
        answer = await api.post(url(tenant.queue_id), body, token=tenant.tokens["member"])
        assert (answer.status, answer.code) == (400, "invalid_input"), (body, answer)
        assert answer.body["detail"].startswith(field), (body, answer)
    bad_json = await api.post(url(tenant.queue_id), raw=b"{nope",
                              headers={"Content-Type": "application/json"},
                              token=tenant.tokens["member"])
    assert (bad_json.status, bad_json.code) == (400, "invalid_json")
    assert await count(api) == 0
    assert await count(api, "fl.audit_log") == 0


async def test_a_policy_of_another_project_is_refused(api: Api, tenant: Tenant) -> None:
    [(theirs,)] = await api.sql("select id from fl.retry_policies where project_id = %s",
                                tenant.other_project_id)
    answer = await api.post(url(tenant.queue_id), {"type": "t", "retry_policy_id": str(theirs)},
                            token=tenant.tokens["member"])
    assert (answer.status, answer.code) == (400, "invalid_input")
    assert await count(api) == 0


async def test_payload_over_256_kib_is_413(api: Api, tenant: Tenant) -> None:
    big = {"data": "x" * 262_144}
    answer = await api.post(url(tenant.queue_id), {"type": "t", "payload": big},
                            token=tenant.tokens["member"])
    assert (answer.status, answer.code) == (413, "payload_too_large")
    huge = await api.post(url(tenant.queue_id), raw=b'{"type": "t", "payload": "' +
                          b"x" * (4 * 1024 * 1024) + b'"}',
                          headers={"Content-Type": "application/json"},
                          token=tenant.tokens["member"])
    assert (huge.status, huge.code) == (413, "payload_too_large")
    fits = await api.post(url(tenant.queue_id), {"type": "t", "payload": "x" * 200_000},
                          token=tenant.tokens["member"])
    assert fits.status == 201
    assert await count(api) == 1


async def test_depth_cap_is_429_whatever_run_at(api: Api, tenant: Tenant) -> None:
    await api.sql("update fl.queues set max_depth = 1 where id = %s", tenant.queue_id)
    first = await api.post(url(tenant.queue_id), {"type": "t", "run_at": "2099-01-01T00:00:00Z"},
                           token=tenant.tokens["member"])
    assert first.status == 201
    for body in ({"type": "t"}, {"type": "t", "run_at": "2000-01-01T00:00:00Z"},
                 {"type": "t", "run_at": "2099-01-01T00:00:00Z"}):
        answer = await api.post(url(tenant.queue_id), body, token=tenant.tokens["member"])
        assert (answer.status, answer.code) == (429, "queue_full"), body
        assert answer.headers["Retry-After"] == "1"
    assert await count(api) == 1


async def test_who_may_submit(api: Api, tenant: Tenant) -> None:
    body = {"type": "t"}
    viewer = await api.post(url(tenant.queue_id), body, token=tenant.tokens["viewer"])
    assert (viewer.status, viewer.code) == (403, "forbidden")
    anonymous = await api.post(url(tenant.queue_id), body)
    assert (anonymous.status, anonymous.code) == (401, "unauthenticated")
    outsider = await api.post(url(tenant.queue_id), body, token=tenant.tokens["outsider"])
    assert (outsider.status, outsider.code) == (404, "not_found")
    foreign = await api.post(url(tenant.other_queue_id), body, token=tenant.tokens["owner"])
    assert (foreign.status, foreign.code) == (404, "not_found")
    unknown = await api.post(url("0190a6c1-0000-7000-8000-000000000000"), body,
                             token=tenant.tokens["owner"])
    assert (unknown.status, unknown.code) == (404, "not_found")
    malformed = await api.post(url("not-a-uuid"), body, token=tenant.tokens["owner"])
    assert (malformed.status, malformed.code) == (400, "invalid_input")
    assert await count(api) == 0
    for role in ("member", "admin", "owner"):
        assert (await api.post(url(tenant.queue_id), body, token=tenant.tokens[role])).status \
            == 201
    own = await api.post(url(tenant.other_queue_id), body, token=tenant.tokens["outsider"])
    assert own.status == 201
