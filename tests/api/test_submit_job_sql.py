"""fl.submit_job's direct path (migrations/0010) against fl._submit_jobs, which it used to
call for every job: the same answers, rows and events, the same errors in the same order; and
fl.submit, a front of that path since 0012, against fl.submit_job."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import psycopg

from fenceline.db.connection import TrioConnection
from tests.api.conftest import Api, Tenant
from tests.conftest import Clock

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _cases(policy: uuid.UUID, foreign_policy: uuid.UUID) -> list[dict[str, Any]]:
    """Arguments of fl.submit_job without parents or key, each answered some way."""
    return [
        {"type": "t"},
        {"type": "t", "payload": {"a": [1, 2, {"b": None}]}, "priority": -7},
        {"type": "t", "payload": "just a string", "timeout_ms": 5, "retry_policy": policy},
        {"type": "t", "payload": 12.5, "delay_ms": 0},
        {"type": "t", "delay_ms": 1500},
        {"type": "t", "run_at": NOW - dt.timedelta(days=1)},
        {"type": "t", "run_at": NOW + dt.timedelta(seconds=1)},
        {"type": "t", "run_at": NOW},
        {"type": "x" * 200, "payload": []},
        {"type": " padded "},
        {"type": "t", "depends_on": []},
        # refused (FL codes), in fl._submit_jobs's order when several apply
        {"type": ""},
        {"type": "x" * 201},
        {"type": None},
        {"type": "t", "payload": None},
        {"type": "t", "payload": "null"},
        {"type": "", "payload": "null"},
        {"type": "t", "payload": {"big": "x" * 262_200}},
        {"type": "t", "timeout_ms": 0},
        {"type": "t", "timeout_ms": -5, "delay_ms": -1},
        {"type": "t", "delay_ms": -1},
        {"type": "t", "delay_ms": 315_360_000_001},
        {"type": "t", "delay_ms": 315_360_000_000},
        {"type": "t", "run_at": "infinity"},
        {"type": "t", "run_at": "-infinity", "delay_ms": 5},
        {"type": "t", "run_at": NOW, "delay_ms": 5},
        {"type": "t", "retry_policy": foreign_policy},
        {"type": "t", "retry_policy": uuid.UUID(int=7)},
        {"type": "", "retry_policy": uuid.UUID(int=7)},
        {"type": "t", "queue": uuid.UUID(int=9)},
        {"type": "", "queue": uuid.UUID(int=9)},
        {"type": "t", "depends_on": [None]},
    ]


ARGS = ("queue", "type", "payload", "priority", "run_at", "delay_ms", "timeout_ms",
        "retry_policy", "depends_on")


async def _argument_rows(api: Api, tenant: Tenant) -> list[tuple[dict[str, Any],
                                                                   dict[str, Any]]]:
    """Each case of _cases with its arguments by name (queue filled in, payload as JSON text),
    with a second policy of the tenant's project and one of another project."""
    [(policy,)] = await api.sql("insert into fl.retry_policies (project_id, name) values (%s,"
                                " 'other') returning id", tenant.project_id)
    [(foreign,)] = await api.sql("select id from fl.retry_policies where project_id = %s",
                                 tenant.other_project_id)
    rows = []
    for case in _cases(policy, foreign):
        a = {"queue": tenant.queue_id, "payload": json.dumps({}), **case}
        if "payload" in case and case["payload"] is not None and case["payload"] != "null":
            a["payload"] = json.dumps(case["payload"])
        rows.append((case, a))
    return rows


async def _run(conn: TrioConnection[Any], sql: str, args: tuple[Any, ...]) -> Any:
    """Answer rows plus what was written (job, event), or the error; then roll back."""
    await conn.execute("begin")
    try:
        try:
            cur = await conn.execute(sql, args)
        except psycopg.Error as exc:
            return ("error", exc.sqlstate, exc.diag.message_primary)
        rows = await cur.fetchall()
        jobs = await (await conn.execute(
            "select project_id, queue_id, type, payload, status::text, priority, run_at,"
            " timeout_ms, retry_policy_id, created_at, batch_id, pending_deps, has_dependents,"
            " fence, attempts from fl.jobs order by id")).fetchall()
        events = await (await conn.execute(
            "select project_id, queue_id, job_id is not null, topic, payload, created_at"
            " from fl.events order by id")).fetchall()
        return ("rows", [r[:1] + r[2:] for r in rows], jobs, events)
    finally:
        await conn.execute("rollback")


