"""Jobs over HTTP: list (keyset pages), one job's view, cancel and retry.

Jobs are made and moved with the engine's own SQL functions (fl.submit, fl.claim, fl.fail,
fl.complete), as a producer and a worker would; the HTTP answers are checked against them.
"""

from __future__ import annotations

import uuid
from typing import Any

from tests.api.conftest import Api, Tenant

# -- helpers shared by the job, dead-letter and worker tests -----------------------------------


async def submit(api: Api, queue: uuid.UUID, job_type: str = "t", **kw: Any) -> int:
    args = ", ".join(f"p_{k} => %s" for k in kw)
    rows = await api.sql(
        f"select outcome, job_id from fl.submit(%s, %s, '{{}}'::jsonb{', ' if kw else ''}{args})",
        queue, job_type, *kw.values())
    assert rows[0][0] == "ok", rows
    return int(rows[0][1])


async def register(api: Api, queues: list[uuid.UUID], concurrency: int = 8) -> uuid.UUID:
    [(worker,)] = await api.sql(
        "select fl.register_worker(%s::uuid[], null, 'box-1', 4242, %s)", queues, concurrency)
    return worker  # type: ignore[no-any-return]


async def claim(api: Api, queue: uuid.UUID, worker: uuid.UUID, n: int = 1,
                ) -> list[tuple[int, int]]:
    rows = await api.sql(
        "select job_id, fence from fl.claim(%s, %s, null, %s, '30 seconds'::interval)"
        " where outcome = 'ok'", queue, worker, n)
    return [(int(r[0]), int(r[1])) for r in rows]


async def fail(api: Api, worker: uuid.UUID, held: tuple[int, int], kind: str = "retryable",
               message: str = "boom", error_class: str | None = "Boom") -> str:
    [(outcome,)] = await api.sql("select outcome from fl.fail(%s, %s, %s, %s, %s, %s)",
                                 worker, held[0], held[1], kind, message, error_class)
    return str(outcome)


async def complete(api: Api, worker: uuid.UUID, held: tuple[int, int]) -> None:
    rows = await api.sql(
        "select outcome from fl.complete(%s, array[%s]::bigint[], array[%s]::bigint[],"
        " array['{\"ok\": true}'::jsonb])", worker, held[0], held[1])
    assert rows == [("ok",)]


async def dead_job(api: Api, queue: uuid.UUID, worker: uuid.UUID, job_type: str = "t",
                   message: str = "broken") -> int:
    """A job submitted, claimed and failed permanently: in the dead letter queue."""
    job = await submit(api, queue, job_type)
    [held] = [h for h in await claim(api, queue, worker, 10) if h[0] == job]
    assert await fail(api, worker, held, "permanent", message) == "dead"
    return job


async def fingerprint(api: Api) -> tuple[Any, ...]:
    """Every row a job endpoint could change, hashed: equal before and after = nothing changed."""
    out = []
    for table in ("jobs", "attempts", "leases", "dead_letters", "events", "audit_log",
                  "bulk_replays"):
        out.append((await api.sql(
            f"select count(*), md5(coalesce(string_agg(t::text, '|' order by t::text), ''))"
            f" from fl.{table} t"))[0])
    return tuple(out)


async def pages(api: Api, path: str, token: str, **query: Any) -> list[dict[str, Any]]:
    """Every item of a paged list, following next_cursor to the end."""
    items: list[dict[str, Any]] = []
    cursor = None
    for _ in range(100):
        q = dict(query) | ({"cursor": cursor} if cursor else {})
        answer = await api.get(path, token=token, query=q)
        assert answer.status == 200, answer
        assert len(answer.body["items"]) <= int(query.get("limit", 50))
        items += answer.body["items"]
        cursor = answer.body["next_cursor"]
        if cursor is None:
            return items
    raise AssertionError("paging did not end")


async def second_queue(api: Api, tenant: Tenant, name: str = "other") -> uuid.UUID:
    [(queue,)] = await api.sql(
        "insert into fl.queues (project_id, name, retry_policy_id) values (%s, %s, %s)"
        " returning id", tenant.project_id, name, tenant.policy_id)
    return queue  # type: ignore[no-any-return]


# -- GET /jobs -------------------------------------------------------------------------------


