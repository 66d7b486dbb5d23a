"""A completion re-sent after its acknowledgement was lost is answered ok, not fenced."""

from __future__ import annotations

from tests.engine.conftest import Engine


def test_resending_my_own_completion_is_ok_and_records_nothing(eng: Engine) -> None:
    queue = eng.make_queue()
    worker = eng.worker(queue)
    job = eng.submit(queue)
    (claimed,) = eng.claim(queue, worker)
    fence = claimed["fence"]
    assert eng.complete(worker, [(job, fence)]) == ["ok"]
    before = eng.snapshot()
    # The same call again, as the worker's link does after a lost connection.
    assert eng.complete(worker, [(job, fence)]) == ["ok"]
    assert eng.snapshot() == before
    assert eng.val("select count(*) from fl.fence_violations") == 0


def test_another_workers_completion_of_a_finished_job_is_still_fenced(eng: Engine) -> None:
    queue = eng.make_queue()
    owner, stranger = eng.worker(queue), eng.worker(queue)
    job = eng.submit(queue)
    (claimed,) = eng.claim(queue, owner)
    fence = claimed["fence"]
    assert eng.complete(owner, [(job, fence)]) == ["ok"]
    assert eng.complete(stranger, [(job, fence)]) == ["fenced"]
    assert eng.val("select count(*) from fl.fence_violations") == 1
