"""depends_on over HTTP: waiting, unknown and foreign parents (W3), failed parents (W2)."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import Api, Tenant


def url(queue: Any) -> str:
    return f"queues/{queue}/jobs"


async def count(api: Api, table: str = "fl.jobs") -> int:
    [(n,)] = await api.sql(f"select count(*) from {table}")
    return int(n)


async def submit(api: Api, tenant: Tenant, **body: Any) -> Any:
    answer = await api.post(url(tenant.queue_id), {"type": "t"} | body,
                            token=tenant.tokens["member"])
    assert answer.status == 201, answer
    return answer.body


async def test_a_child_waits_for_its_parents(api: Api, tenant: Tenant) -> None:
    a, b = await submit(api, tenant), await submit(api, tenant)
    child = await submit(api, tenant, depends_on=[b["id"], a["id"]])
    assert child["status"] == "scheduled"
    [(pending,)] = await api.sql("select pending_deps from fl.jobs where id = %s", child["id"])
    assert pending == 2
    edges = await api.sql("select parent_id from fl.job_dependencies where child_id = %s"
                          " order by 1", child["id"])
    assert edges == [(a["id"],), (b["id"],)]


async def test_batch_entries_may_depend_on_existing_jobs_and_each_other(api: Api,
                                                                        tenant: Tenant) -> None:
    a = await submit(api, tenant)
    answer = await api.post(f"{url(tenant.queue_id)}/batch", {"jobs": [
        {"type": "x", "depends_on": [a["id"]]},
        {"type": "y", "depends_on_batch": [0], "depends_on": [a["id"]]}]},
        token=tenant.tokens["member"])
    assert answer.status == 201, answer
    x, y = answer.body["job_ids"]
    rows = await api.sql("select id, pending_deps, has_dependents from fl.jobs order by id")
    assert rows == [(a["id"], 0, True), (x, 1, True), (y, 2, False)]


async def test_unknown_and_foreign_parents_answer_alike(api: Api, tenant: Tenant) -> None:
    theirs = await api.post(url(tenant.other_queue_id), {"type": "secret"},
                            token=tenant.tokens["outsider"])
    foreign = theirs.body["id"]
    missing = foreign + 1000
    before = await count(api)
    answers = []
    for parent in (foreign, missing):
        answer = await api.post(url(tenant.queue_id), {"type": "t", "depends_on": [parent]},
                                token=tenant.tokens["member"])
        assert (answer.status, answer.code) == (400, "unknown_parent"), answer
        answers.append(answer.body["detail"].replace(str(parent), "N"))
    batch = await api.post(f"{url(tenant.queue_id)}/batch",
                           {"jobs": [{"type": "t", "depends_on": [foreign]}]},
                           token=tenant.tokens["member"])
    assert (batch.status, batch.code) == (400, "unknown_parent")
    assert answers[0] == answers[1]
    assert await count(api) == before
    assert await count(api, "fl.job_dependencies") == 0
    [(armed,)] = await api.sql("select has_dependents from fl.jobs where id = %s", foreign)
    assert armed is False


async def test_a_dead_or_cancelled_parent_is_409(api: Api, tenant: Tenant) -> None:
    dead, cancelled = await submit(api, tenant), await submit(api, tenant)
    await api.sql("update fl.jobs set status = 'cancelled', finished_at = now()"
                  " where id = %s", cancelled["id"])
    await api.sql("update fl.jobs set status = 'running', fence = 1, attempts = 1,"
                  " claimed_at = now(), deadline_at = now() where id = %s", dead["id"])
    await api.sql("update fl.jobs set status = 'dead_letter', finished_at = now(),"
                  " deadline_at = null where id = %s", dead["id"])
    before = await count(api)
    for parent in (dead, cancelled):
        answer = await api.post(url(tenant.queue_id), {"type": "t", "depends_on": [parent["id"]]},
                                token=tenant.tokens["member"])
        assert (answer.status, answer.code) == (409, "parent_failed"), answer
        assert str(parent["id"]) in answer.body["detail"]
    assert await count(api) == before


async def test_cancelling_a_parent_cancels_its_children(api: Api, tenant: Tenant) -> None:
    parent = await submit(api, tenant)
    child = await submit(api, tenant, depends_on=[parent["id"]])
    grandchild = await submit(api, tenant, depends_on=[child["id"]])
    await api.sql("select fl.cancel(%s)", parent["id"])
    rows = await api.sql("select status::text from fl.jobs where id in (%s, %s)",
                         child["id"], grandchild["id"])
    assert rows == [("cancelled",), ("cancelled",)]