async def test_list_pages_newest_first_without_duplicates_or_gaps(api: Api,
                                                                  tenant: Tenant) -> None:
    other = await second_queue(api, tenant)
    mine = [await submit(api, tenant.queue_id) for _ in range(7)]
    theirs = [await submit(api, other) for _ in range(3)]
    assert tenant.other_queue_id is not None
    await submit(api, tenant.other_queue_id)          # another organization's
    viewer = tenant.tokens["viewer"]

    by_queue = await pages(api, "jobs", viewer, queue=str(tenant.queue_id), limit=3)
    assert [i["id"] for i in by_queue] == sorted(mine, reverse=True)
    by_project = await pages(api, "jobs", viewer, project=str(tenant.project_id), limit=4)
    assert [i["id"] for i in by_project] == sorted(mine + theirs, reverse=True)
    # An exact multiple of the page size ends with next_cursor null, not an empty page.
    first = await api.get("jobs", token=viewer, query={"queue": str(tenant.queue_id),
                                                       "limit": 7})
    assert len(first.body["items"]) == 7 and first.body["next_cursor"] is None

    item = by_queue[0]
    assert set(item) == {"id", "queue_id", "type", "status", "priority", "attempts",
                         "replay_generation", "run_at", "created_at", "finished_at",
                         "batch_id"}
    assert item["queue_id"] == str(tenant.queue_id) and item["status"] == "queued"
    assert item["attempts"] == 0 and item["finished_at"] is None


