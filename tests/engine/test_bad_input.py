"""Bad input to every fl.* function raises its documented SQLSTATE and changes nothing.

docs/SCHEMA.md lists the codes: FL001 unknown queue, FL002 payload too large, FL003 bad
delay, FL004 unknown failure kind, FL005 bad argument, FL006 unknown worker, FL007 unknown
retry policy, FL008 bad lease, FL009 bad job type, FL010 result too large."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from .conftest import Engine, raises_sqlstate


@dataclass
class World:
    q: uuid.UUID
    other_policy: uuid.UUID
    w: uuid.UUID
    job: int
    fence: int


@pytest.fixture(scope="module")
def world(module_eng: Engine) -> World:
    eng = module_eng
    q = eng.make_queue()
    other_q = eng.make_queue()  # another project, with its own policy
    other_policy = eng.val("select retry_policy_id from fl.queues where id = %s", (other_q,))
    w = eng.worker(q)
    job = eng.submit(q)
    eng.submit(q)
    fence = eng.claim_one(q, w)["fence"]
    return World(q, other_policy, w, job, fence)


NOWHERE = uuid.UUID(int=1)
BIG = Jsonb({"x": "y" * 300_000})

# (label, SQL, params built from the world, SQLSTATE)
CASES: list[tuple[str, str, Any, str]] = [
    ("submit unknown queue", "select * from fl.submit(%s, 't')", lambda x: (NOWHERE,), "FL001"),
    ("submit null queue", "select * from fl.submit(null, 't')", lambda x: (), "FL001"),
    (
        "submit payload too large",
        "select * from fl.submit(%s, 't', %s)",
        lambda x: (x.q, BIG),
        "FL002",
    ),
    (
        "submit negative delay",
        "select * from fl.submit(%s, 't', p_delay_s => -1)",
        lambda x: (x.q,),
        "FL003",
    ),
    (
        "submit NaN delay",
        "select * from fl.submit(%s, 't', p_delay_s => 'NaN')",
        lambda x: (x.q,),
        "FL003",
    ),
    (
        "submit infinite run_at",
        "select * from fl.submit(%s, 't', p_run_at => 'infinity')",
        lambda x: (x.q,),
        "FL003",
    ),
    (
        "submit run_at and delay",
        "select * from fl.submit(%s, 't', p_run_at => fl.now(), p_delay_s => 1)",
        lambda x: (x.q,),
        "FL005",
    ),
    ("submit null payload", "select * from fl.submit(%s, 't', null)", lambda x: (x.q,), "FL005"),
    (
        "submit zero timeout",
        "select * from fl.submit(%s, 't', p_timeout_ms => 0)",
        lambda x: (x.q,),
        "FL005",
    ),
    ("submit empty type", "select * from fl.submit(%s, '')", lambda x: (x.q,), "FL009"),
    (
        "submit long type",
        "select * from fl.submit(%s, repeat('t', 201))",
        lambda x: (x.q,),
        "FL009",
    ),
    (
        "submit unknown policy",
        "select * from fl.submit(%s, 't', p_retry_policy => %s)",
        lambda x: (x.q, NOWHERE),
        "FL007",
    ),
    (
        "submit policy of another project",
        "select * from fl.submit(%s, 't', p_retry_policy => %s)",
        lambda x: (x.q, x.other_policy),
        "FL007",
    ),
    (
        "claim unknown queue",
        "select * from fl.claim(%s, %s, null, 1, '30 s')",
        lambda x: (NOWHERE, x.w),
        "FL001",
    ),
    (
        "claim unknown worker",
        "select * from fl.claim(%s, %s, null, 1, '30 s')",
        lambda x: (x.q, NOWHERE),
        "FL006",
    ),
    (
        "claim n = 0",
        "select * from fl.claim(%s, %s, null, 0, '30 s')",
        lambda x: (x.q, x.w),
        "FL005",
    ),
    (
        "claim n too big",
        "select * from fl.claim(%s, %s, null, 1001, '30 s')",
        lambda x: (x.q, x.w),
        "FL005",
    ),
    (
        "claim zero lease",
        "select * from fl.claim(%s, %s, null, 1, '0 s')",
        lambda x: (x.q, x.w),
        "FL008",
    ),
    (
        "claim negative lease",
        "select * from fl.claim(%s, %s, null, 1, '-5 s')",
        lambda x: (x.q, x.w),
        "FL008",
    ),
    (
        "claim lease over a day",
        "select * from fl.claim(%s, %s, null, 1, '25 hours')",
        lambda x: (x.q, x.w),
        "FL008",
    ),
    (
        "claim empty types",
        "select * from fl.claim(%s, %s, '{}', 1, '30 s')",
        lambda x: (x.q, x.w),
        "FL005",
    ),
    (
        "claim null type",
        "select * from fl.claim(%s, %s, array[null]::text[], 1, '30 s')",
        lambda x: (x.q, x.w),
        "FL005",
    ),
    (
        "extend lengths differ",
        "select * from fl.extend_leases(%s, %s, '{}', '30 s')",
        lambda x: (x.w, [x.job]),
        "FL005",
    ),
    (
        "extend null ids",
        "select * from fl.extend_leases(%s, null, '{}', '30 s')",
        lambda x: (x.w,),
        "FL005",
    ),
    (
        "extend null element",
        "select * from fl.extend_leases(%s, array[null]::bigint[], array[1]::bigint[], '30 s')",
        lambda x: (x.w,),
        "FL005",
    ),
    (
        "extend duplicate ids",
        "select * from fl.extend_leases(%s, %s, %s, '30 s')",
        lambda x: (x.w, [x.job, x.job], [x.fence, x.fence]),
        "FL005",
    ),
    (
        "extend bad lease",
        "select * from fl.extend_leases(%s, %s, %s, '0 s')",
        lambda x: (x.w, [x.job], [x.fence]),
        "FL008",
    ),
    (
        "extend unknown worker",
        "select * from fl.extend_leases(%s, %s, %s, '30 s')",
        lambda x: (NOWHERE, [x.job], [x.fence]),
        "FL006",
    ),
    (
        "extend progress length",
        "select * from fl.extend_leases(%s, %s, %s, '30 s', '{}')",
        lambda x: (x.w, [x.job], [x.fence]),
        "FL005",
    ),
    (
        "complete lengths differ",
        "select * from fl.complete(%s, %s, %s)",
        lambda x: (x.w, [x.job], [x.fence, 2]),
        "FL005",
    ),
    (
        "complete duplicate ids",
        "select * from fl.complete(%s, %s, %s)",
        lambda x: (x.w, [x.job, x.job], [x.fence, x.fence]),
        "FL005",
    ),
    (
        "complete results length",
        "select * from fl.complete(%s, %s, %s, '{}')",
        lambda x: (x.w, [x.job], [x.fence]),
        "FL005",
    ),
    (
        "complete result too large",
        "select * from fl.complete(%s, %s, %s, array[%s::jsonb])",
        lambda x: (x.w, [x.job], [x.fence], BIG),
        "FL010",
    ),
    (
        "fail unknown kind",
        "select * from fl.fail(%s, %s, %s, 'oops')",
        lambda x: (x.w, x.job, x.fence),
        "FL004",
    ),
    (
        "fail null kind",
        "select * from fl.fail(%s, %s, %s, null)",
        lambda x: (x.w, x.job, x.fence),
        "FL004",
    ),
    (
        "fail null job",
        "select * from fl.fail(%s, null, %s, 'retryable')",
        lambda x: (x.w, x.fence),
        "FL005",
    ),
    (
        "snooze negative",
        "select * from fl.snooze(%s, %s, %s, -1)",
        lambda x: (x.w, x.job, x.fence),
        "FL003",
    ),
    (
        "snooze NaN",
        "select * from fl.snooze(%s, %s, %s, 'NaN')",
        lambda x: (x.w, x.job, x.fence),
        "FL003",
    ),
    (
        "snooze null",
        "select * from fl.snooze(%s, %s, %s, null)",
        lambda x: (x.w, x.job, x.fence),
        "FL003",
    ),
    (
        "snooze ten years and a day",
        "select * from fl.snooze(%s, %s, %s, 315446400)",
        lambda x: (x.w, x.job, x.fence),
        "FL003",
    ),
    (
        "release lengths differ",
        "select * from fl.release(%s, %s, '{}')",
        lambda x: (x.w, [x.job]),
        "FL005",
    ),
    ("cancel null", "select * from fl.cancel(null)", lambda x: (), "FL005"),
    ("retry null", "select * from fl.retry(null)", lambda x: (), "FL005"),
    ("replay null", "select * from fl.replay(null)", lambda x: (), "FL005"),
    (
        "replay_dead unknown queue",
        "select * from fl.replay_dead(%s)",
        lambda x: (NOWHERE,),
        "FL001",
    ),
    ("replay_dead limit 0", "select * from fl.replay_dead(%s, 0)", lambda x: (x.q,), "FL005"),
    ("reap limit 0", "select * from fl.reap(0)", lambda x: (), "FL005"),
    ("promote limit 0", "select fl.promote(0)", lambda x: (), "FL005"),
    ("sweep_orphans limit 0", "select fl.sweep_orphans(0)", lambda x: (), "FL005"),
    ("mark_dead_workers zero", "select fl.mark_dead_workers('0 s')", lambda x: (), "FL005"),
    (
        "register unknown queue",
        "select fl.register_worker(%s, null, 'h', 1, 1)",
        lambda x: ([x.q, NOWHERE],),
        "FL001",
    ),
    (
        "register no queues",
        "select fl.register_worker('{}', null, 'h', 1, 1)",
        lambda x: (),
        "FL005",
    ),
    (
        "register empty handlers",
        "select fl.register_worker(%s, '{}', 'h', 1, 1)",
        lambda x: ([x.q],),
        "FL005",
    ),
    (
        "register empty hostname",
        "select fl.register_worker(%s, null, '', 1, 1)",
        lambda x: ([x.q],),
        "FL005",
    ),
    (
        "register pid 0",
        "select fl.register_worker(%s, null, 'h', 0, 1)",
        lambda x: ([x.q],),
        "FL005",
    ),
    (
        "register concurrency 0",
        "select fl.register_worker(%s, null, 'h', 1, 0)",
        lambda x: ([x.q],),
        "FL005",
    ),
    ("worker heartbeat unknown", "select fl.worker_heartbeat(%s)", lambda x: (NOWHERE,), "FL006"),
    (
        "worker heartbeat bad state",
        "select fl.worker_heartbeat(%s, 'asleep')",
        lambda x: (x.w,),
        "FL005",
    ),
    (
        "append_logs bad level",
        "select fl.append_logs(%s, %s, %s, array['loud'], array['m'])",
        lambda x: (x.w, x.job, x.fence),
        "FL005",
    ),
    (
        "append_logs lengths differ",
        "select fl.append_logs(%s, %s, %s, array['info'], '{}')",
        lambda x: (x.w, x.job, x.fence),
        "FL005",
    ),
]


@pytest.mark.parametrize(("label", "query", "params", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_its_sqlstate_and_changes_nothing(
    module_eng: Engine, world: World, label: str, query: str, params: Any, code: str
) -> None:
    eng = module_eng
    before = eng.snapshot()
    with raises_sqlstate(code) as err:
        eng.conn.execute(query, params(world))
    assert err.error is not None and str(err.error).strip(), label  # a readable message
    assert eng.snapshot() == before


def test_a_worker_for_a_missing_queue_gets_a_clear_error(module_eng: Engine) -> None:
    eng = module_eng
    with raises_sqlstate("FL001") as err:
        eng.conn.execute("select fl.register_worker(%s, null, 'h', 1, 1)", ([NOWHERE],))
    assert str(NOWHERE) in str(err.error)