async def test_direct_submit_job_answers_as_submit_jobs(conn: TrioConnection[Any], api: Api,
                                                        tenant: Tenant, clock: Clock) -> None:
    await clock.set(NOW.isoformat())
    cases = await _argument_rows(api, tenant)
    new = ("select outcome, job_id, status::text, priority, run_at, created_at, detail"
           "  from fl.submit_job(%s, %s, %s::jsonb, %s, %s::timestamptz, %s, %s, %s,"
           "                     %s::bigint[])")
    # What fl.submit_job (0006) ran for every job.
    old = ("select r.outcome, r.job_id, r.status::text, r.priority, r.run_at, r.created_at,"
           "       r.detail"
           "  from fl._submit_jobs(%s, jsonb_build_array(jsonb_strip_nulls(jsonb_build_object("
           "           'type', to_jsonb(%s::text), 'priority', %s::integer,"
           "           'run_at', %s::timestamptz, 'delay_ms', %s::bigint,"
           "           'timeout_ms', %s::integer, 'retry_policy_id', %s::uuid,"
           "           'depends_on', to_jsonb(%s::bigint[])))"
           "           || jsonb_build_object('payload', %s::jsonb)), false, null, null) r")
    checked = 0
    for case, a in cases:
        args = tuple(a.get(k) for k in ARGS)
        got = await _run(conn, new, args)
        if args[2] is None or args[8] == [None]:
            # fl.submit_job refuses these itself, before either path.
            assert got[:2] == ("error", "FL005"), (case, got)
            continue
        want = await _run(conn, old, (args[0], args[1], args[3], args[4], args[5], args[6],
                                      args[7], args[8], args[2]))
        assert got == want, case
        checked += 1
    assert checked > 20
    # The depth cap, both ways.
    await api.sql("update fl.queues set max_depth = 1 where id = %s", tenant.queue_id)
    args = (tenant.queue_id, "t", "{}", None, None, None, None, None, None)
    assert (await _run(conn, new, args))[1][0][0] == "ok"
    await conn.execute(new, args)
    got = await _run(conn, new, args)
    want = await _run(conn, old, (args[0], "t", None, None, None, None, None, None, "{}"))
    assert got == want and got[1][0][0] == "queue_full"


async def test_submit_is_submit_job_with_its_delay_in_seconds(conn: TrioConnection[Any],
                                                               api: Api, tenant: Tenant,
                                                               clock: Clock) -> None:
    # 0012: fl.submit hands everything to fl.submit_job but its delay, which it checks itself
    # (FL003, as in 0004) and passes on in milliseconds.
    await clock.set(NOW.isoformat())
    cases = await _argument_rows(api, tenant)
    front = ("select outcome, job_id, status::text, run_at"
             "  from fl.submit(%s, %s, %s::jsonb, %s, %s::timestamptz, %s::float8, %s, %s)")
    job = ("select outcome, job_id, status::text, run_at"
           "  from fl.submit_job(%s, %s, %s::jsonb, %s, %s::timestamptz, %s, %s, %s)")
    compared = refused_delays = 0
    for case, a in cases:
        if "depends_on" in case:
            continue  # fl.submit takes no parents
        args = tuple(a.get(k) for k in ARGS[:8])
        delay_ms = a.get("delay_ms")
        got = await _run(conn, front, (*args[:5], None if delay_ms is None else delay_ms / 1000,
                                       *args[6:]))
        if delay_ms is not None and not 0 <= delay_ms <= 315_360_000_000:
            assert got[:2] == ("error", "FL003"), (case, got)
            refused_delays += 1
            continue
        assert got == await _run(conn, job, args), case
        compared += 1
    assert compared > 20 and refused_delays == 3
