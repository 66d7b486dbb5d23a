"""Retry policies: backoff per kind (jitter off: exact), the three ceilings, the dead letter
with its history, replay, snooze and release giving their attempt back."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from .conftest import Engine


def _fail_n_times(
    eng: Engine, q: uuid.UUID, w: uuid.UUID, job: int, n: int, kind: str = "retryable"
) -> list[dict[str, Any]]:
    """Claim and fail the job n times, jumping to its run_at each time; the fail rows."""
    out = []
    for _ in range(n):
        eng.set_now(max(eng.now, eng.job(job)["run_at"]))
        f = eng.claim_one(q, w)["fence"]
        out.append(eng.fail(w, job, f, kind) | {"at": eng.now})
    return out


@pytest.mark.parametrize(
    ("kind", "expected_s"),
    [
        ("fixed", [2, 2, 2, 2, 2]),
        ("linear", [2, 4, 6, 8, 10]),
        ("exponential", [2, 4, 8, 16, 25]),
    ],  # capped at max_delay 25 s
)
def test_backoff_per_kind_is_exact_with_jitter_off(
    eng: Engine, kind: str, expected_s: list[int]
) -> None:
    q = eng.make_queue(
        policy={
            "kind": kind,
            "base_delay_ms": 2000,
            "max_delay_ms": 25000,
            "max_attempts": 10,
            "jitter": True,
        },
        breaker_enabled=False,
    )
    w = eng.worker(q)
    job = eng.submit(q)
    fails = _fail_n_times(eng, q, w, job, 5)
    assert [r["outcome"] for r in fails] == ["retry"] * 5
    assert [(r["run_at"] - r["at"]).total_seconds() for r in fails] == expected_s


def test_jitter_spreads_below_the_full_delay_when_on(eng: Engine) -> None:
    eng.conn.execute("set fl.jitter = 'on'")
    delays = {
        eng.val("select extract(epoch from fl.backoff('fixed', 10000, 10000, true, 1))")
        for _ in range(20)
    }
    assert len(delays) > 1 and all(0 <= d <= 10 for d in delays)
    eng.conn.execute("set fl.jitter = 'off'")
    assert eng.val("select extract(epoch from fl.backoff('fixed', 10000, 10000, true, 1))") == 10


def test_attempts_ceiling_dead_letters_with_full_history(eng: Engine) -> None:
    q = eng.make_queue(
        policy={"max_attempts": 3, "base_delay_ms": 0, "max_delay_ms": 0}, breaker_enabled=False
    )
    w = eng.worker(q)
    job = eng.submit(q)
    fails = _fail_n_times(eng, q, w, job, 3)
    assert [r["outcome"] for r in fails] == ["retry", "retry", "exhausted"]
    assert fails[-1]["reason"] == "attempts_exhausted"
    row = eng.job(job)
    assert row["status"] == "dead_letter" and row["finished_at"] is not None
    dl = eng.row("select * from fl.dead_letters where job_id = %s", (job,))
    assert dl["reason"] == "attempts_exhausted" and dl["error_message"] == "boom"
    hist = dl["attempt_history"]
    assert [h["attempt"] for h in hist] == [1, 2, 3]
    assert [h["outcome"] for h in hist] == ["retryable_error"] * 3
    assert all(h["finished_at"] is not None for h in hist)


def test_permanent_failure_dead_letters_at_once(eng: Engine) -> None:
    q = eng.make_queue(policy={"max_attempts": 10})
    w = eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    r = eng.fail(w, job, f, "permanent", "bad payload", "ValueError")
    assert (r["outcome"], r["status"], r["reason"]) == ("dead", "dead_letter", "permanent_error")
    dl = eng.row("select * from fl.dead_letters where job_id = %s", (job,))
    assert (dl["error_class"], dl["attempt_history"][0]["outcome"]) == (
        "ValueError",
        "permanent_error",
    )


def test_timeout_ceiling_is_separate(eng: Engine) -> None:
    q = eng.make_queue(
        policy={"max_attempts": 10, "max_timeouts": 2, "base_delay_ms": 0, "max_delay_ms": 0},
        breaker_enabled=False,
    )
    w = eng.worker(q)
    job = eng.submit(q)
    fails = _fail_n_times(eng, q, w, job, 2, kind="timeout")
    assert [r["outcome"] for r in fails] == ["retry", "exhausted"]
    assert fails[-1]["reason"] == "timeout_exhausted"
    assert eng.job(job)["timeout_count"] == 2


def test_lost_ceiling_is_separate(eng: Engine) -> None:
    q = eng.make_queue(
        policy={"max_attempts": 10, "max_lost": 2, "base_delay_ms": 0, "max_delay_ms": 0},
        breaker_enabled=False,
    )
    w = eng.worker(q)
    job = eng.submit(q)
    # a retryable error does not count against max_lost
    _fail_n_times(eng, q, w, job, 1)
    fails = _fail_n_times(eng, q, w, job, 2, kind="lost")
    assert [r["outcome"] for r in fails] == ["retry", "exhausted"]
    assert fails[-1]["reason"] == "lost_exhausted"


def test_a_job_lost_before_its_handler_ran_uses_an_attempt(eng: Engine) -> None:
    """A poison job that kills its worker before the handler starts dies at its ceiling."""
    q = eng.make_queue(
        policy={"max_attempts": 3, "max_lost": 10, "base_delay_ms": 0, "max_delay_ms": 0},
        breaker_enabled=False,
    )
    w = eng.worker(q)
    job = eng.submit(q)
    outcomes = []
    for _ in range(3):
        eng.claim_one(q, w, lease="10 seconds")  # ...and the process dies at once
        eng.advance(11)
        outcomes += [r["outcome"] for r in eng.reap()]
        assert eng.val("select count(*) from fl.leases") == 0
    assert outcomes == ["retry", "retry", "exhausted"]
    row = eng.job(job)
    assert (row["status"], row["attempts"], row["lost_count"]) == ("dead_letter", 3, 3)
    assert eng.row("select reason from fl.dead_letters")["reason"] == "attempts_exhausted"


def test_reaper_reports_an_overrun_deadline_as_timeout(eng: Engine) -> None:
    q = eng.make_queue(policy={"max_timeouts": 5}, breaker_enabled=False)
    w = eng.worker(q)
    job = eng.submit(q, timeout_ms=5000)
    eng.claim_one(q, w, lease="10 seconds")
    eng.advance(11)
    assert [r["outcome"] for r in eng.reap()] == ["retry"]
    row = eng.job(job)
    assert (row["timeout_count"], row["lost_count"]) == (1, 0)
    assert eng.val("select outcome::text from fl.attempts where job_id = %s", (job,)) == "timeout"


def test_replay_resets_attempts_bumps_generation_and_keeps_history(eng: Engine) -> None:
    q = eng.make_queue(
        policy={"max_attempts": 2, "base_delay_ms": 0, "max_delay_ms": 0}, breaker_enabled=False
    )
    w = eng.worker(q)
    job = eng.submit(q)
    _fail_n_times(eng, q, w, job, 2)
    dead = eng.job(job)
    assert dead["status"] == "dead_letter" and dead["attempts"] == 2
    assert eng.row("select * from fl.replay(%s)", (job,))["outcome"] == "ok"
    row = eng.job(job)
    assert (row["status"], row["attempts"], row["replay_generation"]) == ("queued", 0, 1)
    assert row["fence"] == dead["fence"] + 1 and row["finished_at"] is None
    assert eng.val("select replayed_at from fl.dead_letters where job_id = %s", (job,)) == eng.now
    # It dies again: a second dead letter row, the history now spans both generations.
    _fail_n_times(eng, q, w, job, 2)
    dls = eng.rows("select * from fl.dead_letters where job_id = %s order by id", (job,))
    assert [d["replay_generation"] for d in dls] == [0, 1]
    assert [d["replayed_at"] is None for d in dls] == [False, True]
    assert [(h["generation"], h["attempt"]) for h in dls[1]["attempt_history"]] == [
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
    ]
    assert eng.val("select count(*) from fl.attempts where job_id = %s", (job,)) == 4


def test_bulk_replay_takes_still_dead_jobs_oldest_first_within_depth_room(eng: Engine) -> None:
    q = eng.make_queue(policy={"max_attempts": 1}, max_depth=3, breaker_enabled=False)
    w = eng.worker(q)
    dead = []
    for _ in range(4):
        job = eng.submit(q)
        f = eng.claim_one(q, w)["fence"]
        eng.fail(w, job, f, "retryable")
        dead.append(job)
        eng.advance(1)
    waiting = eng.submit(q)  # one slot of depth used
    rows = eng.rows("select * from fl.replay_dead(%s, 10)", (q,))
    assert [r["job_id"] for r in rows] == dead[:2]
    assert eng.val("select count(*) from fl.events where topic = 'jobs.replayed'") == 1
    full = eng.rows("select * from fl.replay_dead(%s, 10)", (q,))
    assert [(r["job_id"], r["outcome"]) for r in full] == [(None, "queue_full")]
    assert waiting


def test_retry_runs_a_waiting_job_now(eng: Engine) -> None:
    q = eng.make_queue(policy={"base_delay_ms": 60000, "max_delay_ms": 60000})
    w = eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    eng.fail(w, job, f, "retryable")
    assert eng.claim(q, w) == []
    assert eng.row("select * from fl.retry(%s)", (job,))["outcome"] == "ok"
    assert eng.claim_one(q, w)["job_id"] == job
    assert eng.row("select * from fl.retry(%s)", (job,))["outcome"] == "conflict"
    assert eng.row("select * from fl.retry(%s)", (-1,))["outcome"] == "not_found"


def test_snooze_gives_the_attempt_back_and_raises_the_fence(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    r = eng.snooze(w, job, f, 30)
    assert (r["outcome"], r["status"]) == ("ok", "scheduled")
    row = eng.job(job)
    assert (row["attempts"], row["snooze_count"], row["fence"]) == (0, 1, f + 1)
    assert eng.claim(q, w) == []
    eng.advance(30)
    again = eng.claim_one(q, w)
    assert (again["attempt"], again["fence"]) == (1, f + 2)


def test_snoozing_past_the_cap_dead_letters_with_a_clear_reason(eng: Engine) -> None:
    q = eng.make_queue(policy={"max_snoozes": 2})
    w = eng.worker(q)
    job = eng.submit(q)
    outcomes = []
    for _ in range(3):
        f = eng.claim_one(q, w)["fence"]
        outcomes.append(eng.snooze(w, job, f, 0)["outcome"])
    assert outcomes == ["ok", "ok", "exhausted"]
    assert eng.job(job)["status"] == "dead_letter"
    assert eng.row("select reason from fl.dead_letters")["reason"] == "snoozes_exhausted"
    assert eng.val("select count(*) from fl.leases") == 0


def test_release_for_drain_uses_no_attempt(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    jobs = [eng.submit(q) for _ in range(3)]
    held = [(r["job_id"], r["fence"]) for r in eng.claim(q, w, n=3)]
    assert eng.release(w, held) == ["ok", "ok", "ok"]
    for job, fence in held:
        row = eng.job(job)
        assert (row["status"], row["attempts"], row["fence"]) == ("queued", 0, fence + 1)
    assert eng.val("select count(*) from fl.leases") == 0
    assert {r["outcome"] for r in eng.rows("select outcome::text from fl.attempts")} == {"released"}
    # They come back in their old order, as attempt 1.
    again = eng.claim(q, w, n=3)
    assert [r["job_id"] for r in again] == jobs and {r["attempt"] for r in again} == {1}
