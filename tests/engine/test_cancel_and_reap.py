"""Cancel keeps a running job's slot until it stops (W13); the reaper is set-based and never
reaps a lease that was just extended or a job a new owner just claimed (W1)."""

from __future__ import annotations

import threading

import psycopg

from .conftest import Engine, raises_sqlstate


def test_cancel_of_a_waiting_job_is_immediate(eng: Engine) -> None:
    q = eng.make_queue()
    job = eng.submit(q)
    assert eng.cancel(job) == {"outcome": "ok", "status": "cancelled"}
    row = eng.job(job)
    assert row["fence"] == 1 and row["finished_at"] == eng.now
    assert eng.cancel(job)["outcome"] == "conflict"
    assert eng.cancel(10**9)["outcome"] == "not_found"


def test_cancel_of_a_running_job_holds_its_slot_until_the_worker_stops(eng: Engine) -> None:
    q = eng.make_queue(max_concurrency=1)
    w = eng.worker(q)
    job = eng.submit(q)
    eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    listener = psycopg.connect(eng.dsn, autocommit=True)
    try:
        listener.execute("listen fl_cancel")
        assert eng.cancel(job) == {"outcome": "cancel_requested", "status": "running"}
        assert [n.payload for n in listener.notifies(timeout=5, stop_after=1)] == [str(job)]
    finally:
        listener.close()
    # Still running, still holding the only slot: the handler has not stopped yet.
    assert eng.job(job)["status"] == "running"
    assert [r["outcome"] for r in eng.claim_rows(q, w)] == ["cap_full"]
    # The heartbeat says so too, and keeps the lease.
    assert [(r["job_id"], r["fence"], r["outcome"]) for r in eng.extend(w, [(job, f)])] == [
        (job, f, "cancel_requested")
    ]
    # The worker stops the handler and reports; the report ends the job as cancelled.
    assert eng.release(w, [(job, f)]) == ["cancelled"]
    row = eng.job(job)
    assert (row["status"], row["fence"]) == ("cancelled", f + 1)
    assert eng.val("select outcome::text from fl.attempts where job_id = %s", (job,)) == "cancelled"
    assert len(eng.claim(q, w)) == 1  # the slot is free now


