"""GET /projects/{id}/events: the outbox by position, oldest first, never skipping a late commit."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import trio

from fenceline.api import events
from fenceline.api.events import Position, decode
from fenceline.db.connection import connect
from tests.api.conftest import Api, Tenant


def path(project: Any) -> str:
    return f"projects/{project}/events"


async def submit(api: Api, queue: uuid.UUID, kind: str = "t") -> int:
    [(job,)] = await api.sql("select job_id from fl.submit(%s, %s, '{}')", queue, kind)
    return int(job)


async def event_ids(api: Api, project: uuid.UUID) -> list[int]:
    """Every event of ``project`` in the order a reader must see them."""
    rows = await api.sql("select id from fl.events where project_id = %s order by txid, id",
                         project)
    return [r[0] for r in rows]


async def read_all(api: Api, project: uuid.UUID, token: str, after: str | None = None,
                   limit: int = 100) -> tuple[list[dict[str, Any]], str]:
    """Page until an empty page; the events and the final cursor."""
    items: list[dict[str, Any]] = []
    while True:
        query: dict[str, Any] = {"limit": limit}
        if after is not None:
            query["after"] = after
        answer = await api.get(path(project), token=token, query=query)
        assert answer.status == 200, answer
        if not answer.body["items"]:
            assert answer.body["next"] == after or after in (None, "tail")
            return items, answer.body["next"]
        items += answer.body["items"]
        after = answer.body["next"]


async def wait_for(api: Api, project: uuid.UUID, token: str, after: str, count: int,
                   ) -> tuple[list[dict[str, Any]], str]:
    """Read from ``after`` until ``count`` events came: another test's open transaction on
    the same server holds the readable horizon back for a moment, never forever."""
    got: list[dict[str, Any]] = []
    with trio.fail_after(20):
        while len(got) < count:
            more, after = await read_all(api, project, token, after)
            got += more
            if len(got) < count:
                await trio.sleep(0.05)
    return got, after


async def test_events_come_oldest_first_with_a_next_cursor(api: Api, tenant: Tenant) -> None:
    jobs = [await submit(api, tenant.queue_id, f"t{i}") for i in range(5)]
    ids = await event_ids(api, tenant.project_id)
    items, _ = await wait_for(api, tenant.project_id, tenant.tokens["viewer"],
                              Position(0, 0).encode(), 5)
    assert [e["id"] for e in items] == ids
    assert [e["job_id"] for e in items] == jobs
    assert {e["topic"] for e in items} == {"job.submitted"}
    first = items[0]
    assert set(first) == {"id", "topic", "queue_id", "job_id", "payload", "created_at"}
    assert first["queue_id"] == str(tenant.queue_id)
    assert first["payload"]["type"] == "t0" and first["payload"]["status"] == "queued"
    assert first["created_at"].endswith("Z")

    # Paging two at a time gives the same sequence; each next resumes exactly there.
    pages: list[list[int]] = []
    after: str | None = None
    for _ in range(4):
        query: dict[str, Any] = {"limit": 2} | ({"after": after} if after else {})
        answer = await api.get(path(tenant.project_id), token=tenant.tokens["viewer"],
                               query=query)
        assert answer.status == 200
        pages.append([e["id"] for e in answer.body["items"]])
        assert answer.body["next"] != after or not answer.body["items"]
        after = answer.body["next"]
    assert pages == [ids[0:2], ids[2:4], ids[4:5], []]
    # Nothing new: next comes back unchanged.
    again = await api.get(path(tenant.project_id), token=tenant.tokens["viewer"],
                          query={"after": after})
    assert again.status == 200 and again.body == {"items": [], "next": after}


async def test_other_projects_events_are_not_listed(api: Api, tenant: Tenant) -> None:
    await submit(api, tenant.other_queue_id)  # type: ignore[arg-type]
    mine = await submit(api, tenant.queue_id)
    items, _ = await wait_for(api, tenant.project_id, tenant.tokens["viewer"],
                              Position(0, 0).encode(), 1)
    assert [e["job_id"] for e in items] == [mine]


async def test_hot_path_events_list_their_jobs_as_written(api: Api, tenant: Tenant) -> None:
    jobs = [await submit(api, tenant.queue_id) for _ in range(3)]
    [(worker,)] = await api.sql("select fl.register_worker(%s, null, 'h', 1, 4)",
                                [tenant.queue_id])
    claimed = await api.sql("select job_id, fence from fl.claim(%s, %s, null, 3, '30 seconds')",
                            tenant.queue_id, worker)
    assert sorted(r[0] for r in claimed) == jobs
    items, _ = await wait_for(api, tenant.project_id, tenant.tokens["member"],
                              Position(0, 0).encode(), 4)
    [claim] = [e for e in items if e["topic"] == "jobs.claimed"]
    [(payload,)] = await api.sql("select payload from fl.events where topic = 'jobs.claimed'")
    assert claim["payload"] == payload          # one event, the jobs listed as written
    assert sorted(j[0] for j in claim["payload"]["jobs"]) == jobs
    assert claim["job_id"] is None


async def test_tail_starts_at_the_current_end(api: Api, tenant: Tenant) -> None:
    await submit(api, tenant.queue_id)
    await submit(api, tenant.queue_id)
    start = await api.get(path(tenant.project_id), token=tenant.tokens["viewer"],
                          query={"after": "tail"})
    assert start.status == 200 and start.body["items"] == []
    late = await submit(api, tenant.queue_id)
    items, _ = await wait_for(api, tenant.project_id, tenant.tokens["viewer"],
                              start.body["next"], 1)
    assert [e["job_id"] for e in items] == [late]
    # Without after: from the oldest.
    answer = await api.get(path(tenant.project_id), token=tenant.tokens["viewer"])
    assert answer.status == 200 and len(answer.body["items"]) == 3


async def test_a_late_commit_is_never_skipped(api: Api, tenant: Tenant, dsn: str) -> None:
    """A inserts first and stays open; B inserts later and commits first. B must wait for A."""
    token = tenant.tokens["viewer"]
    _, cursor = await read_all(api, tenant.project_id, token, "tail")
    async with await connect(dsn) as conn_a:
        await conn_a.execute("begin")
        cur = await conn_a.execute("select job_id from fl.submit(%s, 'a', '{}')",
                                   (tenant.queue_id,))
        [(job_a,)] = await cur.fetchall()
        job_b = await submit(api, tenant.queue_id, "b")     # commits now
        cur = await conn_a.execute("select id from fl.events where job_id = %s", (job_a,))
        [(id_a,)] = await cur.fetchall()
        [(id_b,)] = await api.sql("select id from fl.events where job_id = %s", job_b)
        assert id_a < id_b      # A took its id first; B commits first
        # B is committed and visible, but A (a lower txid) is still running: nothing yet,
        # however often we ask, and the cursor stays where it was.
        for _ in range(3):
            items, after = await read_all(api, tenant.project_id, token, cursor)
            assert items == [] and after == cursor
        # ...and a reader can tell that something committed is waiting (the stream then
        # looks again soon rather than at the next poll).
        page = await events.read(api.conn, tenant.project_id, decode(cursor), 100)
        assert page.events == [] and page.pending
        await conn_a.execute("commit")
    items, last = await wait_for(api, tenant.project_id, token, cursor, 2)
    assert [(e["id"], e["job_id"]) for e in items] == [(id_a, job_a), (id_b, job_b)]
    assert not (await events.read(api.conn, tenant.project_id, decode(last), 100)).pending


async def test_bad_query_is_refused(api: Api, tenant: Tenant) -> None:
    token = tenant.tokens["viewer"]
    await submit(api, tenant.queue_id)
    b64 = base64.urlsafe_b64encode
    bad_cursors = ["", "x", "!!!!", "null", b64(b"[1]").decode(), b64(b"[1,2,3]").decode(),
                   b64(b"[-1,0]").decode(), b64(b"[1,-1]").decode(),
                   b64(b'["1",2]').decode(), b64(b"[1.5,2]").decode(),
                   b64(b"[true,2]").decode(), b64(b"[18446744073709551616,0]").decode(),
                   b64(b"[0,9223372036854775808]").decode(), b64(b"{}").decode(), "TAIL",
                   "\u00e9t\u00e9"]
    for raw in bad_cursors:
        answer = await api.get(path(tenant.project_id), token=token, query={"after": raw})
        assert answer.status == 400, raw
        assert answer.code == ("invalid_input" if raw == "" else "invalid_cursor"), (raw, answer)
    for limit in ("0", "101", "-1", "x", "1.5"):
        answer = await api.get(path(tenant.project_id), token=token, query={"limit": limit})
        assert (answer.status, answer.code) == (400, "invalid_input"), limit
    answer = await api.get(path(tenant.project_id), token=token, query={"cursor": "x"})
    assert (answer.status, answer.code) == (400, "invalid_input")
    answer = await api.get(path(tenant.project_id), token=token, query={"from": "tail"})
    assert (answer.status, answer.code) == (400, "invalid_input")
    answer = await api.get(path("not-a-uuid"), token=token)
    assert (answer.status, answer.code) == (400, "invalid_input")
    assert (await api.get(path(tenant.project_id), token=token,
                          query={"limit": "100"})).status == 200


def test_cursor_round_trip() -> None:
    for pos in (Position(0, 0), Position(2**64 - 1, 2**63 - 1), Position(748, 12)):
        assert decode(pos.encode()) == pos


async def test_who_may_read(api: Api, tenant: Tenant) -> None:
    await submit(api, tenant.queue_id)
    for role in ("owner", "admin", "member", "viewer"):
        answer = await api.get(path(tenant.project_id), token=tenant.tokens[role])
        assert answer.status == 200, role
    outsider = await api.get(path(tenant.project_id), token=tenant.tokens["outsider"])
    assert (outsider.status, outsider.code) == (404, "not_found")
    foreign = await api.get(path(tenant.other_project_id), token=tenant.tokens["owner"])
    assert (foreign.status, foreign.code) == (404, "not_found")
    missing = await api.get(path(uuid.uuid4()), token=tenant.tokens["owner"])
    assert (missing.status, missing.code) == (404, "not_found")
    anonymous = await api.get(path(tenant.project_id))
    assert (anonymous.status, anonymous.code) == (401, "unauthenticated")
    await api.sql("delete from fl.org_members where user_id = %s", tenant.users["viewer"])
    removed = await api.get(path(tenant.project_id), token=tenant.tokens["viewer"])
    assert (removed.status, removed.code) == (404, "not_found")


async def test_a_cursor_behind_retention_is_gone_with_the_oldest_cursor(
        api: Api, tenant: Tenant) -> None:
    token = tenant.tokens["viewer"]
    for _ in range(4):
        await submit(api, tenant.queue_id)
    items, _ = await wait_for(api, tenant.project_id, token, Position(0, 0).encode(), 4)
    rows = await api.sql("select txid::text, id from fl.events where project_id = %s"
                         " order by txid, id", tenant.project_id)
    positions = [Position(int(t), i) for t, i in rows]
    assert [p.id for p in positions] == [e["id"] for e in items]
    # A retention pass (fl.prune_events, 0013) eight days on drops the first two events and
    # records the last one it dropped.
    await api.sql("select set_config('fl.testing', 'on', false),"
                  " set_config('fl.now', (now() + interval '8 days')::text, false)")
    assert await api.sql("select fl.prune_events(2, interval '7 days')") == [(2,)]
    assert await api.sql("select txid::text, id from fl.events_retention where project_id = %s",
                         tenant.project_id) == [(str(positions[1].txid), positions[1].id)]
    oldest = positions[1].encode()

    for after in (Position(0, 0).encode(), None):
        query = {"after": after} if after else {}
        answer = await api.get(path(tenant.project_id), token=token, query=query)
        if after is None:                 # no cursor: starts at the oldest retained event
            assert answer.status == 200
            assert [e["id"] for e in answer.body["items"]] == [e["id"] for e in items[2:]]
        else:
            assert (answer.status, answer.code) == (410, "cursor_too_old")
            assert answer.body["oldest"] == oldest
    # Positioned exactly at the last dropped event: nothing was missed, no 410.
    resumed = await api.get(path(tenant.project_id), token=token, query={"after": oldest})
    assert resumed.status == 200
    assert [e["id"] for e in resumed.body["items"]] == [e["id"] for e in items[2:]]
    # One that had seen only the first event missed the second: gone.
    behind = await api.get(path(tenant.project_id), token=token,
                           query={"after": positions[0].encode()})
    assert (behind.status, behind.code) == (410, "cursor_too_old")
    assert behind.body["oldest"] == oldest
