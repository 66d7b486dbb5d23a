"""Dependencies at the SQL level: waiting, counting off, cascades, no cycles, concurrency."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from tests.engine.conftest import Engine, Row, raises_sqlstate


def submit(eng: Engine, queue: uuid.UUID, type_: str = "t", *, deps: list[int] | None = None,
           conn: psycopg.Connection[Row] | None = None, **kw: Any) -> Row:
    c = conn or eng.conn
    args = {"p_queue": queue, "p_type": type_, "p_payload": Jsonb({}), "p_depends_on": deps} | {
        f"p_{k}": v for k, v in kw.items()}
    names = ", ".join(f"{k} => %({k})s" for k in args)
    row = c.execute(f"select * from fl.submit_job({names})", args).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return row


def job_id(eng: Engine, queue: uuid.UUID, type_: str = "t", **kw: Any) -> int:
    row = submit(eng, queue, type_, **kw)
    assert row["outcome"] == "ok", row
    return row["job_id"]  # type: ignore[no-any-return]


def run(eng: Engine, queue: uuid.UUID, worker: uuid.UUID, jid: int) -> int:
    """Claim exactly ``jid`` (by type) and return its fence."""
    t = eng.job(jid)["type"]
    got = eng.claim_one(queue, worker, types=[t])
    assert got["job_id"] == jid
    return got["fence"]  # type: ignore[no-any-return]


def status(eng: Engine, jid: int) -> tuple[str, int]:
    j = eng.job(jid)
    return j["status"], j["pending_deps"]


def test_child_waits_for_every_parent_then_is_queued(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    a, b = job_id(eng, q, "a"), job_id(eng, q, "b")
    child = job_id(eng, q, "c", deps=[a, b])
    assert status(eng, child) == ("scheduled", 2)
    assert eng.job(a)["has_dependents"] and not eng.job(child)["has_dependents"]
    assert eng.complete(w, [(a, run(eng, q, w, a))]) == ["ok"]
    assert status(eng, child) == ("scheduled", 1)
    assert eng.claim(q, w, types=["c"]) == []
    assert eng.complete(w, [(b, run(eng, q, w, b))]) == ["ok"]
    assert status(eng, child) == ("queued", 0)
    promoted = eng.rows("select payload from fl.events where topic = 'jobs.promoted'")
    assert [p["payload"] for p in promoted] == [{"jobs": [child], "parent": b}]
    assert run(eng, q, w, child) == 1


def test_last_parent_before_run_at_leaves_the_child_to_the_promoter(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    a = job_id(eng, q, "a")
    child = job_id(eng, q, "c", deps=[a], delay_ms=60_000)
    eng.complete(w, [(a, run(eng, q, w, a))])
    assert status(eng, child) == ("scheduled", 0)
    assert eng.val("select fl.promote()") == 0
    eng.advance(61)
    assert eng.val("select fl.promote()") == 1
    assert status(eng, child) == ("queued", 0)


def test_a_completed_parent_is_already_satisfied(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    a = job_id(eng, q, "a")
    eng.complete(w, [(a, run(eng, q, w, a))])
    child = job_id(eng, q, "c", deps=[a])
    assert status(eng, child) == ("queued", 0)
    assert eng.rows("select child_id, parent_id from fl.job_dependencies") == [
        {"child_id": child, "parent_id": a}]


def test_dead_letter_cancels_every_waiting_descendant(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    root, other = job_id(eng, q, "root"), job_id(eng, q, "other")
    child = job_id(eng, q, "c", deps=[root])
    grandchild = job_id(eng, q, "g", deps=[child, other])   # a diamond through `other`
    great = job_id(eng, q, "gg", deps=[grandchild, child])
    bystander = job_id(eng, q, "b", deps=[other])
    fence = run(eng, q, w, root)
    assert eng.fail(w, root, fence, "permanent")["outcome"] == "dead"
    for jid in (child, grandchild, great):
        j = eng.job(jid)
        assert (j["status"], j["pending_deps"], j["fence"]) == ("cancelled", 0, 1)
        assert j["finished_at"] is not None
    assert status(eng, bystander) == ("scheduled", 1)
    assert status(eng, other) == ("queued", 0)
    events = eng.rows("select job_id, payload from fl.events where topic = 'job.cancelled'"
                      " order by job_id")
    assert events == [{"job_id": jid, "payload": {"from": "scheduled", "reason": "parent_failed",
                                                  "ancestor": root, "fence": 1}}
                      for jid in (child, grandchild, great)]
    # The other parent finishing later touches nothing cancelled.
    eng.complete(w, [(other, run(eng, q, w, other))])
    assert status(eng, grandchild) == ("cancelled", 0)
    assert status(eng, bystander) == ("queued", 0)


def test_cancelling_a_parent_cascades_whatever_its_state(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    waiting = job_id(eng, q, "a")
    c1 = job_id(eng, q, "c1", deps=[waiting])
    assert eng.cancel(waiting)["outcome"] == "ok"
    assert status(eng, c1) == ("cancelled", 0)
    # A running parent: the cancel takes effect when the worker reports, and cascades then.
    running = job_id(eng, q, "r")
    c2 = job_id(eng, q, "c2", deps=[running])
    fence = run(eng, q, w, running)
    assert eng.cancel(running)["outcome"] == "cancel_requested"
    assert status(eng, c2) == ("scheduled", 1)
    assert eng.fail(w, running, fence)["outcome"] == "cancelled"
    assert status(eng, c2) == ("cancelled", 0)


def test_a_child_waiting_on_parents_can_be_cancelled(eng: Engine) -> None:
    """Reference W1: the cancel used to break jobs_deps_only_scheduled (500)."""
    q = eng.make_queue()
    w = eng.worker(q)
    a = job_id(eng, q, "a")
    child = job_id(eng, q, "c", deps=[a])
    assert eng.cancel(child) == {"outcome": "ok", "status": "cancelled"}
    assert status(eng, child) == ("cancelled", 0)
    eng.complete(w, [(a, run(eng, q, w, a))])
    assert status(eng, child) == ("cancelled", 0)


def test_a_failed_parent_refuses_the_child_and_writes_nothing(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    dead, cancelled = job_id(eng, q, "d"), job_id(eng, q, "x")
    eng.fail(w, dead, run(eng, q, w, dead), "permanent")
    eng.cancel(cancelled)
    before = eng.snapshot()
    for parent, state in ((dead, "dead_letter"), (cancelled, "cancelled")):
        row = submit(eng, q, "c", deps=[parent])
        assert row["outcome"] == "parent_failed" and row["job_id"] is None
        assert f"parent job {parent} is {state}" in row["detail"]
    assert eng.snapshot() == before


def test_replaying_a_dead_parent_does_not_revive_cancelled_children(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    a = job_id(eng, q, "a")
    child = job_id(eng, q, "c", deps=[a])
    eng.fail(w, a, run(eng, q, w, a), "permanent")
    assert status(eng, child) == ("cancelled", 0)
    assert eng.row("select * from fl.replay(%s)", (a,))["outcome"] == "ok"
    eng.complete(w, [(a, run(eng, q, w, a))])
    assert status(eng, child) == ("cancelled", 0)


def test_unknown_and_foreign_parents_get_one_answer(eng: Engine) -> None:
    q, theirs = eng.make_queue(), eng.make_queue()   # two projects
    foreign = job_id(eng, theirs, "secret")
    missing = foreign + 1000
    before = eng.snapshot()
    messages = []
    for parent in (foreign, missing):
        with raises_sqlstate("FL011") as err:
            submit(eng, q, "c", deps=[parent])
        assert err.error is not None
        messages.append(str(err.error.diag.message_primary).replace(str(parent), "N"))
    assert messages[0] == messages[1]
    assert eng.snapshot() == before
    with raises_sqlstate("FL005"):
        submit(eng, q, "c", deps=[foreign, foreign])
    assert eng.job(foreign)["has_dependents"] is False


def test_no_cycle_can_be_formed(eng: Engine) -> None:
    """Every edge points from a job to one created before it, so the graph is acyclic (W4).

    The only ways to name a job are its id (it must exist already, so it is older) or, in a
    batch, the index of an earlier entry; an id not yet issued is unknown (FL011) and a later
    or own index is refused (FL005).
    """
    q = eng.make_queue()
    ids = [job_id(eng, q, "root")]
    for i in range(20):
        ids.append(job_id(eng, q, f"j{i}", deps=sorted({ids[i // 2], ids[-1]})))
    batch = eng.rows(
        "select * from fl.submit_batch(%s, %s)",
        (q, Jsonb([{"type": "b0", "depends_on": [ids[3]]},
                   {"type": "b1", "depends_on_batch": [0], "depends_on": [ids[-1]]},
                   {"type": "b2", "depends_on_batch": [0, 1]}])))
    assert [r["outcome"] for r in batch] == ["ok"] * 3
    next_id = eng.val("select last_value + 1 from fl.jobs_id_seq")
    with raises_sqlstate("FL011"):
        submit(eng, q, "self", deps=[next_id])
    for forward in ([{"type": "x", "depends_on_batch": [1]}, {"type": "y"}],
                    [{"type": "x", "depends_on_batch": [0]}]):
        with raises_sqlstate("FL005"):
            eng.rows("select * from fl.submit_batch(%s, %s)", (q, Jsonb(forward)))
    assert eng.val("select count(*) from fl.job_dependencies where child_id <= parent_id") == 0
    cyclic = eng.val(
        "with recursive walk(start, id, path) as ("
        "  select child_id, parent_id, array[child_id] from fl.job_dependencies"
        "  union all"
        "  select w.start, d.parent_id, w.path || w.id from walk w"
        "    join fl.job_dependencies d on d.child_id = w.id where not w.id = any(w.path))"
        " select count(*) from walk where id = start")
    assert cyclic == 0


def test_two_parents_completing_at_once_queue_the_child_exactly_once(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    a, b = job_id(eng, q, "a"), job_id(eng, q, "b")
    child = job_id(eng, q, "c", deps=[a, b])
    fa, fb = run(eng, q, w, a), run(eng, q, w, b)
    one, two = eng.connect(autocommit=False), eng.connect(autocommit=False)
    assert eng.complete(w, [(a, fa)], conn=one) == ["ok"]       # holds the child's row lock
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(eng.complete(w, [(b, fb)], conn=two)))
    t.start()
    t.join(0.5)
    assert t.is_alive(), "the second completion should wait for the first's lock on the child"
    one.commit()
    t.join(10)
    two.commit()
    assert result == [["ok"]]
    assert status(eng, child) == ("queued", 0)
    promoted = eng.rows("select payload from fl.events where topic = 'jobs.promoted'")
    assert [p["payload"]["jobs"] for p in promoted] == [[child]]


def test_a_parent_finishing_during_the_child_submission_is_not_missed(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    a = job_id(eng, q, "a")
    fa = run(eng, q, w, a)
    sub, done = eng.connect(autocommit=False), eng.connect(autocommit=False)
    child = job_id(eng, q, "c", deps=[a], conn=sub)      # locks the parent until commit
    t = threading.Thread(target=lambda: eng.complete(w, [(a, fa)], conn=done))
    t.start()
    t.join(0.5)
    assert t.is_alive()
    sub.commit()
    t.join(10)
    done.commit()
    assert status(eng, child) == ("queued", 0)


def test_the_trigger_does_not_fire_for_jobs_without_dependents(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    a = job_id(eng, q, "a")
    c = eng.connect(autocommit=False)
    c.execute("set track_functions = 'pl'")
    eng.complete(w, [(a, run(eng, q, w, a))], conn=c)
    calls = c.execute("select count(*) as n from pg_stat_xact_user_functions"
                      " where funcname = 'jobs_settle_dependents'").fetchone()
    assert calls == {"n": 0}
    c.rollback()


def test_batch_one_statement_one_event_in_batch_dependencies(eng: Engine) -> None:
    q = eng.make_queue()
    w = eng.worker(q)
    rows = eng.rows(
        "select * from fl.submit_batch(%s, %s)",
        (q, Jsonb([{"type": "extract", "priority": 5},
                   {"type": "load", "depends_on_batch": [0], "timeout_ms": 1000},
                   {"type": "later", "run_at": (eng.now + timedelta(hours=1)).isoformat()}])))
    assert [r["status"] for r in rows] == ["queued", "scheduled", "scheduled"]
    ids = [r["job_id"] for r in rows]
    assert ids == sorted(ids) and len({r["batch_id"] for r in rows}) == 1
    load = eng.job(ids[1])
    assert (load["pending_deps"], load["timeout_ms"]) == (1, 1000)
    assert eng.job(ids[0])["priority"] == 5 and eng.job(ids[0])["has_dependents"]
    events = eng.rows("select topic, payload from fl.events")
    assert [e["topic"] for e in events] == ["jobs.submitted"]
    assert [j[0] for j in events[0]["payload"]["jobs"]] == ids
    eng.complete(w, [(ids[0], run(eng, q, w, ids[0]))])
    assert status(eng, ids[1]) == ("queued", 0)
    progress = eng.row("select * from fl.batch_progress(%s)", (rows[0]["batch_id"],))
    assert (progress["total"], progress["done"]) == (3, 1)
    assert progress["status_counts"] == {"completed": 1, "queued": 1, "scheduled": 1}


def test_depth_cap_counts_run_at_and_comes_after_the_key(eng: Engine) -> None:
    q = eng.make_queue(max_depth=2)
    key = {"idempotency_key": "k1", "fingerprint": b"\x01"}
    first = submit(eng, q, "a", **key)
    assert first["outcome"] == "ok"
    later = (eng.now + timedelta(days=1)).isoformat()
    assert submit(eng, q, "b", run_at=later)["outcome"] == "ok"
    full = submit(eng, q, "c", run_at=later)
    assert full["outcome"] == "queue_full" and full["job_id"] is None
    again = submit(eng, q, "a", **key)
    assert (again["outcome"], again["job_id"]) == ("existing", first["job_id"])
    assert submit(eng, q, "a", idempotency_key="k1", fingerprint=b"\x02")["outcome"] == \
        "idempotency_conflict"
    batch = eng.row("select * from fl.submit_batch(%s, %s)", (q, Jsonb([{"type": "z"}])))
    assert batch["outcome"] == "queue_full"


def test_an_expired_key_is_new_again(eng: Engine) -> None:
    q = eng.make_queue()
    key = {"idempotency_key": "k", "fingerprint": b"\x01"}
    first = submit(eng, q, "a", **key)["job_id"]
    eng.advance(24 * 3600)
    second = submit(eng, q, "a", **key)
    assert second["outcome"] == "ok" and second["job_id"] != first
    assert eng.val("select count(*) from fl.idempotency_keys") == 1


def test_concurrent_first_uses_of_a_key_make_one_job(eng: Engine) -> None:
    q = eng.make_queue()
    one, two = eng.connect(autocommit=False), eng.connect(autocommit=False)
    key = {"idempotency_key": "same", "fingerprint": b"\x07"}
    first = submit(eng, q, "a", conn=one, **key)
    result: list[Row] = []
    t = threading.Thread(target=lambda: result.append(submit(eng, q, "a", conn=two, **key)))
    t.start()
    t.join(0.5)
    assert t.is_alive()
    one.commit()
    t.join(10)
    two.commit()
    assert first["outcome"] == "ok"
    assert (result[0]["outcome"], result[0]["job_id"]) == ("existing", first["job_id"])
    assert eng.val("select count(*) from fl.jobs") == 1
