"""Priority aging (reference W16): an effective priority computed by the claim, nothing written.

effective = priority + least(aging_max_boost, floor(ms waited since run_at / aging_step_ms)),
claim order effective desc, run_at, id. Off (aging_step_ms NULL) by default, where the claim
keeps its plain priority order. Time moves only through fl.now; nothing sleeps."""

from __future__ import annotations

import random
import uuid
from datetime import timedelta
from typing import Any

import pytest

from .conftest import Engine, raises_sqlstate


def _eff(priority: int, waited_ms: float, step_ms: int | None, max_boost: int) -> int:
    if step_ms is None:
        return priority
    return priority + min(max_boost, int(max(waited_ms, 0) // step_ms))


def _ids(rows: list[dict[str, Any]]) -> list[int]:
    return [r["job_id"] for r in rows]


def _effective(eng: Engine, job: int, step_ms: int, max_boost: int) -> int:
    """The job's effective priority now, as the claim computes it."""
    return eng.val(  # type: ignore[no-any-return]
        "select fl.effective_priority(priority, run_at, fl.now(), %s, %s) from fl.jobs"
        " where id = %s",
        (step_ms, max_boost, job),
    )


# -- configuration ---------------------------------------------------------------------------


def test_aging_is_off_by_default_and_keeps_strict_priority_order(eng: Engine) -> None:
    q = eng.make_queue()
    cfg = eng.row("select aging_step_ms, aging_max_boost from fl.queues where id = %s", (q,))
    assert cfg == {"aging_step_ms": None, "aging_max_boost": 10}
    w = eng.worker(q)
    ancient = eng.submit(q, priority=0, run_at=eng.now - timedelta(days=365))
    eng.advance(3600)
    fresh_high = eng.submit(q, priority=1)
    fresh_mid = eng.submit(q, priority=0)
    assert _ids(eng.claim(q, w, n=3)) == [fresh_high, ancient, fresh_mid]


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("aging_step_ms", 0),
        ("aging_step_ms", -1),
        ("aging_step_ms", 86_400_001),
        ("aging_max_boost", 0),
        ("aging_max_boost", -5),
        ("aging_max_boost", 1001),
        ("aging_max_boost", None),
    ],
)
def test_bad_aging_configuration_is_rejected(eng: Engine, column: str, value: Any) -> None:
    code = "23502" if value is None else "23514"  # not null / check violation
    with raises_sqlstate(code):
        eng.make_queue(**{column: value})
    q = eng.make_queue(aging_step_ms=1000)
    with raises_sqlstate(code):
        eng.conn.execute(f"update fl.queues set {column} = %s where id = %s", (value, q))


def test_aging_bounds_are_accepted(eng: Engine) -> None:
    eng.make_queue(aging_step_ms=1, aging_max_boost=1)
    eng.make_queue(aging_step_ms=86_400_000, aging_max_boost=1000)


# -- the order ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("waited_ms", "low_first"), [(2999, False), (3000, True), (3001, True)])
def test_low_priority_job_overtakes_a_fresh_higher_one_once_its_boost_reaches_the_gap(
    eng: Engine, waited_ms: int, low_first: bool
) -> None:
    # Gap 3, one level per second: the old low job and the fresh high job are level at 3000
    # ms (effective 3 both), where the older run_at goes first; one ms earlier the high job
    # still leads by a level.
    q = eng.make_queue(aging_step_ms=1000)
    w = eng.worker(q)
    low = eng.submit(q, priority=0)
    eng.advance(waited_ms / 1000)
    high = eng.submit(q, priority=3)
    assert _effective(eng, low, 1000, 10) == waited_ms // 1000
    order = [low, high] if low_first else [high, low]
    assert _ids(eng.claim(q, w, n=2)) == order


def test_a_higher_job_that_has_waited_as_long_keeps_its_lead(eng: Engine) -> None:
    # Aging lifts every waiting job alike: it closes the gap to fresh work, not to old work.
    q = eng.make_queue(aging_step_ms=1000)
    w = eng.worker(q)
    high = eng.submit(q, priority=3)
    eng.advance(0.5)
    low = eng.submit(q, priority=0)
    eng.advance(4.5)  # low: 4 levels (effective 4); high: 5 levels (effective 8)
    assert (_effective(eng, low, 1000, 10), _effective(eng, high, 1000, 10)) == (4, 8)
    assert _ids(eng.claim(q, w, n=2)) == [high, low]


