"""fl.prune_events (migration 0013): the outbox's retention. It deletes only events older than
the retention whose writer finished before any still-running writer began, walks from the
oldest id and stops at the first event it must keep, records per project the greatest (txid,
id) it dropped (never moving it back), and runs in one scheduler at a time."""

from __future__ import annotations

import uuid

import psycopg
from psycopg.rows import dict_row

from .conftest import Engine, raises_sqlstate

DAY = 86400.0
PRUNE = "select fl.prune_events(%s, interval '7 days')"


def positions(eng: Engine, project: uuid.UUID) -> list[tuple[int, int]]:
    return [(int(r["txid"]), r["id"]) for r in eng.rows(
        "select txid::text, id from fl.events where project_id = %s order by txid, id",
        (project,))]


def project_of(eng: Engine, queue: uuid.UUID) -> uuid.UUID:
    return eng.val("select project_id from fl.queues where id = %s", (queue,))  # type: ignore[no-any-return]


def mark(eng: Engine, project: uuid.UUID) -> tuple[int, int] | None:
    rows = eng.rows("select txid::text, id from fl.events_retention where project_id = %s",
                    (project,))
    return (int(rows[0]["txid"]), rows[0]["id"]) if rows else None


def test_old_events_go_and_each_project_records_the_last_one_dropped(eng: Engine) -> None:
    q1, q2 = eng.make_queue(), eng.make_queue()
    p1, p2 = project_of(eng, q1), project_of(eng, q2)
    for _ in range(3):
        eng.submit(q1)
    for _ in range(2):
        eng.submit(q2)
    old1, old2 = positions(eng, p1), positions(eng, p2)
    eng.advance(8 * DAY)
    fresh = eng.submit(q1)
    assert eng.val(PRUNE, (100,)) == 5
    assert [r["job_id"] for r in eng.rows("select job_id from fl.events")] == [fresh]
    assert mark(eng, p1) == max(old1) and mark(eng, p2) == max(old2)
    assert eng.val(PRUNE, (100,)) == 0  # the fresh one is kept
    eng.advance(8 * DAY)
    assert eng.val(PRUNE, (100,)) == 1
    assert mark(eng, p1) > max(old1)


def test_a_running_writer_holds_back_what_could_commit_below_it(eng: Engine) -> None:
    q = eng.make_queue()
    holder = eng.connect(autocommit=False)
    holder.execute("select pg_current_xact_id()")  # a writer that began first, still running
    eng.submit(q)
    eng.advance(8 * DAY)
    assert eng.val(PRUNE, (100,)) == 0
    assert eng.val("select count(*) from fl.events") == 1
    holder.rollback()
    assert eng.val(PRUNE, (100,)) == 1


def test_the_walk_stops_at_the_first_event_it_keeps(eng: Engine) -> None:
    q = eng.make_queue()
    start = eng.now
    # Not one of the engine's connections, so its clock stays at the start.
    behind = psycopg.connect(eng.dsn, autocommit=True, row_factory=dict_row)
    behind.execute("select set_config('fl.testing', 'on', false),"
                   " set_config('fl.now', %s, false)", (start.isoformat(),))
    first = eng.submit(q)
    eng.advance(8 * DAY)
    young = eng.submit(q)
    late_old = behind.execute("select job_id from fl.submit(%s, 't')", (q,)).fetchone()
    assert late_old is not None
    eng.advance(3600)  # first and late_old are 8 days old, young one hour
    assert eng.val("select created_at from fl.events where job_id = %s",
                   (late_old["job_id"],)) == start
    # Ids come in insert order, so what follows a young event is young but for clock skew:
    # the pass stops there and leaves late_old for a later one.
    assert eng.val(PRUNE, (100,)) == 1
    assert sorted(r["job_id"] for r in eng.rows("select job_id from fl.events")) == sorted(
        [young, late_old["job_id"]])
    assert first not in [r["job_id"] for r in eng.rows("select job_id from fl.events")]
    behind.close()


def test_the_mark_never_moves_back_and_a_full_batch_is_the_limit(eng: Engine) -> None:
    q = eng.make_queue()
    p = project_of(eng, q)
    for _ in range(5):
        eng.submit(q)
    far = 2**40
    eng.rows("insert into fl.events_retention (project_id, txid, id) values (%s, %s::xid8, 7)"
             " returning project_id", (p, str(far)))
    eng.advance(8 * DAY)
    assert eng.val(PRUNE, (2,)) == 2
    assert eng.val(PRUNE, (2,)) == 2
    assert eng.val(PRUNE, (2,)) == 1
    assert mark(eng, p) == (far, 7)


def test_one_scheduler_at_a_time(eng: Engine) -> None:
    q = eng.make_queue()
    eng.submit(q)
    eng.advance(8 * DAY)
    other = eng.connect(autocommit=False)
    other.execute("select pg_advisory_xact_lock(26220, 22)")  # another scheduler's pass
    assert eng.val(PRUNE, (100,)) == 0
    other.rollback()
    assert eng.val(PRUNE, (100,)) == 1


def test_bad_arguments_change_nothing(eng: Engine) -> None:
    q = eng.make_queue()
    eng.submit(q)
    eng.advance(8 * DAY)
    for call in ("select fl.prune_events(0, interval '7 days')",
                 "select fl.prune_events(null, interval '7 days')",
                 "select fl.prune_events(100, interval '0 seconds')",
                 "select fl.prune_events(100, null)"):
        with raises_sqlstate("FL005"):
            eng.val(call)
    assert eng.val("select count(*) from fl.events") == 1
