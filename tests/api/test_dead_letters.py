"""The dead letter queue over HTTP: list, one death, single replay, paced bulk replay."""

from __future__ import annotations

import uuid

from tests.api.conftest import Api, Tenant
from tests.api.test_jobs import (
    claim,
    dead_job,
    fail,
    fingerprint,
    pages,
    register,
    second_queue,
    submit,
)

# -- GET /dead-letters ----------------------------------------------------------------------


async def test_list_pages_newest_death_first(api: Api, tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    other = await second_queue(api, tenant)
    other_worker = await register(api, [other])
    mine = [await dead_job(api, tenant.queue_id, worker, message=f"m{i}") for i in range(5)]
    theirs = await dead_job(api, other, other_worker)
    assert tenant.other_queue_id is not None
    foreign_worker = await register(api, [tenant.other_queue_id])
    await dead_job(api, tenant.other_queue_id, foreign_worker)
    await submit(api, tenant.queue_id)                    # alive: not listed
    viewer = tenant.tokens["viewer"]

    by_queue = await pages(api, "dead-letters", viewer, queue=str(tenant.queue_id), limit=2)
    assert [i["job_id"] for i in by_queue] == mine[::-1]
    by_project = await pages(api, "dead-letters", viewer, project=str(tenant.project_id),
                             limit=4)
    assert [i["job_id"] for i in by_project] == [theirs, *mine[::-1]]
    item = by_queue[0]
    assert item == {"job_id": mine[-1], "queue_id": str(tenant.queue_id), "type": "t",
                    "replay_generation": 0, "reason": "permanent_error",
                    "error_class": "Boom", "error_message": "m4",
                    "dead_at": item["dead_at"], "replayed_at": None, "attempts": 1}


async def test_a_job_that_dies_again_has_two_deaths(api: Api, tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    job = await dead_job(api, tenant.queue_id, worker, message="first")
    assert (await api.post(f"jobs/{job}/replay", token=tenant.tokens["member"])).status == 200
    [held] = await claim(api, tenant.queue_id, worker)
    assert await fail(api, worker, held, "permanent", "second") == "dead"
    listed = await pages(api, "dead-letters", tenant.tokens["viewer"],
                         queue=str(tenant.queue_id))
    assert [(i["job_id"], i["replay_generation"], i["error_message"],
             i["replayed_at"] is None) for i in listed] == [
        (job, 1, "second", True), (job, 0, "first", False)]
    one = await api.get(f"dead-letters/{job}", token=tenant.tokens["viewer"])
    assert one.status == 200, one
    assert one.body["deaths"] == 2 and one.body["replay_generation"] == 1
    assert one.body["job_status"] == "dead_letter"
    assert [(h["generation"], h["attempt"], h["outcome"])
            for h in one.body["attempt_history"]] == [
        (0, 1, "permanent_error"), (1, 1, "permanent_error")]


async def test_list_input_and_tenancy(api: Api, tenant: Tenant) -> None:
    viewer = tenant.tokens["viewer"]
    missing = await api.get("dead-letters", token=viewer)
    assert missing.status == 400 and missing.code == "scope_required"
    for query in ({"queue": str(tenant.queue_id), "limit": 0},
                  {"queue": str(tenant.queue_id), "limit": 500},
                  {"queue": str(tenant.queue_id), "cursor": "e30"},     # {}
                  {"queue": str(tenant.queue_id), "status": "queued"},
                  {"project": "nope"}):
        assert (await api.get("dead-letters", token=viewer, query=query)).status == 400, query
    assert (await api.get("dead-letters", token=tenant.tokens["outsider"],
                          query={"project": str(tenant.project_id)})).status == 404
    assert (await api.get("dead-letters", token=viewer,
                          query={"queue": str(tenant.other_queue_id)})).status == 404
    assert (await api.get("dead-letters", query={"queue": str(tenant.queue_id)})).status == 401


async def test_one_death_ids_and_tenancy(api: Api, tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    dead = await dead_job(api, tenant.queue_id, worker)
    alive = await submit(api, tenant.queue_id)
    never = await api.get(f"dead-letters/{alive}", token=tenant.tokens["viewer"])
    assert never.status == 404 and never.code == "not_found"
    assert (await api.get(f"dead-letters/{dead}", token=tenant.tokens["outsider"])).status \
        == 404
    assert (await api.get("dead-letters/x1", token=tenant.tokens["viewer"])).status == 400
    assert (await api.get(f"dead-letters/{dead}")).status == 401


# -- POST /jobs/{job_id}/replay ------------------------------------------------------------


async def test_replay_resets_the_counters_and_keeps_the_history(api: Api,
                                                                tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    job = await dead_job(api, tenant.queue_id, worker)
    answer = await api.post(f"jobs/{job}/replay", token=tenant.tokens["member"])
    assert answer.status == 200, answer
    assert answer.body == {"id": job, "status": "queued", "replay_generation": 1}
    assert await api.sql(
        "select status::text, attempts, replay_generation from fl.jobs where id = %s",
        job) == [("queued", 0, 1)]
    assert await api.sql("select count(*), count(replayed_at) from fl.dead_letters") == [(1, 1)]
    assert await api.sql("select count(*) from fl.attempts where job_id = %s", job) == [(1,)]
    assert await api.sql("select action, entity_id, (detail->>'replay_generation')::int"
                         " from fl.audit_log") == [("job.replay", str(job), 1)]

    before = await fingerprint(api)
    again = await api.post(f"jobs/{job}/replay", token=tenant.tokens["member"])
    assert again.status == 409 and again.code == "not_dead"
    assert again.body["job_status"] == "queued"
    assert await fingerprint(api) == before


async def test_replay_honours_the_depth_cap_roles_and_tenancy(api: Api,
                                                              tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    job = await dead_job(api, tenant.queue_id, worker)
    await submit(api, tenant.queue_id)
    await api.sql("update fl.queues set max_depth = 1 where id = %s", tenant.queue_id)
    assert tenant.other_queue_id is not None
    theirs = await dead_job(api, tenant.other_queue_id,
                            await register(api, [tenant.other_queue_id]))
    before = await fingerprint(api)
    full = await api.post(f"jobs/{job}/replay", token=tenant.tokens["member"])
    assert full.status == 429 and full.code == "queue_full"
    viewer = await api.post(f"jobs/{job}/replay", token=tenant.tokens["viewer"])
    assert viewer.status == 403
    assert (await api.post(f"jobs/{job}/replay", token=tenant.tokens["outsider"])).status \
        == 404
    assert (await api.post(f"jobs/{theirs}/replay", token=tenant.tokens["owner"])).status \
        == 404
    assert (await api.post(f"jobs/{job}/replay")).status == 401
    assert (await api.post(f"jobs/{job}/replay", {"now": True},
                           token=tenant.tokens["owner"])).status == 400
    assert (await api.post(f"jobs/{2**63}/replay", token=tenant.tokens["owner"])).status \
        == 400
    assert await fingerprint(api) == before


# -- POST /queues/{queue_id}/dead-letters/replay -----------------------------------------


async def _deaths(api: Api, queue: uuid.UUID, n: int) -> list[int]:
    worker = await register(api, [queue])
    return [await dead_job(api, queue, worker) for _ in range(n)]


async def test_bulk_replay_oldest_first_then_paced_per_queue(api: Api, tenant: Tenant) -> None:
    dead = await _deaths(api, tenant.queue_id, 3)
    path = f"queues/{tenant.queue_id}/dead-letters/replay"
    first = await api.post(path, {"limit": 2}, token=tenant.tokens["member"])
    assert first.status == 200, first
    assert first.body == {"replayed": 2, "job_ids": dead[:2], "queue_full": False}
    assert await api.sql("select id, status::text, replay_generation, run_at <= now()"
                         " from fl.jobs order by id") == [
        (dead[0], "queued", 1, True), (dead[1], "queued", 1, True),
        (dead[2], "dead_letter", 0, True)]
    assert await api.sql("select action, entity_id, detail from fl.audit_log") == [
        ("job.replay_bulk", str(tenant.queue_id),
         {"replayed": 2, "limit": 2, "rate_per_sec": 0})]

    before = await fingerprint(api)
    again = await api.post(path, {}, token=tenant.tokens["member"])
    assert again.status == 429 and again.code == "rate_limited", again
    assert again.headers["Retry-After"] == "1"
    assert await fingerprint(api) == before

    # A second later (moved by hand: tests never sleep) the rest goes.
    await api.sql("update fl.bulk_replays set last_at = last_at - interval '1 second'")
    rest = await api.post(path, token=tenant.tokens["admin"])
    assert rest.body == {"replayed": 1, "job_ids": [dead[2]], "queue_full": False}
    await api.sql("update fl.bulk_replays set last_at = last_at - interval '1 second'")
    none = await api.post(path, token=tenant.tokens["admin"])
    assert none.status == 200 and none.body == {"replayed": 0, "job_ids": [],
                                                "queue_full": False}


async def test_bulk_replay_staggers_start_times(api: Api, tenant: Tenant) -> None:
    dead = await _deaths(api, tenant.queue_id, 3)
    answer = await api.post(f"queues/{tenant.queue_id}/dead-letters/replay",
                            {"rate_per_sec": 0.01}, token=tenant.tokens["member"])
    assert answer.status == 200 and answer.body["replayed"] == 3, answer
    offsets = await api.sql(
        "select id, extract(epoch from run_at - (select min(run_at) from fl.jobs))::int"
        " from fl.jobs order by id")
    assert offsets == [(dead[0], 0), (dead[1], 100), (dead[2], 200)]
    # Only the first is due: a claim now takes it and nothing else.
    worker = await register(api, [tenant.queue_id])
    assert [h[0] for h in await claim(api, tenant.queue_id, worker, 10)] == [dead[0]]


async def test_bulk_replay_fills_only_the_room_the_depth_cap_leaves(api: Api,
                                                                   tenant: Tenant) -> None:
    dead = await _deaths(api, tenant.queue_id, 3)
    await submit(api, tenant.queue_id)
    await api.sql("update fl.queues set max_depth = 2 where id = %s", tenant.queue_id)
    path = f"queues/{tenant.queue_id}/dead-letters/replay"
    some = await api.post(path, {"limit": 10}, token=tenant.tokens["member"])
    assert some.body == {"replayed": 1, "job_ids": [dead[0]], "queue_full": False}
    await api.sql("update fl.bulk_replays set last_at = last_at - interval '1 second'")
    full = await api.post(path, {"limit": 10}, token=tenant.tokens["member"])
    assert full.status == 200
    assert full.body == {"replayed": 0, "job_ids": [], "queue_full": True}
    assert await api.sql("select count(*) from fl.jobs where status = 'dead_letter'") == [(2,)]


async def test_bulk_replay_bad_input_roles_and_tenancy_change_nothing(api: Api,
                                                                      tenant: Tenant) -> None:
    await _deaths(api, tenant.queue_id, 1)
    path = f"queues/{tenant.queue_id}/dead-letters/replay"
    member = tenant.tokens["member"]
    before = await fingerprint(api)
    for body, field in [({"limit": 0}, "limit"), ({"limit": 1001}, "limit"),
                        ({"limit": "5"}, "limit"), ({"limit": 2.5}, "limit"),
                        ({"rate_per_sec": -1}, "rate_per_sec"),
                        ({"rate_per_sec": "fast"}, "rate_per_sec"),
                        ({"rate_per_sec": 1e9}, "rate_per_sec"),
                        ({"limit": None}, "limit"),
                        ({"all": True}, "all"), ([], "body")]:
        answer = await api.post(path, body, token=member)
        assert answer.status == 400, (body, answer)
        assert answer.body["field"] == field, (body, answer)
    slow = await api.post(path, {"rate_per_sec": 0.0001}, token=member)
    assert slow.status == 400 and slow.code == "invalid_input", slow
    assert (await api.post(path, {}, token=tenant.tokens["viewer"])).status == 403
    assert (await api.post(path, {}, token=tenant.tokens["outsider"])).status == 404
    assert (await api.post(f"queues/{tenant.other_queue_id}/dead-letters/replay", {},
                           token=tenant.tokens["owner"])).status == 404
    assert (await api.post(f"queues/{uuid.uuid4()}/dead-letters/replay", {},
                           token=tenant.tokens["owner"])).status == 404
    assert (await api.post("queues/42/dead-letters/replay", {}, token=member)).status == 400
    assert (await api.post(path, {})).status == 401
    assert await fingerprint(api) == before


def test_two_bulk_replays_at_once_one_waits_and_is_refused(dsn: str) -> None:
    """The pace gate holds under concurrency: the second call waits for the first's row lock,
    then sees its time and is refused; only the first replays anything."""
    import threading
    import time

    import psycopg

    with psycopg.connect(dsn, autocommit=True) as setup:
        [org] = setup.execute("insert into fl.organizations (name) values ('o') returning id"
                              ).fetchone() or ()
        [project] = setup.execute("insert into fl.projects (org_id, name) values (%s, 'p')"
                                  " returning id", (org,)).fetchone() or ()
        [policy] = setup.execute("insert into fl.retry_policies (project_id, name)"
                                 " values (%s, 'd') returning id", (project,)).fetchone() or ()
        [queue] = setup.execute("insert into fl.queues (project_id, name, retry_policy_id)"
                                " values (%s, 'q', %s) returning id", (project, policy)
                                ).fetchone() or ()
        [worker] = setup.execute("select fl.register_worker(array[%s]::uuid[], null, 'h', 1, 4)",
                                 (queue,)).fetchone() or ()
        for _ in range(2):
            setup.execute("select fl.submit(%s, 't')", (queue,))
        for job, fence in setup.execute(
                "select job_id, fence from fl.claim(%s, %s, null, 2, '30 s'::interval)",
                (queue, worker)).fetchall():
            setup.execute("select fl.fail(%s, %s, %s, 'permanent')", (worker, job, fence))

        call = "select outcome from fl.replay_dead_paced(%s, 1, 0, '1 second'::interval)"
        first = psycopg.connect(dsn)
        second = psycopg.connect(dsn, autocommit=True)
        try:
            assert first.execute(call, (queue,)).fetchall() == [("ok",)]
            got: list[object] = []
            thread = threading.Thread(
                target=lambda: got.extend(second.execute(call, (queue,)).fetchall()))
            thread.start()
            for _ in range(500):      # until the second call waits on the first's row lock
                if setup.execute("select count(*) from pg_locks where not granted"
                                 ).fetchone() == (1,):
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("the second call never waited")
            assert got == []
            first.commit()
            thread.join(10)
            assert got == [("rate_limited",)]
        finally:
            first.close()
            second.close()
        assert setup.execute("select count(*) from fl.jobs where status = 'queued'"
                             ).fetchone() == (1,)