def test_boost_is_capped_at_aging_max_boost(eng: Engine) -> None:
    q = eng.make_queue(aging_step_ms=1000, aging_max_boost=2)
    w = eng.worker(q)
    ancient = eng.submit(q, priority=0, run_at=eng.now - timedelta(days=30))
    high = eng.submit(q, priority=3)  # fresh: 3 > 0 + 2, the cap holds the ancient job back
    level = eng.submit(q, priority=2)  # fresh: 2 = 0 + 2, the older run_at wins the tie
    assert _effective(eng, ancient, 1000, 2) == 2
    assert _ids(eng.claim(q, w, n=3)) == [high, ancient, level]


def test_ties_on_effective_priority_are_broken_by_run_at_then_id(eng: Engine) -> None:
    q = eng.make_queue(aging_step_ms=1000, aging_max_boost=100)
    w = eng.worker(q)
    t = eng.now + timedelta(seconds=60)
    # Every job at effective priority 5 at time t, from four levels.
    c1 = eng.submit(q, priority=5, run_at=t)
    b = eng.submit(q, priority=3, run_at=t - timedelta(seconds=2))
    a = eng.submit(q, priority=0, run_at=t - timedelta(seconds=5))
    c2 = eng.submit(q, priority=5, run_at=t)
    d = eng.submit(q, priority=4, run_at=t - timedelta(seconds=1))
    above = eng.submit(q, priority=1, run_at=t - timedelta(seconds=5, milliseconds=1))  # 6
    below = eng.submit(q, priority=4, run_at=t - timedelta(milliseconds=999))  # 4
    eng.set_now(t)
    expected = [above, a, b, d, c1, c2, below]
    # In one call (the returned rows follow the claim order too) ...
    conn = eng.connect(autocommit=False)
    assert _ids(eng.claim(q, w, n=7, conn=conn)) == expected
    conn.rollback()
    # ... and one at a time.
    assert [eng.claim_one(q, w)["job_id"] for _ in expected] == expected


def _random_backlog(
    eng: Engine, q: uuid.UUID, types: list[str], n: int, seed: int
) -> dict[int, tuple[int, Any]]:
    rnd = random.Random(seed)
    jobs: dict[int, tuple[int, Any]] = {}
    for _ in range(n):
        prio = rnd.choice([-2, 0, 1, 3, 7])
        run_at = eng.now - timedelta(milliseconds=rnd.randrange(0, 40_000))
        job = eng.submit(q, rnd.choice(types), priority=prio, run_at=run_at)
        jobs[job] = (prio, run_at)
    return jobs


@pytest.mark.parametrize(
    ("types", "claim_types"),
    [
        (["a"], ["a"]),
        (["a", "b", "c"], ["a", "c"]),
        (["a", "b", "c"], None),  # any type: the types are read from the queue
    ],
)
def test_claim_follows_the_effective_order_across_types_and_levels(
    eng: Engine, types: list[str], claim_types: list[str] | None
) -> None:
    step, cap = 5000, 4
    q = eng.make_queue(aging_step_ms=step, aging_max_boost=cap)
    w = eng.worker(q)
    jobs = _random_backlog(eng, q, types, 120, seed=16)
    eng.advance(1)
    types_of = {r["id"]: r["type"] for r in eng.rows("select id, type from fl.jobs")}
    wanted = [j for j in jobs if claim_types is None or types_of[j] in claim_types]

    def key(j: int) -> tuple[int, Any, int]:
        prio, run_at = jobs[j]
        waited = (eng.now - run_at) // timedelta(milliseconds=1)
        return (-_eff(prio, waited, step, cap), run_at, j)

    expected = sorted(wanted, key=key)
    # The model agrees with the SQL function on every job.
    for j in wanted:
        assert _effective(eng, j, step, cap) == -key(j)[0]
    claimed: list[int] = []
    while got_rows := eng.claim(q, w, types=claim_types, n=7):
        claimed += _ids(got_rows)
    assert claimed == expected


