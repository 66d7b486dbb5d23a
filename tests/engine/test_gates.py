"""The claim gates: the concurrency cap under 32 concurrent claimers, the token bucket, and
the circuit breaker (closed, open, half open with exactly one probe, no stuck probe, no
stale window)."""

from __future__ import annotations

import random
import threading
import uuid

from .conftest import Engine


def test_cap_holds_under_32_concurrent_claimers(eng: Engine) -> None:
    cap = 5
    q = eng.make_queue(max_concurrency=cap, breaker_enabled=False)
    w = eng.worker(q, concurrency=1000)
    total = 600
    for _ in range(total):
        eng.submit(q)
    # Inside each claim, under the queue's gate lock, record how many leases the queue holds:
    # every earlier claim has committed and completions only lower the count, so this is an
    # upper bound of what was in flight at that moment.
    eng.conn.execute("""
        create table cap_probe (n integer);
        create function cap_probe() returns trigger language plpgsql as $$
        begin
            insert into cap_probe select count(*) from fl.leases where queue_id = new.queue_id;
            return null;
        end $$;
        create trigger cap_probe after insert on fl.leases
            for each row execute function cap_probe();
    """)
    lock = threading.Lock()
    held_now = 0
    max_seen = 0
    done = 0
    errors: list[BaseException] = []

    def claimer(seed: int) -> None:
        nonlocal held_now, max_seen, done
        rnd = random.Random(seed)
        conn = eng.connect()
        try:
            while True:
                with lock:
                    if done >= total:
                        return
                got = eng.claim(q, w, n=rnd.randint(1, 4), conn=conn)
                if not got:
                    continue
                with lock:
                    held_now += len(got)
                    max_seen = max(max_seen, held_now)
                # ...the handlers run; lower the count before the completion commits, so
                # held_now never undercounts what the database has running.
                with lock:
                    held_now -= len(got)
                    done += len(got)
                assert eng.complete(w, [(r["job_id"], r["fence"]) for r in got], conn=conn) == (
                    ["ok"] * len(got)
                )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert eng.val("select count(*) from fl.jobs where status = 'completed'") == total
    probe_max = eng.val("select max(n) from cap_probe")
    assert probe_max <= cap
    assert probe_max == cap  # the cap was actually reached, so the test bit
    assert max_seen <= cap
    assert eng.val("select count(*) from fl.attempts") == total  # no job claimed twice


def test_rate_limit_admits_within_ten_percent_of_its_rate(eng: Engine) -> None:
    rate, burst, window = 5.0, 5.0, 60.0
    q = eng.make_queue(rl_rate=rate, rl_burst=burst, breaker_enabled=False)
    w = eng.worker(q)
    for _ in range(1000):
        eng.submit(q)
    admitted = 0
    steps = int(window / 0.05)
    for _ in range(steps):  # a worker polling every 50 ms for as many as it likes
        got = eng.claim(q, w, n=100)
        admitted += len(got)
        if got:
            eng.complete(w, [(r["job_id"], r["fence"]) for r in got])
        eng.advance(0.05)
    expected = burst + rate * window
    assert abs(admitted - expected) <= 0.1 * expected, admitted
    rows = eng.claim_rows(q, w)
    if rows[0]["outcome"] == "rate_limited":
        assert rows[0]["retry_at"] > eng.now


def test_rate_limit_takes_tokens_only_for_jobs_claimed(eng: Engine) -> None:
    """Polling an empty queue does not drain the bucket (reference W4)."""
    q = eng.make_queue(rl_rate=1.0, rl_burst=3.0)
    w = eng.worker(q)
    for _ in range(50):
        assert eng.claim_rows(q, w)[0]["outcome"] == "empty"
    for _ in range(3):
        eng.submit(q)
    assert len(eng.claim(q, w, n=10)) == 3
    eng.submit(q)
    assert eng.claim_rows(q, w)[0]["outcome"] == "rate_limited"
    eng.advance(1)
    assert len(eng.claim(q, w)) == 1


def _breaker_queue(eng: Engine) -> tuple[uuid.UUID, uuid.UUID]:
    q = eng.make_queue(
        policy={"max_attempts": 100, "base_delay_ms": 0, "max_delay_ms": 0},
        breaker_min_volume=4,
        breaker_failure_ratio=0.5,
        breaker_window_ms=60000,
        breaker_cooldown_ms=30000,
    )
    return q, eng.worker(q)


def _run(eng: Engine, q: uuid.UUID, w: uuid.UUID, ok: bool) -> int:
    job = eng.submit(q)
    f = eng.claim_one(q, w)["fence"]
    if ok:
        assert eng.complete(w, [(job, f)]) == ["ok"]
    else:
        assert eng.fail(w, job, f, "retryable")["outcome"] in ("retry", "exhausted")
        eng.cancel(job)  # keep the queue clean for the next probe
    return job


def _state(eng: Engine, q: uuid.UUID) -> str:
    return eng.val("select breaker_state::text from fl.queue_state where queue_id = %s", (q,))  # type: ignore[no-any-return]


def test_breaker_opens_on_failure_ratio_and_refuses_claims(eng: Engine) -> None:
    q, w = _breaker_queue(eng)
    for _ in range(3):
        _run(eng, q, w, ok=False)
    assert _state(eng, q) == "closed"
    _run(eng, q, w, ok=False)
    assert _state(eng, q) == "open"
    eng.submit(q)
    rows = eng.claim_rows(q, w)
    assert rows[0]["outcome"] == "breaker_open"
    assert (rows[0]["retry_at"] - eng.now).total_seconds() == 30
    topics = [
        r["topic"] for r in eng.rows("select topic from fl.events where topic like 'queue.%'")
    ]
    assert topics == ["queue.breaker_opened"]


