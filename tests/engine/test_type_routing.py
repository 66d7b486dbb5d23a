"""Type routing: a backlog of a type no worker handles is never walked by the claim.

Checked by plan shape and buffer counts, not by timing: the cost of claiming the handled
type must not depend on how many jobs of other types wait in front of it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from .conftest import Engine

# The claim's candidate queries, as fl.claim runs them (one type; several types).
ONE_TYPE = """
    select j.id from fl.jobs j
     where j.queue_id = $1 and j.type = $2 and j.status = 'queued' and j.run_at <= $3
     order by j.priority desc, j.run_at, j.id
     limit $4
       for update skip locked"""
MANY_TYPES = """
    select j.id from fl.jobs j
     where j.id = any(array(
               select c.id from unnest($2::text[]) as t(tp)
                cross join lateral (
                      select x.id, x.priority, x.run_at from fl.jobs x
                       where x.queue_id = $1 and x.type = t.tp
                         and x.status = 'queued' and x.run_at <= $3
                       order by x.priority desc, x.run_at, x.id
                       limit $4 * 2) c
                order by c.priority desc, c.run_at, c.id
                limit $4 * 2))
       and j.status = 'queued'
     order by j.priority desc, j.run_at, j.id
     limit $4
       for update skip locked"""


def _backlog(eng: Engine, q: uuid.UUID, type_: str, n: int, priority: int) -> None:
    eng.conn.execute(
        "insert into fl.jobs (project_id, queue_id, type, status, priority, run_at, timeout_ms,"
        " retry_policy_id) select project_id, id, %s, 'queued', %s, fl.now() - interval '1 hour',"
        " 1000, retry_policy_id from fl.queues, generate_series(1, %s) where id = %s",
        (type_, priority, n, q),
    )
    eng.conn.execute("analyze fl.jobs")


def _claim_buffers(eng: Engine, q: uuid.UUID, w: uuid.UUID, types: list[str]) -> int:
    """Shared buffers one real fl.claim call touches (rolled back, so repeatable)."""
    conn = eng.connect(autocommit=False)
    try:
        conn.execute("set plan_cache_mode = force_generic_plan")
        for _ in range(3):  # warm the plan cache and the catalog caches
            conn.execute("select * from fl.claim(%s, %s, %s, 5, '30 seconds')", (q, w, types))
            conn.rollback()
        plan = conn.execute(
            "explain (analyze, buffers, costs off, timing off, format json)"
            " select * from fl.claim(%s, %s, %s, 5, '30 seconds')",
            (q, w, types),
        ).fetchone()
        conn.rollback()
    finally:
        conn.close()
    assert plan is not None
    node: dict[str, Any] = next(iter(plan.values()))[0]["Plan"]
    assert node["Actual Rows"] == 5
    return int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])


@pytest.mark.parametrize("types", [["handled"], ["handled", "also_handled"]])
def test_backlog_of_an_unhandled_type_does_not_slow_the_claim(
    eng: Engine, types: list[str]
) -> None:
    q = eng.make_queue()
    w = eng.worker(q, handlers=types)
    for t in types:
        _backlog(eng, q, t, 10, priority=0)
    # Jobs nobody handles, at a higher priority and older: first in line by the queue's
    # order, so a scan in that order that filtered on type would walk all of them.
    _backlog(eng, q, "unhandled", 5000, priority=10)
    with_5k = _claim_buffers(eng, q, w, types)
    _backlog(eng, q, "unhandled", 45000, priority=10)
    with_50k = _claim_buffers(eng, q, w, types)
    # Ten times the backlog, the same cost: the claim never reads a row of the unhandled
    # type. Walking 45,000 more index entries would cost at least their ~350 leaf pages;
    # what we allow is a b-tree level per index descent and autovacuum noise.
    leaves = eng.val(
        "select relpages from pg_class where relname = 'jobs_claimable'"
    )  # after the analyze in _backlog
    assert leaves > 300
    assert with_50k <= with_5k + 50, (with_5k, with_50k)
    got = eng.claim(q, w, types=types, n=5)
    assert {r["type"] for r in got} <= set(types) and len(got) == 5


@pytest.mark.parametrize(
    ("query", "args"), [(ONE_TYPE, "'handled'"), (MANY_TYPES, "array['handled', 'other']")]
)
def test_claim_candidates_stay_index_scans_under_generic_plans(
    eng: Engine, query: str, args: str
) -> None:
    q = eng.make_queue()
    _backlog(eng, q, "unhandled", 5000, priority=10)
    _backlog(eng, q, "handled", 50, priority=0)
    eng.conn.execute("set plan_cache_mode = force_generic_plan")
    eng.conn.execute(
        f"prepare cand(uuid, {'text' if query is ONE_TYPE else 'text[]'},"
        f" timestamptz, integer) as {query}"
    )
    plan = "\n".join(
        r["QUERY PLAN"]
        for r in eng.rows(f"explain (costs off) execute cand('{q}', {args}, fl.now(), 16)")
    )
    assert "jobs_claimable" in plan, plan
    assert "Seq Scan" not in plan and "Bitmap" not in plan, plan


def test_unhandled_types_are_visible_as_such(eng: Engine) -> None:
    q = eng.make_queue()
    eng.worker(q, handlers=["handled"])
    eng.submit(q, "handled")
    eng.submit(q, "orphan")
    eng.submit(q, "orphan")
    rows = eng.rows(
        "select type, queued, handled from fl.queue_backlog where queue_id = %s order by type", (q,)
    )
    assert rows == [
        {"type": "handled", "queued": 1, "handled": True},
        {"type": "orphan", "queued": 2, "handled": False},
    ]


def test_claim_with_any_type_reads_every_queued_type_in_order(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    a = eng.submit(q, "a", priority=1)
    b = eng.submit(q, "b", priority=3)
    c = eng.submit(q, "c", priority=2)
    assert eng.val("select fl.queued_types(%s)", (q,)) == ["a", "b", "c"]
    assert [r["job_id"] for r in eng.claim(q, w, types=None, n=5)] == [b, c, a]