def test_a_retried_job_waits_again_from_its_new_run_at(eng: Engine) -> None:
    q = eng.make_queue(aging_step_ms=1000, policy={"base_delay_ms": 1000, "kind": "fixed"})
    w = eng.worker(q)
    job = eng.submit(q, priority=0)
    eng.advance(50)  # 50 levels would put it far ahead of anything ...
    fence = eng.claim_one(q, w)["fence"]
    failed = eng.fail(w, job, fence)
    assert failed["outcome"] == "retry" and failed["run_at"] == eng.now + timedelta(seconds=1)
    eng.set_now(failed["run_at"] + timedelta(seconds=2))  # ... but it has waited 2 s since
    high = eng.submit(q, priority=3)
    assert _ids(eng.claim(q, w, n=2)) == [high, job]


def test_a_released_job_keeps_its_place_and_its_age(eng: Engine) -> None:
    # fl.release puts a job back at its old run_at, so it keeps the boost it had earned.
    q = eng.make_queue(aging_step_ms=1000)
    w = eng.worker(q)
    job = eng.submit(q, priority=0)
    eng.advance(5)
    fence = eng.claim_one(q, w)["fence"]
    assert eng.release(w, [(job, fence)]) == ["ok"]
    high = eng.submit(q, priority=4)
    assert _ids(eng.claim(q, w, n=2)) == [job, high]


def test_aging_writes_nothing_to_the_jobs(eng: Engine) -> None:
    q = eng.make_queue(aging_step_ms=1000)
    w = eng.worker(q)
    for p in (0, 1, 2):
        eng.submit(q, priority=p)
    before = eng.rows("select id, priority, run_at, xmin::text from fl.jobs order by id")
    eng.advance(3600)
    conn = eng.connect(autocommit=False)
    assert len(eng.claim(q, w, n=1, conn=conn)) == 1
    conn.rollback()
    assert eng.rows("select id, priority, run_at, xmin::text from fl.jobs order by id") == before


# -- cost ------------------------------------------------------------------------------------

# The aging path's candidate query, as fl.claim runs it ($1 queue, $2 types, $3 now, $4 k,
# $5 step, $6 max boost).
AGING_CANDIDATES = """
    select c.id from (
        with recursive lv(tp, p) as (
            select t.tp,
                   (select x.priority from fl.jobs x
                     where x.queue_id = $1 and x.type = t.tp and x.status = 'queued'
                     order by x.priority desc limit 1)
              from unnest($2::text[]) as t(tp)
            union all
            select lv.tp,
                   (select x.priority from fl.jobs x
                     where x.queue_id = $1 and x.type = lv.tp and x.status = 'queued'
                       and x.priority < lv.p
                     order by x.priority desc limit 1)
              from lv where lv.p is not null
        )
        select c.id, c.priority, c.run_at
          from lv
         cross join lateral (
               select x.id, x.priority, x.run_at from fl.jobs x
                where x.queue_id = $1 and x.type = lv.tp and x.status = 'queued'
                  and x.priority = lv.p and x.run_at <= $3
                order by x.run_at, x.id
                limit $4 * 2) c
         where lv.p is not null) c
     order by fl.effective_priority(c.priority, c.run_at, $3, $5, $6) desc, c.run_at, c.id
     limit $4 * 2"""


def _backlog(eng: Engine, q: uuid.UUID, type_: str, n: int, levels: int, after: int = 0) -> None:
    """n queued jobs of a type, spread over priorities 0..levels-1, due one a ms from an hour
    ago (the first ``after`` ms taken by earlier jobs: a backlog grows behind its head)."""
    eng.conn.execute(
        "insert into fl.jobs (project_id, queue_id, type, status, priority, run_at, timeout_ms,"
        " retry_policy_id) select project_id, id, %s, 'queued', g %% %s,"
        " fl.now() - interval '1 hour' + (%s + g) * interval '1 ms', 1000, retry_policy_id"
        " from fl.queues, generate_series(1, %s) g where id = %s",
        (type_, levels, after, n, q),
    )
    eng.conn.execute("vacuum analyze fl.jobs")


