"""``fenceline bench`` measures against a real database and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

pytestmark = pytest.mark.slow


def bench(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": dsn, "LOG_LEVEL": "warning"}
    return subprocess.run([sys.executable, "-m", "fenceline", "bench", *args], env=env,
                          capture_output=True, text=True, timeout=180)


def test_bench_reports_and_cleans_up(dsn: str) -> None:
    out = bench(dsn, "--jobs", "200", "--latency-jobs", "5", "--rate", "50")
    assert out.returncode == 0, out.stderr
    assert "burn-down" in out.stdout
    assert "submit-to-start p99" in out.stdout
    with psycopg.connect(dsn) as conn:
        left = conn.execute("select (select count(*) from fl.jobs),"
                            " (select count(*) from fl.organizations)").fetchone()
    assert left == (0, 0)


@pytest.mark.parametrize(("args", "message"), [
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--rate", "-1"], "--rate must be positive"),
])
def test_bench_rejects_bad_numbers(dsn: str, args: list[str], message: str) -> None:
    out = bench(dsn, *args)
    assert out.returncode == 2
    assert message in out.stderr


def test_bench_refuses_an_unmigrated_database(empty_dsn: str) -> None:
    out = bench(empty_dsn, "--jobs", "10")
    assert out.returncode == 2
    assert "not migrated" in out.stderr
