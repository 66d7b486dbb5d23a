"""The state machine: the trigger refuses illegal edges and a falling fence; the edge table
matches what the functions actually do, in both directions."""

from __future__ import annotations

import pytest

from .conftest import Engine, raises_sqlstate


def _running_job(eng: Engine) -> int:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    eng.claim_one(q, w)
    return job


@pytest.mark.parametrize(
    ("start", "to"),
    [
        ("queued", "completed"),
        ("queued", "retry_wait"),
        ("queued", "scheduled"),
        ("completed", "queued"),
        ("cancelled", "queued"),
        ("retry_wait", "dead_letter"),
        ("dead_letter", "cancelled"),
        ("scheduled", "running"),
    ],
)
def test_trigger_rejects_illegal_status_changes(eng: Engine, start: str, to: str) -> None:
    q = eng.make_queue(policy={"max_attempts": 2, "base_delay_ms": 0, "max_delay_ms": 0})
    w = eng.worker(q)
    job = eng.submit(q, delay_s=60 if start == "scheduled" else None)
    if start in ("completed", "retry_wait", "dead_letter"):
        f = eng.claim_one(q, w)["fence"]
        if start == "completed":
            eng.complete(w, [(job, f)])
        else:
            eng.fail(w, job, f, "permanent" if start == "dead_letter" else "retryable")
    elif start == "cancelled":
        eng.cancel(job)
    assert eng.job(job)["status"] == start
    before = eng.job(job)
    with raises_sqlstate("FL100"):
        eng.conn.execute(
            "update fl.jobs set status = %s,"
            " finished_at = case when %s in ('completed', 'dead_letter', 'cancelled')"
            "                    then fl.now() end,"
            " deadline_at = case when %s = 'running' then fl.now() end,"
            " claimed_at = coalesce(claimed_at, fl.now())"
            " where id = %s",
            (to, to, to, job),
        )
    assert eng.job(job) == before


def test_trigger_rejects_a_fence_going_down(eng: Engine) -> None:
    job = _running_job(eng)
    with raises_sqlstate("FL101"):
        eng.conn.execute("update fl.jobs set fence = fence - 1 where id = %s", (job,))
    assert eng.job(job)["fence"] == 1


def test_jobs_are_born_waiting_with_fresh_counters(eng: Engine) -> None:
    q = eng.make_queue()
    p = eng.row("select project_id, retry_policy_id from fl.queues where id = %s", (q,))
    with raises_sqlstate("FL102"):
        eng.conn.execute(
            "insert into fl.jobs (project_id, queue_id, type, status, run_at, timeout_ms,"
            " retry_policy_id, fence) values (%s, %s, 't', 'queued', fl.now(), 1000, %s, 7)",
            (p["project_id"], q, p["retry_policy_id"]),
        )


def test_edge_table_and_guard_function_agree(eng: Engine) -> None:
    mismatched = eng.rows(
        "select f, t from unnest(enum_range(null::fl.job_status)) f,"
        " unnest(enum_range(null::fl.job_status)) t"
        " where fl.legal_transition(f, t) <> exists (select 1 from fl.job_transitions x"
        "  where x.from_status = f and x.to_status = t)"
    )
    assert mismatched == []


def test_functions_perform_exactly_the_edges_in_the_table(eng: Engine) -> None:
    """Record every status change while every function runs; compare with fl.job_transitions."""
    eng.conn.execute("""
        create table seen_edges (from_status fl.job_status, to_status fl.job_status);
        create function record_edge() returns trigger language plpgsql as $$
        begin
            insert into seen_edges values (old.status, new.status);
            return null;
        end $$;
        create trigger record_edge after update of status on fl.jobs for each row
            when (old.status is distinct from new.status) execute function record_edge();
    """)
    q = eng.make_queue(
        policy={"max_attempts": 1, "base_delay_ms": 0, "max_delay_ms": 0}, breaker_enabled=False
    )
    q2 = eng.make_queue(
        policy={"max_attempts": 5, "base_delay_ms": 0, "max_delay_ms": 0}, breaker_enabled=False
    )
    w = eng.worker([q, q2])

    def run(queue: object) -> tuple[int, int]:
        job = eng.submit(queue)  # type: ignore[arg-type]
        return job, eng.claim_one(queue, w)["fence"]  # type: ignore[arg-type]

    j, f = run(q)
    eng.complete(w, [(j, f)])  # running -> completed
    j, f = run(q)
    eng.fail(w, j, f, "permanent")  # running -> dead_letter
    assert eng.val("select outcome from fl.replay(%s)", (j,)) == "ok"  # dead_letter -> queued
    eng.cancel(j)  # queued -> cancelled
    j, f = run(q2)
    eng.fail(w, j, f, "retryable")  # running -> retry_wait
    assert eng.val("select outcome from fl.retry(%s)", (j,)) == "ok"  # retry_wait -> queued
    f = eng.claim_one(q2, w)["fence"]
    eng.fail(w, j, f, "retryable")
    eng.cancel(j)  # retry_wait -> cancelled
    j, f = run(q2)
    eng.fail(w, j, f, "retryable")
    eng.val("select fl.promote()")  # retry_wait -> queued (sweep)
    f = eng.claim_one(q2, w)["fence"]
    eng.release(w, [(j, f)])  # running -> queued
    f = eng.claim_one(q2, w)["fence"]
    eng.snooze(w, j, f, 60)  # running -> scheduled
    assert eng.val("select outcome from fl.retry(%s)", (j,)) == "ok"  # scheduled -> queued
    f = eng.claim_one(q2, w)["fence"]
    eng.snooze(w, j, f, 60)
    eng.cancel(j)  # scheduled -> cancelled
    j, f = run(q2)
    assert eng.cancel(j)["outcome"] == "cancel_requested"
    eng.fail(w, j, f, "retryable")  # running -> cancelled
    j, f = run(q)
    eng.advance(60)
    eng.reap()  # running -> dead_letter (reaper)

    seen = {(r["from_status"], r["to_status"]) for r in eng.rows("select * from seen_edges")}
    table = {
        (r["from_status"], r["to_status"])
        for r in eng.rows("select from_status, to_status from fl.job_transitions")
    }
    assert seen == table
