"""Workers over HTTP: the workers serving a project's or a queue's jobs, paged."""

from __future__ import annotations

import uuid

from tests.api.conftest import Api, Tenant
from tests.api.test_jobs import claim, fingerprint, pages, register, second_queue, submit


async def test_workers_of_a_project_and_of_a_queue(api: Api, tenant: Tenant) -> None:
    other = await second_queue(api, tenant)
    assert tenant.other_queue_id is not None
    on_queue = [await register(api, [tenant.queue_id]) for _ in range(3)]
    on_other = await register(api, [other])
    # One process serving this project and another organization's queue.
    shared = await register(api, [tenant.queue_id, tenant.other_queue_id], concurrency=4)
    await register(api, [tenant.other_queue_id])          # not this project's
    for _ in range(2):
        await submit(api, tenant.queue_id)
        await submit(api, tenant.other_queue_id)
    assert len(await claim(api, tenant.queue_id, shared, 2)) == 2
    assert len(await claim(api, tenant.other_queue_id, shared, 2)) == 2
    viewer = tenant.tokens["viewer"]

    everyone = await pages(api, "workers", viewer, project=str(tenant.project_id), limit=2)
    expected = sorted([*on_queue, on_other, shared], reverse=True)
    assert [uuid.UUID(w["id"]) for w in everyone] == expected
    mine = next(w for w in everyone if w["id"] == str(shared))
    # Only what concerns this project: its queue, its two leases (not globex's).
    assert mine["queues"] == [str(tenant.queue_id)] and mine["leases"] == 2
    assert (mine["hostname"], mine["pid"], mine["state"], mine["concurrency"]) == (
        "box-1", 4242, "active", 4)
    assert set(mine) == {"id", "hostname", "pid", "state", "concurrency", "queues", "leases",
                         "started_at", "last_seen_at"}

    by_queue = await pages(api, "workers", viewer, queue=str(other), limit=50)
    assert [w["id"] for w in by_queue] == [str(on_other)]
    assert by_queue[0]["queues"] == [str(other)] and by_queue[0]["leases"] == 0


async def test_workers_input_and_tenancy(api: Api, tenant: Tenant) -> None:
    await register(api, [tenant.queue_id])
    viewer = tenant.tokens["viewer"]
    before = await fingerprint(api)
    missing = await api.get("workers", token=viewer)
    assert missing.status == 400 and missing.code == "scope_required"
    for query, field in [({"project": str(tenant.project_id), "limit": 0}, "limit"),
                         ({"project": str(tenant.project_id), "limit": 101}, "limit"),
                         ({"project": str(tenant.project_id), "cursor": "WzFd"}, "cursor"),
                         ({"project": str(tenant.project_id), "state": "dead"}, "state"),
                         ({"queue": "q1"}, "queue")]:
        answer = await api.get("workers", token=viewer, query=query)
        assert answer.status == 400 and answer.body["field"] == field, (query, answer)
    outsider = await api.get("workers", token=tenant.tokens["outsider"],
                             query={"project": str(tenant.project_id)})
    assert outsider.status == 404
    theirs = await api.get("workers", token=viewer, query={"queue": str(tenant.other_queue_id)})
    assert theirs.status == 404
    assert (await api.get("workers", query={"project": str(tenant.project_id)})).status == 401
    assert await fingerprint(api) == before
