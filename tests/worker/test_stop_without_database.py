"""A worker told to stop while its database is unreachable stops (found by tests/chaos).

The drain's "draining" heartbeat and the completion flush ran under an unbounded shield,
and the worker's link retries a lost connection for ever: with the database gone, SIGTERM
(and a second SIGTERM) left the process running until the database came back. Now every
shielded write is bounded, so the process stops and its jobs' leases lapse as after a crash.
"""

from __future__ import annotations

import datetime as dt
import signal
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tests.engine.conftest import Engine
from tests.worker.test_process import poll, worker

pytestmark = pytest.mark.slow

# The bounded clean-up steps (draining heartbeat, release, marking the worker stopped:
# 10 s each, see fenceline/worker/runtime.py) plus the drain timeout and process start-up.
STOP_BOUND = 45.0


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    e = Engine(dsn)
    e.set_now(dt.datetime.now(dt.UTC))
    yield e
    e.close()


def _cut_off(server_dsn: str, dsn: str) -> None:
    """Refuse new connections to the test's database and end the ones it has."""
    name = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("alter database {} allow_connections false")
                      .format(sql.Identifier(str(name))))
        admin.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                      " where datname = %s and pid <> pg_backend_pid()", (name,))


def test_sigterm_stops_a_worker_whose_database_is_unreachable(
    engine: Engine, dsn: str, server_dsn: str
) -> None:
    queue = engine.make_queue()
    engine.submit(queue, "sleep", {"ms": 600_000})
    p = worker(dsn, queue)
    try:
        poll(engine, "select count(*) = 1 from fl.jobs where status = 'running'", within=30)
    except BaseException:
        p.stop(signal.SIGKILL)
        raise
    engine.close()
    _cut_off(server_dsn, dsn)
    began = time.monotonic()
    code = p.stop(signal.SIGTERM, timeout=STOP_BOUND + 15)  # raises if it does not stop
    took = time.monotonic() - began
    assert code == 0
    assert took < STOP_BOUND
