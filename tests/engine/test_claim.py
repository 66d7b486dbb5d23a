"""Claim: straight into running, ordering, gates, delayed jobs, the outbox and notify."""

from __future__ import annotations

import psycopg

from .conftest import Engine


def test_claim_goes_straight_to_running_with_lease_fence_and_ledger(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q, "t", {"n": 1})
    got = eng.claim_one(q, w, lease="30 seconds")
    assert got["job_id"] == job
    assert got["fence"] == 1 and got["attempt"] == 1 and got["payload"] == {"n": 1}
    row = eng.job(job)
    assert row["status"] == "running" and row["fence"] == 1 and row["attempts"] == 1
    lease = eng.row("select * from fl.leases where job_id = %s", (job,))
    assert lease["fence"] == 1 and lease["worker_id"] == w
    assert (lease["expires_at"] - eng.now).total_seconds() == 30
    attempt = eng.row("select * from fl.attempts where job_id = %s", (job,))
    assert attempt["fence"] == 1 and attempt["finished_at"] is None and attempt["worker_id"] == w


def test_claim_orders_by_priority_then_run_at_then_id(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    t0 = eng.now
    low = eng.submit(q, priority=0, run_at=t0)
    eng.advance(10)
    high_late_a = eng.submit(q, priority=5, run_at=eng.now)
    high_late_b = eng.submit(q, priority=5, run_at=eng.now)
    high_early = eng.submit(q, priority=5, run_at=t0)
    got = [r["job_id"] for r in eng.claim(q, w, n=10)]
    assert got == [high_early, high_late_a, high_late_b, low]


def test_claim_takes_as_many_as_asked_in_one_call(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    for _ in range(20):
        eng.submit(q)
    assert len(eng.claim(q, w, n=16)) == 16
    assert len(eng.claim(q, w, n=16)) == 4
    assert eng.claim_rows(q, w, n=16)[0]["outcome"] == "empty"


def test_paused_queue_claims_nothing(eng: Engine) -> None:
    q = eng.make_queue(paused=True)
    w = eng.worker(q)
    eng.submit(q)
    rows = eng.claim_rows(q, w, n=5)
    assert [r["outcome"] for r in rows] == ["paused"]
    eng.conn.execute("update fl.queues set paused = false where id = %s", (q,))
    assert len(eng.claim(q, w, n=5)) == 1


def test_draining_worker_claims_nothing(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    eng.submit(q)
    assert eng.val("select fl.worker_heartbeat(%s, 'draining')", (w,)) == "ok"
    assert [r["outcome"] for r in eng.claim_rows(q, w)] == ["worker_inactive"]


def test_delayed_job_is_claimable_exactly_when_due_without_a_promoter(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q, delay_s=10)
    assert eng.job(job)["status"] == "scheduled"
    rows = eng.claim_rows(q, w)
    assert rows[0]["outcome"] == "empty"
    assert rows[0]["retry_at"] == eng.job(job)["run_at"]  # the worker knows when to come back
    eng.advance(9.999)
    assert eng.claim(q, w) == []
    eng.advance(0.001)
    assert eng.claim_one(q, w)["job_id"] == job


def test_promote_sweep_moves_due_jobs_of_every_queue(eng: Engine) -> None:
    q1, q2 = eng.make_queue(), eng.make_queue()
    a = eng.submit(q1, delay_s=5)
    b = eng.submit(q2, delay_s=5)
    assert eng.val("select fl.promote()") == 0
    eng.advance(5)
    assert eng.val("select fl.promote()") == 2
    assert eng.job(a)["status"] == eng.job(b)["status"] == "queued"


def test_state_changes_notify_the_queue_at_commit(eng: Engine) -> None:
    q = eng.make_queue()
    listener = psycopg.connect(eng.dsn, autocommit=True)
    try:
        listener.execute("listen fl_queue")
        writer = eng.connect(autocommit=False)
        writer.execute("select fl.submit(%s, 't')", (q,))
        assert list(listener.notifies(timeout=0.2, stop_after=1)) == []  # not before commit
        writer.commit()
        got = list(listener.notifies(timeout=5, stop_after=1))
        assert [n.payload for n in got] == [str(q)]
    finally:
        listener.close()


def test_a_completion_wakes_workers_only_where_it_frees_room_under_a_cap(eng: Engine) -> None:
    # A completion adds no work; the only worker it can unblock is one refused with cap_full.
    # Without a cap it notifies fl_events instead, which event streams hear and workers do not
    # listen on (migration 0011).
    free, capped = eng.make_queue(), eng.make_queue(max_concurrency=4)
    listener = psycopg.connect(eng.dsn, autocommit=True)
    try:
        listener.execute("listen fl_queue")
        listener.execute("listen fl_events")
        for q in (free, capped):
            w = eng.worker(q)
            eng.submit(q)
            job = eng.claim_one(q, w)
            assert [(n.channel, n.payload) for n in listener.notifies(timeout=5, stop_after=1)
                    ] == [("fl_queue", str(q))]  # the submission's
            eng.complete(w, [(job["job_id"], job["fence"])])
            got = [(n.channel, n.payload) for n in listener.notifies(timeout=5, stop_after=1)]
            assert got == [("fl_events" if q == free else "fl_queue", str(q))]
    finally:
        listener.close()


def test_every_state_change_writes_its_outbox_row(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    c = eng.claim_one(q, w)
    eng.complete(w, [(job, c["fence"])])
    topics = [r["topic"] for r in eng.rows("select topic from fl.events order by id")]
    assert topics == ["job.submitted", "jobs.claimed", "jobs.completed"]
    ev = eng.row("select * from fl.events where topic = 'jobs.completed'")
    assert ev["payload"]["jobs"] == [[job, c["fence"]]] and ev["queue_id"] == q


def test_complete_is_batched_and_stores_results(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    for _ in range(5):
        eng.submit(q)
    held = [(r["job_id"], r["fence"]) for r in eng.claim(q, w, n=5)]
    outcomes = eng.complete(w, held, results=[{"i": i} for i in range(5)])
    assert outcomes == ["ok"] * 5
    assert eng.val("select count(*) from fl.jobs where status = 'completed'") == 5
    assert eng.val("select count(*) from fl.leases") == 0
    results = [r["result"] for r in eng.rows("select result from fl.attempts order by job_id")]
    assert results == [{"i": i} for i in range(5)]
    assert eng.val("select count(*) from fl.events where topic = 'jobs.completed'") == 1


def test_depth_cap_refuses_submit_when_full_counting_delayed_jobs(eng: Engine) -> None:
    q = eng.make_queue(max_depth=3)
    eng.submit(q)
    eng.submit(q, delay_s=60)  # a delayed job counts too (reference W14)
    eng.submit(q, run_at=eng.now)
    before = eng.snapshot()
    r = eng.submit_row(q)
    assert r["outcome"] == "queue_full" and r["job_id"] is None
    assert eng.snapshot() == before