def _claim_buffers(eng: Engine, q: uuid.UUID, w: uuid.UUID, types: list[str], k: int) -> int:
    """Shared buffers one real fl.claim call touches (rolled back, so repeatable)."""
    conn = eng.connect(autocommit=False)
    try:
        for _ in range(3):  # warm the plan cache and the catalog caches
            conn.execute("select * from fl.claim(%s, %s, %s, %s, '30 seconds')", (q, w, types, k))
            conn.rollback()
        plan = conn.execute(
            "explain (analyze, buffers, costs off, timing off, format json)"
            " select * from fl.claim(%s, %s, %s, %s, '30 seconds')",
            (q, w, types, k),
        ).fetchone()
        conn.rollback()
    finally:
        conn.close()
    assert plan is not None
    node: dict[str, Any] = next(iter(plan.values()))[0]["Plan"]
    assert node["Actual Rows"] == k
    return int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])


def _index_entries(plan: dict[str, Any]) -> tuple[int, bool]:
    """Index entries of jobs_claimable the plan returned (rows x loops), and any seq scan."""
    total, seq = 0, False
    stack = [plan]
    while stack:
        node = stack.pop()
        if node.get("Index Name") == "jobs_claimable":
            total += int(node["Actual Rows"]) * int(node["Actual Loops"])
            total += int(node.get("Rows Removed by Filter", 0)) * int(node["Actual Loops"])
            total += int(node.get("Rows Removed by Index Recheck", 0))
        if "Seq Scan" in node["Node Type"] or "Bitmap" in node["Node Type"]:
            seq = True
        stack.extend(node.get("Plans", []))
    return total, seq


def _candidate_entries(eng: Engine, q: uuid.UUID, types: list[str], k: int) -> tuple[int, str]:
    conn = eng.connect()
    conn.execute("set plan_cache_mode = force_generic_plan")
    conn.execute("set enable_seqscan = off")
    conn.execute(
        "prepare cand(uuid, text[], timestamptz, integer, integer, integer) as " + AGING_CANDIDATES
    )
    call = "execute cand('{}', array[{}], fl.now(), {}, 1000, 10)".format(
        q, ", ".join(f"'{t}'" for t in types), k
    )
    js = conn.execute(f"explain (analyze, costs off, timing off, format json) {call}").fetchone()
    text = "\n".join(
        r["QUERY PLAN"] for r in conn.execute(f"explain (costs off) {call}").fetchall()
    )
    conn.close()
    assert js is not None
    entries, seq = _index_entries(next(iter(js.values()))[0]["Plan"])
    assert not seq, text
    return entries, text


def test_aging_claim_reads_levels_times_k_index_entries_not_the_backlog(eng: Engine) -> None:
    k, levels = 5, 3
    q = eng.make_queue(aging_step_ms=1000)
    w = eng.worker(q, handlers=["a", "b"])
    plain_q = eng.make_queue()
    plain_w = eng.worker(plain_q, handlers=["a"])
    _backlog(eng, q, "a", 2_000, levels)
    _backlog(eng, plain_q, "a", 2_000, levels)
    entries_2k, plan = _candidate_entries(eng, q, ["a"], k)
    small = _claim_buffers(eng, q, w, ["a"], k)

    _backlog(eng, q, "a", 18_000, levels, after=2_000)  # 20,000 jobs of type a at 3 levels
    _backlog(eng, plain_q, "a", 18_000, levels, after=2_000)
    leaves = eng.val("select relpages from pg_class where relname = 'jobs_claimable'")
    assert leaves > 100
    entries_20k, plan = _candidate_entries(eng, q, ["a"], k)
    big = _claim_buffers(eng, q, w, ["a"], k)
    plain = _claim_buffers(eng, plain_q, plain_w, ["a"], k)

    # The skip scan and the per-level heads are index scans of jobs_claimable under a
    # generic plan, and they read (levels + 1) probes plus levels x 2k entries, whatever the
    # backlog: ten times the jobs, the same entries, and about the same buffers (a b-tree
    # level more per descent; a walk of the backlog would read its 100+ leaf pages).
    assert "jobs_claimable" in plan, plan
    assert entries_20k == entries_2k, (entries_2k, entries_20k)
    assert entries_20k <= (levels + 1) + levels * 2 * k, entries_20k
    assert big <= small + 50, (small, big)
    # Against the plain claim: at most the extra entries (and a heap visit each) more.
    assert big <= plain + 2 * entries_20k + 20, (plain, big)

    # The multi-type path is the same statement with a row per type.
    _backlog(eng, q, "b", 5_000, 4)
    entries_2t, plan = _candidate_entries(eng, q, ["a", "b"], k)
    assert entries_2t <= (levels + 1 + 4 + 1) + (levels + 4) * 2 * k, entries_2t
    two_types = _claim_buffers(eng, q, w, ["a", "b"], k)
    assert two_types <= big + 2 * (entries_2t - entries_20k) + 20, (big, two_types)


