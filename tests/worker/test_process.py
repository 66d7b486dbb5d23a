"""Worker and scheduler as real ``fenceline run`` processes: SIGKILL, SIGTERM, a poison job.

Real processes run on real time, so these tests wait (bounded) for what they measure. The
bounds are the promises: a killed worker's job runs again within lease + reaper interval.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.engine.conftest import Engine

pytestmark = pytest.mark.slow

LEASE = 2.0
REAPER_INTERVAL = 0.5
# Process start, claim wake-up and polling on a loaded 2-core machine.
SLACK = 3.0


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    e = Engine(dsn)
    e.set_now(dt.datetime.now(dt.UTC))
    yield e
    e.close()


class Proc:
    def __init__(self, dsn: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env.update(DATABASE_URL=dsn, LOG_FORMAT="json")
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "fenceline", "run", *args],
                                     env=env, stdout=subprocess.DEVNULL, stderr=self.log,
                                     text=True)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()

    def text(self) -> str:
        self.log.seek(0)
        return self.log.read()


def worker(dsn: str, queue: uuid.UUID, *extra: str) -> Proc:
    return Proc(dsn, "--roles", "worker", "--queue", str(queue), "--lease", str(LEASE),
                "--concurrency", "4", "--drain-timeout", "1", *extra)


def scheduler(dsn: str) -> Proc:
    return Proc(dsn, "--roles", "scheduler", "--reaper-interval", str(REAPER_INTERVAL),
                "--promoter-interval", "0.5")


def poll(engine: Engine, query: str, params: Any = None, *, within: float = 30,
         check: Callable[[Any], bool] = bool) -> Any:
    deadline = time.monotonic() + within
    while True:
        value = engine.val(query, params)
        if check(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {query} (last {value!r})")
        time.sleep(0.02)


def test_a_sigkilled_workers_job_runs_again_within_lease_plus_reaper_interval(
    engine: Engine, dsn: str
) -> None:
    queue = engine.make_queue(policy={"kind": "fixed", "base_delay_ms": 0, "jitter": False})
    job = engine.submit(queue, "sleep", {"ms": 600_000})
    procs = [scheduler(dsn), worker(dsn, queue)]
    try:
        first = poll(engine, "select (select worker_id from fl.attempts where job_id = %s)",
                     (job,), within=30)
        procs.append(worker(dsn, queue))  # a healthy worker to take the job over
        poll(engine, "select count(*) = 2 from fl.workers where state = 'active'", within=30)
        procs[1].stop(signal.SIGKILL)
        killed_at = time.monotonic()
        poll(engine, "select count(*) from fl.attempts where job_id = %s and worker_id <> %s",
             (job, first), within=LEASE + REAPER_INTERVAL + SLACK + 10)
        recovered_in = time.monotonic() - killed_at
    finally:
        for p in procs:
            p.stop()
    assert recovered_in <= LEASE + REAPER_INTERVAL + SLACK
    assert engine.val("select outcome::text from fl.attempts where job_id = %s and "
                      "worker_id = %s", (job, first)) == "lost"
    assert engine.val("select status::text from fl.jobs where id = %s", (job,)) != "completed"


def test_sigterm_drains_and_releases_without_using_an_attempt(engine: Engine,
                                                              dsn: str) -> None:
    queue = engine.make_queue()
    jobs = [engine.submit(queue, "sleep", {"ms": 600_000}) for _ in range(3)]
    p = worker(dsn, queue)
    try:
        poll(engine, "select count(*) = 3 from fl.jobs where status = 'running'", within=30)
    except BaseException:
        p.stop(signal.SIGKILL)
        raise
    began = time.monotonic()
    code = p.stop(signal.SIGTERM)
    took = time.monotonic() - began
    assert code == 0
    assert took < 1 + 5
    rows = engine.rows("select status::text, attempts from fl.jobs where id = any(%s)", (jobs,))
    assert [(r["status"], r["attempts"]) for r in rows] == [("queued", 0)] * 3
    assert {r["outcome"] for r in engine.rows("select outcome::text from fl.attempts")} == {
        "released"}
    assert engine.val("select state from fl.workers") == "stopped"


def test_a_poison_job_that_kills_its_worker_reaches_the_dead_letter_queue(
    engine: Engine, dsn: str
) -> None:
    queue = engine.make_queue(policy={"kind": "fixed", "base_delay_ms": 0, "jitter": False,
                                      "max_lost": 2})
    healthy = engine.submit(queue, "noop")
    poison = engine.submit(queue, "shell", {"command": "kill -9 $PPID"}, priority=10)
    sched = scheduler(dsn)
    deaths = 0
    survivor: Proc | None = None

    def poison_dead() -> bool:
        return bool(engine.val("select status::text = 'dead_letter' from fl.jobs where id = %s",
                               (poison,)))

    try:
        deadline = time.monotonic() + 90
        while not poison_dead():
            assert time.monotonic() < deadline, "the poison job never reached the DLQ"
            # Concurrency 1: a killed worker takes only the poison job down with it.
            w = worker(dsn, queue, "--concurrency", "1")
            while w.proc.poll() is None and not poison_dead():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            if w.proc.poll() == -signal.SIGKILL:
                deaths += 1
                w.stop()
            else:
                survivor = w  # the poison is gone: this worker lives on
        if survivor is None:
            survivor = worker(dsn, queue)
        poll(engine, "select status::text = 'completed' from fl.jobs where id = %s",
             (healthy,), within=30)
        assert survivor.stop() == 0
    finally:
        sched.stop()
    assert deaths == 2
    dead = engine.row("select reason, attempt_history from fl.dead_letters where job_id = %s",
                      (poison,))
    assert dead["reason"] == "lost_exhausted"
    assert [a["outcome"] for a in dead["attempt_history"]] == ["lost", "lost"]
