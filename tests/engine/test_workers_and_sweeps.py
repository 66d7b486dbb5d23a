"""Workers' registry and liveness, per-attempt log lines, the orphan sweep, and sweeps being
single-runner."""

from __future__ import annotations

import threading

from .conftest import Engine


def test_worker_liveness_dead_and_back(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q, handlers=["b", "a", "a"])
    row = eng.row("select * from fl.workers where id = %s", (w,))
    assert (row["handlers"], row["state"]) == (["a", "b"], "active")
    eng.advance(59)
    assert eng.val("select fl.mark_dead_workers('60 seconds')") == 0
    eng.advance(2)
    assert eng.val("select fl.mark_dead_workers('60 seconds')") == 1
    eng.submit(q, "a")
    assert [r["outcome"] for r in eng.claim_rows(q, w)] == ["worker_inactive"]
    assert eng.val("select fl.worker_heartbeat(%s)", (w,)) == "ok"  # heard from again
    assert eng.val("select state from fl.workers where id = %s", (w,)) == "active"
    assert len(eng.claim(q, w, types=["a"])) == 1


def test_log_lines_belong_to_an_attempt_of_their_worker(eng: Engine) -> None:
    q = eng.make_queue()
    w, other = eng.worker(q), eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    call = "select fl.append_logs(%s, %s, %s, %s, %s)"
    assert eng.val(call, (w, job, f, ["info", "error"], ["one", "two"])) == "ok"
    assert eng.val(call, (other, job, f, ["info"], ["not mine"])) == "not_found"
    assert eng.val(call, (w, job, f + 1, ["info"], ["no such attempt"])) == "not_found"
    eng.complete(w, [(job, f)])
    assert eng.val(call, (w, job, f, ["debug"], ["after the report"])) == "ok"
    lines = eng.rows(
        "select level, message from fl.attempt_logs where job_id = %s order by id", (job,)
    )
    assert [(r["level"], r["message"]) for r in lines] == [
        ("info", "one"),
        ("error", "two"),
        ("debug", "after the report"),
    ]


def test_orphan_sweep_repairs_a_lease_left_by_hand(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    assert eng.val("select fl.sweep_orphans()") == 0
    # Behind the engine's back: the job is put back without its lease being removed.
    eng.conn.execute("alter table fl.jobs disable trigger jobs_guard")
    eng.conn.execute(
        "update fl.jobs set status = 'queued', deadline_at = null where id = %s", (job,)
    )
    eng.conn.execute("alter table fl.jobs enable trigger jobs_guard")
    assert eng.val("select fl.sweep_orphans()") == 1
    assert eng.in_flight(q) == 0
    att = eng.row("select * from fl.attempts where job_id = %s and fence = %s", (job, f))
    assert (att["outcome"], att["error_class"]) == ("lost", "orphan_lease")


def test_a_sweep_runs_once_however_many_schedulers_call_it(eng: Engine) -> None:
    q = eng.make_queue(breaker_enabled=False)
    w = eng.worker(q)
    for _ in range(10):
        eng.submit(q)
    eng.claim(q, w, n=10, lease="10 seconds")
    eng.advance(11)
    holder = eng.connect(autocommit=False)
    assert len(eng.reap(conn=holder)) == 10  # holds the reaper's key until it commits
    assert eng.reap() == []  # a second scheduler skips, it does not wait
    holder.rollback()
    results: list[int] = []
    lock = threading.Lock()

    def reap() -> None:
        got = len(eng.reap(conn=eng.connect()))
        with lock:
            results.append(got)

    threads = [threading.Thread(target=reap) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(results) == 10  # each job reaped exactly once
    assert eng.val("select count(*) from fl.jobs where status = 'retry_wait'") == 10
