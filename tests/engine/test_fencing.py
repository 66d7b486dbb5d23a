"""A stale worker's writes are refused, recorded by the function itself, and change nothing.

The scenario in each test: worker A claims a job, its lease lapses, the reaper takes the job
back (fence + 1) and worker B claims it (fence + 1 again). A then reports with its old fence.
"""

from __future__ import annotations

import uuid

from .conftest import Engine


def _stolen(eng: Engine) -> tuple[uuid.UUID, uuid.UUID, int, int, int]:
    """(worker A, worker B, job, A's fence, B's fence): A's job now belongs to B."""
    q = eng.make_queue(breaker_enabled=False)
    a, b = eng.worker(q), eng.worker(q)
    job = eng.submit(q)
    fa = eng.claim_one(q, a)["fence"]
    eng.advance(31)
    assert [r["outcome"] for r in eng.reap()] == ["retry"]
    eng.advance(3600)  # past any backoff
    fb = eng.claim_one(q, b)["fence"]
    assert fb == fa + 2  # the reap took it (+1), B's claim (+1)
    return a, b, job, fa, fb


def _assert_refused(
    eng: Engine, job: int, worker: uuid.UUID, attempted: str, held: int, actual: int
) -> None:
    (v,) = eng.violations(job)
    assert (
        v["worker_id"],
        v["attempted"],
        v["held_fence"],
        v["actual_fence"],
        v["actual_status"],
    ) == (worker, attempted, held, actual, "running")


def test_stale_complete_is_fenced_and_counted(eng: Engine) -> None:
    a, b, job, fa, fb = _stolen(eng)
    before = eng.job(job)
    assert eng.complete(a, [(job, fa)]) == ["fenced"]
    assert eng.job(job) == before
    _assert_refused(eng, job, a, "complete", fa, fb)
    assert eng.complete(b, [(job, fb)]) == ["ok"]  # the owner still can


def test_stale_fail_is_fenced_and_counted(eng: Engine) -> None:
    a, _b, job, fa, fb = _stolen(eng)
    before = eng.job(job)
    r = eng.fail(a, job, fa, "permanent")
    assert r["outcome"] == "fenced" and r["status"] is None
    assert eng.job(job) == before
    _assert_refused(eng, job, a, "fail", fa, fb)


def test_stale_snooze_is_fenced_and_counted(eng: Engine) -> None:
    a, _b, job, fa, fb = _stolen(eng)
    before = eng.job(job)
    assert eng.snooze(a, job, fa, 10)["outcome"] == "fenced"
    assert eng.job(job) == before
    _assert_refused(eng, job, a, "snooze", fa, fb)


def test_stale_heartbeat_is_fenced_and_counted(eng: Engine) -> None:
    a, _b, job, fa, fb = _stolen(eng)
    lease = eng.row("select * from fl.leases where job_id = %s", (job,))
    rows = eng.extend(a, [(job, fa)])
    assert [(r["job_id"], r["outcome"]) for r in rows] == [(job, "fenced")]
    assert eng.row("select * from fl.leases where job_id = %s", (job,)) == lease
    _assert_refused(eng, job, a, "heartbeat", fa, fb)


def test_stale_release_is_fenced_and_counted(eng: Engine) -> None:
    a, _b, job, fa, fb = _stolen(eng)
    before = eng.job(job)
    assert eng.release(a, [(job, fa)]) == ["fenced"]
    assert eng.job(job) == before
    _assert_refused(eng, job, a, "release", fa, fb)


def test_a_batch_completes_what_it_owns_and_fences_the_rest(eng: Engine) -> None:
    a, _b, job, fa, _fb = _stolen(eng)
    q = eng.val("select queue_id from fl.jobs where id = %s", (job,))
    other = eng.submit(q)
    fo = eng.claim_one(q, a)["fence"]
    assert eng.complete(a, [(job, fa), (other, fo)]) == ["fenced", "ok"]
    assert eng.job(other)["status"] == "completed"
    assert len(eng.violations()) == 1


def test_heartbeat_racing_its_own_report_is_not_a_violation(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    assert eng.complete(w, [(job, f)]) == ["ok"]
    rows = eng.extend(w, [(job, f)])
    assert [(r["job_id"], r["outcome"]) for r in rows] == [(job, "finished")]
    assert eng.violations() == []


def test_heartbeat_extends_without_rewriting_the_job_row(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    ctid = eng.val("select ctid::text from fl.jobs where id = %s", (job,))
    xmin = eng.val("select xmin::text from fl.jobs where id = %s", (job,))
    eng.advance(20)
    progress = eng.conn.execute(
        "select * from fl.extend_leases(%s, %s, %s, '30 seconds', array['{\"p\": 0.5}'::jsonb])",
        (w, [job], [f]),
    ).fetchall()
    assert progress == []
    lease = eng.row("select * from fl.leases where job_id = %s", (job,))
    assert (lease["expires_at"] - eng.now).total_seconds() == 30 and lease["progress"] == {"p": 0.5}
    assert eng.val("select ctid::text from fl.jobs where id = %s", (job,)) == ctid
    assert eng.val("select xmin::text from fl.jobs where id = %s", (job,)) == xmin