def test_turning_aging_on_applies_at_the_next_claim(eng: Engine) -> None:
    # Switching aging on and off is an ordinary UPDATE of the configuration row: the next
    # claim follows it, with no job rewritten.
    q = eng.make_queue()
    w = eng.worker(q)
    old_low = eng.submit(q, priority=0)
    eng.advance(600)
    fresh_high = eng.submit(q, priority=5)
    conn = eng.connect(autocommit=False)
    assert _ids(eng.claim(q, w, n=1, conn=conn)) == [fresh_high]
    conn.rollback()
    eng.conn.execute("update fl.queues set aging_step_ms = 60000 where id = %s", (q,))
    assert _ids(eng.claim(q, w, n=1)) == [old_low]


def test_effective_priority_function_edges(eng: Engine) -> None:
    rows = eng.rows(
        "select fl.effective_priority(3, t, t + interval '10 s', null, 10) as off,"
        " fl.effective_priority(3, t, t - interval '10 s', 1000, 10) as not_due,"
        " fl.effective_priority(3, t, t + interval '9.999999 s', 1000, 100) as under,"
        " fl.effective_priority(3, t, t + interval '10 s', 1000, 100) as at,"
        " fl.effective_priority(2147483647, t, t + interval '3 days', 1, 1000) as big"
        " from (select timestamptz '2026-01-01' as t) s"
    )
    assert rows == [{"off": 3, "not_due": 3, "under": 12, "at": 13, "big": 2147483647 + 1000}]


def test_aging_lock_step_is_a_primary_key_probe_under_a_generic_plan(eng: Engine) -> None:
    # The second statement of the aging path locks the chosen ids in effective order.
    q = eng.make_queue(aging_step_ms=1000)
    _backlog(eng, q, "a", 5_000, 3)
    eng.conn.execute("set plan_cache_mode = force_generic_plan")
    eng.conn.execute("set enable_seqscan = off")
    eng.conn.execute(
        "prepare lck(bigint[], timestamptz, integer, integer, integer) as"
        " select j.id from fl.jobs j"
        " where j.id = any($1) and j.status = 'queued' and j.run_at <= $2"
        " order by fl.effective_priority(j.priority, j.run_at, $2, $4, $5) desc, j.run_at, j.id"
        " limit $3 for update skip locked"
    )
    plan = "\n".join(
        r["QUERY PLAN"]
        for r in eng.rows("explain (costs off) execute lck('{1,2,3}', fl.now(), 5, 1000, 10)")
    )
    assert "jobs_pkey" in plan, plan
    assert "Seq Scan" not in plan and "Bitmap" not in plan, plan
    # The test's copies of the two statements are the function's.
    body = " ".join(eng.val("select prosrc from pg_proc where proname = 'claim'").split())
    for fragment in (
        "and x.priority < lv.p order by x.priority desc limit 1",
        "and x.priority = lv.p and x.run_at <= v_now order by x.run_at, x.id limit v_k * 2) c",
        "where j.id = any(v_cand) and j.status = 'queued' and j.run_at <= v_now",
    ):
        assert fragment in body, fragment