async def test_list_filters_by_status_and_type(api: Api, tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    a = await submit(api, tenant.queue_id, "email")
    b = await submit(api, tenant.queue_id, "email")
    c = await submit(api, tenant.queue_id, "sms")
    held = await claim(api, tenant.queue_id, worker, 3)
    await complete(api, worker, next(h for h in held if h[0] == a))
    viewer = tenant.tokens["viewer"]
    q = str(tenant.queue_id)

    done = await pages(api, "jobs", viewer, queue=q, status="completed")
    assert [(i["id"], i["status"]) for i in done] == [(a, "completed")]
    assert done[0]["finished_at"] is not None and done[0]["attempts"] == 1
    running = await pages(api, "jobs", viewer, project=str(tenant.project_id),
                          status="running", limit=1)
    assert [i["id"] for i in running] == [c, b]
    emails = await pages(api, "jobs", viewer, queue=q, type="email")
    assert [i["id"] for i in emails] == [b, a]
    assert await pages(api, "jobs", viewer, queue=q, type="sms", status="completed") == []


async def test_list_needs_a_scope_and_valid_input(api: Api, tenant: Tenant) -> None:
    viewer = tenant.tokens["viewer"]
    q = str(tenant.queue_id)
    missing = await api.get("jobs", token=viewer)
    assert missing.status == 400 and missing.code == "scope_required"
    for query, field in [({"queue": q, "status": "claimed"}, "status"),
                         ({"queue": q, "limit": 0}, "limit"),
                         ({"queue": q, "limit": 101}, "limit"),
                         ({"queue": q, "limit": "ten"}, "limit"),
                         ({"queue": "not-a-uuid"}, "queue"),
                         ({"project": "42"}, "project"),
                         ({"queue": q, "sort": "id"}, "sort"),
                         ({"queue": q, "type": ""}, "type"),
                         ({"queue": q, "cursor": "!!!"}, "cursor"),
                         ({"queue": q, "project": str(tenant.other_project_id)}, "queue")]:
        answer = await api.get("jobs", token=viewer, query=query)
        assert answer.status == 400, (query, answer)
        assert answer.body["field"] == field, (query, answer)
    # A cursor of another list (a worker id) is not a job cursor.
    wrong = await api.get("jobs", token=viewer, query={
        "queue": q, "cursor": "WyIwMTkzIl0"})           # ["0193"]
    assert wrong.status == 400 and wrong.code == "invalid_cursor"


async def test_list_is_only_for_the_projects_viewers(api: Api, tenant: Tenant) -> None:
    await submit(api, tenant.queue_id)
    q = {"queue": str(tenant.queue_id)}
    outsider = await api.get("jobs", token=tenant.tokens["outsider"], query=q)
    assert outsider.status == 404 and outsider.code == "not_found"
    outsider_p = await api.get("jobs", token=tenant.tokens["outsider"],
                               query={"project": str(tenant.project_id)})
    assert outsider_p.status == 404
    theirs = await api.get("jobs", token=tenant.tokens["owner"],
                           query={"queue": str(tenant.other_queue_id)})
    assert theirs.status == 404
    unknown = await api.get("jobs", token=tenant.tokens["owner"],
                            query={"project": str(uuid.uuid4())})
    assert unknown.status == 404
    anonymous = await api.get("jobs", query=q)
    assert anonymous.status == 401 and anonymous.code == "unauthenticated"


async def test_the_list_reads_the_jobs_list_index(api: Api, tenant: Tenant) -> None:
    # Many projects' jobs in one table, most of them finished: the shape the list must not scan.
    await api.sql("select fl.submit(%s, 't', '{}') from generate_series(1, 3000)",
                  tenant.other_queue_id)
    await api.sql("select fl.submit(%s, 't', '{}') from generate_series(1, 200)",
                  tenant.queue_id)
    await api.sql("select fl.cancel(id) from fl.jobs where id %% 3 = 0")
    await api.sql("analyze fl.jobs")
    from fenceline.api.jobs import LIST_SQL, STATUSES
    for queue, statuses in ((None, list(STATUSES)), (tenant.queue_id, ["completed"])):
        cur = await api.conn.execute(
            "explain " + LIST_SQL,
            {"statuses": statuses, "after": 2**63 - 1, "type": None, "n": 51,
             "project": tenant.project_id, "queue": queue})
        plan = "\n".join(r[0] for r in await cur.fetchall())
        assert "jobs_list" in plan, plan
        assert "Seq Scan on jobs" not in plan, plan


# -- GET /jobs/{job_id} ----------------------------------------------------------------------


async def test_job_view_has_attempts_logs_and_the_lease_while_running(api: Api,
                                                                      tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    job = await submit(api, tenant.queue_id, "email", priority=3)
    [first] = await claim(api, tenant.queue_id, worker)
    await api.sql("select fl.append_logs(%s, %s, %s, array['info', 'warn'],"
                  " array['rendering', 'slow smtp'])", worker, *first)
    assert await fail(api, worker, first, "retryable", "smtp down", "SmtpError") == "retry"
    await api.sql("update fl.jobs set run_at = now() - interval '1 second' where id = %s", job)
    [second] = await claim(api, tenant.queue_id, worker)
    await api.sql("update fl.leases set progress = '{\"done\": 0.5}' where job_id = %s", job)

    view = await api.get(f"jobs/{job}", token=tenant.tokens["viewer"])
    assert view.status == 200, view
    body = view.body
    assert body["job"]["id"] == job and body["job"]["status"] == "running"
    assert body["job"]["payload"] == {} and body["job"]["priority"] == 3
    assert body["job"]["fence"] == second[1] and body["job"]["attempts"] == 2
    assert body["job"]["project_id"] == str(tenant.project_id)
    a1, a2 = body["attempts"]
    assert (a1["attempt"], a1["fence"], a1["outcome"]) == (1, first[1], "retryable_error")
    assert (a1["error_class"], a1["error_message"]) == ("SmtpError", "smtp down")
    assert a1["worker_id"] == str(worker) and a1["duration_ms"] is not None
    assert [(g["level"], g["message"]) for g in a1["logs"]] == [
        ("info", "rendering"), ("warn", "slow smtp")]
    assert (a2["attempt"], a2["outcome"], a2["finished_at"], a2["duration_ms"]) == (
        2, None, None, None)
    assert a2["logs"] == []
    assert body["lease"]["progress"] == {"done": 0.5}
    assert body["lease"]["fence"] == second[1] and body["lease"]["worker_id"] == str(worker)
    assert body["parents"] == [] and body["children"] == []

    await complete(api, worker, second)
    done = (await api.get(f"jobs/{job}", token=tenant.tokens["viewer"])).body
    assert "lease" not in done and done["job"]["status"] == "completed"
    assert done["attempts"][1]["outcome"] == "success"
    assert done["attempts"][1]["result"] == {"ok": True}


async def test_job_view_lists_parents_and_children_of_the_same_project(
        api: Api, tenant: Tenant) -> None:
    parent = await submit(api, tenant.queue_id, "p")
    child = await submit(api, tenant.queue_id, "c", run_at="2999-01-01T00:00:00Z")
    assert tenant.other_queue_id is not None
    foreign = await submit(api, tenant.other_queue_id, "x")
    await api.sql("insert into fl.job_dependencies (child_id, parent_id) values (%s, %s),"
                  " (%s, %s)", child, parent, child, foreign)
    viewer = tenant.tokens["viewer"]
    kid = (await api.get(f"jobs/{child}", token=viewer)).body
    assert kid["parents"] == [{"id": parent, "type": "p", "status": "queued"}]   # not foreign
    mom = (await api.get(f"jobs/{parent}", token=viewer)).body
    assert mom["children"] == [{"id": child, "type": "c", "status": "scheduled"}]
    assert mom["parents"] == []


async def test_job_view_ids_and_tenancy(api: Api, tenant: Tenant) -> None:
    job = await submit(api, tenant.queue_id)
    assert tenant.other_queue_id is not None
    theirs = await submit(api, tenant.other_queue_id)
    for bad in ("abc", "0", "-1", str(2**63), "1.5", "1e3"):
        answer = await api.get(f"jobs/{bad}", token=tenant.tokens["viewer"])
        assert answer.status == 400 and answer.body["field"] == "job_id", (bad, answer)
    assert (await api.get(f"jobs/{theirs}", token=tenant.tokens["viewer"])).status == 404
    assert (await api.get(f"jobs/{job}", token=tenant.tokens["outsider"])).status == 404
    assert (await api.get(f"jobs/{job + 1000}", token=tenant.tokens["owner"])).status == 404
    assert (await api.get(f"jobs/{job}")).status == 401
    assert (await api.get(f"jobs/{job}", query={"x": 1},
                          token=tenant.tokens["viewer"])).status == 400


# -- cancel ----------------------------------------------------------------------------------


async def test_cancel_a_waiting_job_then_again(api: Api, tenant: Tenant) -> None:
    job = await submit(api, tenant.queue_id)
    answer = await api.post(f"jobs/{job}/cancel", token=tenant.tokens["member"])
    assert answer.status == 200, answer
    assert answer.body == {"id": job, "status": "cancelled", "from": "queued"}
    assert await api.sql("select status::text, finished_at is not null from fl.jobs"
                         " where id = %s", job) == [("cancelled", True)]
    audit = await api.sql("select action, entity, entity_id, detail->>'from', actor_user"
                          " from fl.audit_log")
    assert audit == [("job.cancel", "job", str(job), "queued", tenant.users["member"])]

    before = await fingerprint(api)
    again = await api.post(f"jobs/{job}/cancel", token=tenant.tokens["member"])
    assert again.status == 409 and again.code == "already_terminal"
    assert again.body["job_status"] == "cancelled"
    assert await fingerprint(api) == before


async def test_cancel_of_a_scheduled_job_and_one_waiting_on_parents(api: Api,
                                                                   tenant: Tenant) -> None:
    later = await submit(api, tenant.queue_id, run_at="2999-01-01T00:00:00Z")
    answer = await api.post(f"jobs/{later}/cancel", token=tenant.tokens["member"])
    assert answer.body == {"id": later, "status": "cancelled", "from": "scheduled"}
    # Reference W1: a job waiting on parents could not be cancelled (500). Here it can, and
    # it no longer counts parents.
    waiting = await submit(api, tenant.queue_id, run_at="2999-01-01T00:00:00Z")
    await api.sql("update fl.jobs set pending_deps = 2 where id = %s", waiting)
    answer = await api.post(f"jobs/{waiting}/cancel", token=tenant.tokens["member"])
    assert answer.status == 200, answer
    assert await api.sql("select status::text, pending_deps from fl.jobs where id = %s",
                         waiting) == [("cancelled", 0)]


async def test_cancel_of_a_running_job_asks_its_worker(api: Api, tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    job = await submit(api, tenant.queue_id)
    [held] = await claim(api, tenant.queue_id, worker)
    answer = await api.post(f"jobs/{job}/cancel", token=tenant.tokens["admin"])
    assert answer.status == 202, answer
    assert answer.body == {"id": job, "status": "running", "cancel_requested": True}
    assert await api.sql("select status::text, cancel_requested_at is not null from fl.jobs"
                         " where id = %s", job) == [("running", True)]
    again = await api.post(f"jobs/{job}/cancel", token=tenant.tokens["admin"])
    assert again.status == 202
    # The worker's report then ends it cancelled; a third cancel is a conflict.
    assert await fail(api, worker, held) == "cancelled"
    third = await api.post(f"jobs/{job}/cancel", token=tenant.tokens["admin"])
    assert third.status == 409 and third.body["job_status"] == "cancelled"
    assert await api.sql("select detail->>'outcome' from fl.audit_log order by id") == [
        ("cancel_requested",), ("cancel_requested",)]


async def test_cancel_of_finished_jobs_is_a_conflict(api: Api, tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    done = await submit(api, tenant.queue_id)
    [held] = await claim(api, tenant.queue_id, worker)
    await complete(api, worker, held)
    dead = await dead_job(api, tenant.queue_id, worker)
    before = await fingerprint(api)
    for job, status in ((done, "completed"), (dead, "dead_letter")):
        answer = await api.post(f"jobs/{job}/cancel", token=tenant.tokens["member"])
        assert answer.status == 409 and answer.code == "already_terminal", answer
        assert answer.body["job_status"] == status
    assert await fingerprint(api) == before


async def test_cancel_needs_a_member_and_changes_nothing_otherwise(api: Api,
                                                                   tenant: Tenant) -> None:
    job = await submit(api, tenant.queue_id)
    assert tenant.other_queue_id is not None
    theirs = await submit(api, tenant.other_queue_id)
    before = await fingerprint(api)
    viewer = await api.post(f"jobs/{job}/cancel", token=tenant.tokens["viewer"])
    assert viewer.status == 403 and viewer.code == "forbidden"
    assert (await api.post(f"jobs/{job}/cancel", token=tenant.tokens["outsider"])).status == 404
    assert (await api.post(f"jobs/{theirs}/cancel", token=tenant.tokens["owner"])).status == 404
    assert (await api.post(f"jobs/{job}/cancel")).status == 401
    assert (await api.post("jobs/abc/cancel", token=tenant.tokens["owner"])).status == 400
    body = await api.post(f"jobs/{job}/cancel", {"force": True}, token=tenant.tokens["owner"])
    assert body.status == 400 and body.code == "invalid_input"
    assert await fingerprint(api) == before


# -- retry -----------------------------------------------------------------------------------


async def test_retry_runs_a_waiting_job_now(api: Api, tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    job = await submit(api, tenant.queue_id)
    [held] = await claim(api, tenant.queue_id, worker)
    assert await fail(api, worker, held) == "retry"
    answer = await api.post(f"jobs/{job}/retry", token=tenant.tokens["member"])
    assert answer.status == 200, answer
    assert answer.body == {"id": job, "status": "queued", "from": "retry_wait"}
    assert await api.sql("select status::text, run_at <= now() from fl.jobs where id = %s",
                         job) == [("queued", True)]
    assert await api.sql("select action, detail->>'from' from fl.audit_log") == [
        ("job.retry", "retry_wait")]
    later = await submit(api, tenant.queue_id, run_at="2999-01-01T00:00:00Z")
    answer = await api.post(f"jobs/{later}/retry", token=tenant.tokens["member"])
    assert answer.body == {"id": later, "status": "queued", "from": "scheduled"}


async def test_retry_refuses_jobs_not_waiting_to_retry(api: Api, tenant: Tenant) -> None:
    worker = await register(api, [tenant.queue_id])
    dead = await dead_job(api, tenant.queue_id, worker)
    queued = await submit(api, tenant.queue_id)
    blocked = await submit(api, tenant.queue_id, run_at="2999-01-01T00:00:00Z")
    await api.sql("update fl.jobs set pending_deps = 1 where id = %s", blocked)
    before = await fingerprint(api)
    for job, status in ((dead, "dead_letter"), (queued, "queued"), (blocked, "scheduled")):
        answer = await api.post(f"jobs/{job}/retry", token=tenant.tokens["member"])
        assert answer.status == 409 and answer.code == "not_retryable", answer
        assert answer.body["job_status"] == status
    viewer = await api.post(f"jobs/{queued}/retry", token=tenant.tokens["viewer"])
    assert viewer.status == 403
    assert (await api.post(f"jobs/{queued}/retry", token=tenant.tokens["outsider"])).status \
        == 404
    assert (await api.post(f"jobs/{queued}/retry")).status == 401
    assert (await api.post("jobs/0/retry", token=tenant.tokens["member"])).status == 400
    assert await fingerprint(api) == before