def test_a_completion_that_beats_the_cancel_wins(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    eng.cancel(job)
    assert eng.complete(w, [(job, f)]) == ["ok"]
    assert eng.job(job)["status"] == "completed"


def test_a_cancelled_job_whose_worker_died_is_cancelled_by_the_reaper(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    eng.claim_one(q, w)
    eng.cancel(job)
    eng.advance(31)
    assert [r["outcome"] for r in eng.reap()] == ["cancelled"]
    row = eng.job(job)
    assert (row["status"], row["lost_count"]) == ("cancelled", 0)


def test_reap_skips_live_leases_and_takes_expired_ones(eng: Engine) -> None:
    q = eng.make_queue(breaker_enabled=False)
    w = eng.worker(q)
    a, b = eng.submit(q), eng.submit(q)
    held = {r["job_id"]: r["fence"] for r in eng.claim(q, w, n=2, lease="10 seconds")}
    eng.advance(9)
    eng.extend(w, [(b, held[b])], lease="10 seconds")
    eng.advance(2)
    reaped = eng.reap()
    assert [(r["job_id"], r["fence"], r["outcome"]) for r in reaped] == [(a, held[a] + 1, "retry")]
    assert eng.job(b)["status"] == "running"
    att = eng.row("select * from fl.attempts where job_id = %s", (a,))
    assert (att["outcome"], att["error_class"]) == ("lost", "lease_expired")


def test_a_lost_job_is_due_at_once_while_a_failed_one_backs_off(eng: Engine) -> None:
    """The lease a lost job outlived was its backoff: it is claimable again at the reap, so
    recovery stays within lease + one reaper pass. A reported failure still backs off."""
    q = eng.make_queue(breaker_enabled=False,
                       policy={"base_delay_ms": 60_000, "jitter": False})
    w = eng.worker(q)
    lost, failed = eng.submit(q), eng.submit(q)
    held = {r["job_id"]: r["fence"] for r in eng.claim(q, w, n=2, lease="10 seconds")}
    assert eng.fail(w, failed, held[failed])["outcome"] == "retry"
    now = eng.advance(11)
    [reaped] = eng.reap()
    assert (reaped["job_id"], reaped["outcome"]) == (lost, "retry")
    assert (eng.job(lost)["status"], eng.job(lost)["run_at"]) == ("retry_wait", now)
    assert eng.job(failed)["run_at"] > now
    other = eng.worker(q)
    assert [r["job_id"] for r in eng.claim(q, other, n=2)] == [lost]


def test_reap_cannot_reap_a_lease_being_extended(eng: Engine) -> None:
    """The extension holds the lease row; the reaper waits for it, re-reads, and keeps it."""
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w, lease="10 seconds")["fence"]
    eng.advance(11)  # expired...
    heart = eng.connect(autocommit=False)  # ...but a heartbeat is in flight
    assert eng.extend(w, [(job, f)], conn=heart) == []
    reaper = eng.connect()
    result: list[list[dict[str, object]]] = []
    t = threading.Thread(target=lambda: result.append(eng.reap(conn=reaper)))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # the reaper waits on the lease row
    heart.commit()
    t.join(10)
    assert result == [[]]
    row = eng.job(job)
    assert (row["status"], row["fence"]) == ("running", f)
    assert eng.complete(w, [(job, f)]) == ["ok"]


def test_reap_cannot_reap_a_job_a_new_owner_is_claiming(eng: Engine) -> None:
    """The reference reaper read expired leases, then failed the job with no fence, and could
    mark a new owner's fresh attempt lost. Here: the old owner fails the job and a new owner
    claims it, not yet committed, while the reaper runs against the old expired lease."""
    q = eng.make_queue(policy={"base_delay_ms": 0, "max_delay_ms": 0}, breaker_enabled=False)
    a, b = eng.worker(q), eng.worker(q)
    job = eng.submit(q)
    fa = eng.claim_one(q, a, lease="10 seconds")["fence"]
    eng.advance(11)
    other = eng.connect(autocommit=False)
    assert other.execute(
        "select outcome from fl.fail(%s, %s, %s, 'retryable')", (a, job, fa)
    ).fetchone() == {"outcome": "retry"}
    fb = eng.claim(q, b, conn=other, lease="10 seconds")[0]["fence"]
    assert eng.reap() == []  # the job row is locked: not the reaper's
    other.commit()
    assert eng.reap() == []  # and now the lease is the new, live one
    row = eng.job(job)
    assert (row["status"], row["fence"]) == ("running", fb)
    assert eng.complete(b, [(job, fb)]) == ["ok"]


def test_many_reapers_and_heartbeats_never_reap_a_live_lease(eng: Engine) -> None:
    """Concurrent reapers against workers that keep extending: only the neglected jobs go."""
    q = eng.make_queue(breaker_enabled=False)
    w = eng.worker(q)
    for _ in range(40):
        eng.submit(q)
    held = {r["job_id"]: r["fence"] for r in eng.claim(q, w, n=40, lease="10 seconds")}
    kept = sorted(held)[:20]
    eng.advance(11)
    stop = threading.Event()
    errors: list[BaseException] = []

    def heartbeat() -> None:
        c = eng.connect()
        try:
            while not stop.is_set():
                rows = eng.extend(w, [(j, held[j]) for j in kept], lease="60 seconds", conn=c)
                assert rows == [], rows
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reap() -> None:
        c = eng.connect()
        try:
            for _ in range(20):
                eng.reap(conn=c)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=heartbeat)] + [
        threading.Thread(target=reap) for _ in range(3)
    ]
    # The heartbeat goes first so every kept lease is extended before the reapers start.
    eng.extend(w, [(j, held[j]) for j in kept], lease="60 seconds")
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(60)
    stop.set()
    threads[0].join(60)
    assert errors == []
    statuses = {r["id"]: r["status"] for r in eng.rows("select id, status from fl.jobs")}
    assert all(statuses[j] == "running" for j in kept)
    assert all(statuses[j] == "retry_wait" for j in held if j not in kept)


def test_deleting_an_organization_after_work_ran_removes_everything(eng: Engine) -> None:
    """Reference W5: project deletion failed once executions existed."""
    q = eng.make_queue(policy={"max_attempts": 1})
    w = eng.worker(q)
    done, dead, running = eng.submit(q), eng.submit(q), eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    eng.complete(w, [(done, f)])
    f = eng.claim_one(q, w)["fence"]
    eng.fail(w, dead, f, "permanent")
    eng.claim_one(q, w)
    eng.conn.execute(
        "select fl.append_logs(%s, %s, 1, array['info'], array['hello'])", (w, running)
    )
    org = eng.val(
        "select p.org_id from fl.queues q join fl.projects p on p.id = q.project_id"
        " where q.id = %s",
        (q,),
    )
    eng.conn.execute("delete from fl.organizations where id = %s", (org,))
    for table in (
        "jobs",
        "attempts",
        "attempt_logs",
        "leases",
        "dead_letters",
        "queues",
        "queue_state",
        "retry_policies",
        "worker_queues",
    ):
        assert eng.val(f"select count(*) from fl.{table}") == 0, table
    # A policy still in use cannot be deleted on its own.
    q2 = eng.make_queue()
    with raises_sqlstate("23503"):
        eng.conn.execute(
            "delete from fl.retry_policies where id = (select retry_policy_id from fl.queues"
            " where id = %s)",
            (q2,),
        )