def test_breaker_does_not_open_below_the_ratio(eng: Engine) -> None:
    q, w = _breaker_queue(eng)
    for ok in [False, True, True, False, True, True, False, True, True, False, True]:
        _run(eng, q, w, ok=ok)
    assert _state(eng, q) == "closed"


def test_half_open_lets_exactly_one_probe_through_and_recovers(eng: Engine) -> None:
    q, w = _breaker_queue(eng)
    for _ in range(4):
        _run(eng, q, w, ok=False)
    jobs = [eng.submit(q) for _ in range(10)]
    eng.advance(30)
    # 8 concurrent claimers asking for 5 each: exactly one job goes out.
    got: list[dict[str, object]] = []
    lock = threading.Lock()

    def claim() -> None:
        c = eng.connect()
        r = eng.claim(q, w, n=5, conn=c)
        with lock:
            got.extend(r)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 1 and _state(eng, q) == "half_open"
    assert eng.claim_rows(q, w)[0]["outcome"] == "probe_in_flight"
    probe = got[0]
    assert eng.complete(w, [(probe["job_id"], probe["fence"])]) == ["ok"]  # type: ignore[list-item]
    assert _state(eng, q) == "closed"
    assert len(eng.claim(q, w, n=20)) == len(jobs) - 1


def test_a_failed_probe_reopens_the_breaker(eng: Engine) -> None:
    q, w = _breaker_queue(eng)
    for _ in range(4):
        _run(eng, q, w, ok=False)
    eng.advance(30)
    _run(eng, q, w, ok=False)
    assert _state(eng, q) == "open"
    assert eng.claim_rows(q, w)[0]["outcome"] == "breaker_open"


def test_a_lost_probe_frees_the_probe_slot(eng: Engine) -> None:
    """The reference's probe budget was never returned when the probe vanished (W2)."""
    q, w = _breaker_queue(eng)
    for _ in range(4):
        _run(eng, q, w, ok=False)
    eng.submit(q)
    eng.advance(30)
    eng.claim_one(q, w, lease="10 seconds")  # the probe; its worker dies
    assert eng.claim_rows(q, w)[0]["outcome"] == "probe_in_flight"
    eng.advance(11)
    assert [r["outcome"] for r in eng.reap()] == ["retry"]
    assert _state(eng, q) == "open"  # a lost probe is a failed probe...
    eng.advance(30)
    assert len(eng.claim(q, w)) == 1  # ...and the next probe goes out on time


def test_a_snoozed_released_or_cancelled_probe_frees_the_slot(eng: Engine) -> None:
    q, w = _breaker_queue(eng)
    for _ in range(4):
        _run(eng, q, w, ok=False)
    for _ in range(3):
        eng.submit(q)
    eng.advance(30)
    p = eng.claim_one(q, w)
    eng.snooze(w, p["job_id"], p["fence"], 600)
    p = eng.claim_one(q, w)
    eng.release(w, [(p["job_id"], p["fence"])])
    eng.cancel(p["job_id"])
    p = eng.claim_one(q, w)
    assert eng.cancel(p["job_id"])["outcome"] == "cancel_requested"
    assert eng.release(w, [(p["job_id"], p["fence"])]) == ["cancelled"]
    assert _state(eng, q) == "half_open"
    eng.submit(q)
    assert len(eng.claim(q, w)) == 1


def test_an_empty_half_open_claim_does_not_use_up_the_probe(eng: Engine) -> None:
    q, w = _breaker_queue(eng)
    for _ in range(4):
        _run(eng, q, w, ok=False)
    eng.advance(30)
    assert eng.claim_rows(q, w)[0]["outcome"] == "empty"
    assert eng.claim_rows(q, w, types=["other"])[0]["outcome"] == "empty"
    eng.submit(q)
    assert len(eng.claim(q, w)) == 1


def test_breaker_sweep_frees_a_probe_whose_job_moved_on(eng: Engine) -> None:
    q, w = _breaker_queue(eng)
    for _ in range(4):
        _run(eng, q, w, ok=False)
    eng.submit(q)
    eng.advance(30)
    p = eng.claim_one(q, w)
    # By hand, behind the engine's back: the probe's job disappears.
    eng.conn.execute("delete from fl.jobs where id = %s", (p["job_id"],))
    assert eng.claim_rows(q, w)[0]["outcome"] == "probe_in_flight"
    assert eng.val("select fl.breaker_sweep()") == 1
    eng.submit(q)
    assert len(eng.claim(q, w)) == 1


def test_after_closing_old_failures_do_not_reopen_the_breaker(eng: Engine) -> None:
    """The reference's window of the last 20 outcomes kept the failures after closing (W3)."""
    q, w = _breaker_queue(eng)
    for _ in range(4):
        _run(eng, q, w, ok=False)
    eng.advance(30)
    _run(eng, q, w, ok=True)  # the probe succeeds: closed
    assert _state(eng, q) == "closed"
    _run(eng, q, w, ok=False)  # one new failure is not 4
    assert _state(eng, q) == "closed"
    assert eng.val("select fl.breaker_sweep()") == 0
    assert _state(eng, q) == "closed"


def test_switching_the_breaker_off_lets_claims_through_at_once(eng: Engine) -> None:
    q, w = _breaker_queue(eng)
    for _ in range(4):
        _run(eng, q, w, ok=False)
    eng.submit(q)
    assert eng.claim_rows(q, w)[0]["outcome"] == "breaker_open"
    eng.conn.execute("update fl.queues set breaker_enabled = false where id = %s", (q,))
    assert len(eng.claim(q, w)) == 1
    assert eng.val("select fl.breaker_sweep()") == 1
    assert _state(eng, q) == "closed"
