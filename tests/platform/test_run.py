"""``fenceline run`` as a real process: ready, drained by a signal, restartable.

These tests start the real command, so they wait on real time; each wait is bounded and
is the behaviour under test (readiness within 15 s, stop within 5 s).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

READY_WITHIN = 15.0
STOP_WITHIN = 5.0

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> tuple[int, dict[str, Any], str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as resp:
            return resp.status, json.loads(resp.read()), resp.headers["content-type"]
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers["content-type"]


def wait_for(port: int, path: str, status: int, within: float,
             daemon: Daemon | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        try:
            code, body, _ = get(port, path)
            if code == status:
                return body
            last = (code, body)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
        time.sleep(0.1)
    logs = daemon.log_tail() if daemon is not None else ""
    raise AssertionError(f"{path} did not answer {status} within {within}s; last: {last}"
                         f"\n--- daemon log ---\n{logs}")


class Daemon:
    def __init__(self, port: int, env: dict[str, str], *extra: str) -> None:
        self.port = port
        full_env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        full_env.update(env, LOG_FORMAT="json", API_PORT=str(port))
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the daemon
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fenceline", "run", *extra], env=full_env,
            stdout=subprocess.DEVNULL, stderr=self.stderr, text=True,
        )

    def log_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, float, str]:
        began = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon did not stop after {sig}: {self.log_tail()}") from None
        took = time.monotonic() - began
        self.stderr.seek(0)
        text = self.stderr.read()
        self.stderr.close()
        return self.proc.returncode, took, text

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.stderr.close()


@pytest.fixture
def data_root() -> Iterator[Path]:
    """A directory the embedded server's account can reach (we may be root)."""
    base = Path(tempfile.mkdtemp(prefix="fenceline-run-test-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def postmaster_pid(data_dir: Path) -> int | None:
    pid_file = data_dir / "postmaster.pid"
    if not pid_file.exists():
        return None
    return int(pid_file.read_text().splitlines()[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_run_with_database_url_is_ready_and_stops_on_sigterm(dsn: str) -> None:
    port = free_port()
    daemon = Daemon(port, {"DATABASE_URL": dsn})
    try:
        assert wait_for(port, "/healthz", 200, READY_WITHIN) == {"status": "ok"}
        body = wait_for(port, "/readyz", 200, READY_WITHIN, daemon)
        assert body["status"] == "ready"
    except BaseException:
        daemon.kill()
        raise
    code, took, err = daemon.stop()
    assert code == 0, err[-2000:]
    assert took < STOP_WITHIN
    assert '"msg": "draining"' in err


def test_unreachable_database_is_reported_by_readyz(dsn: str) -> None:
    port = free_port()
    daemon = Daemon(port, {"DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nothing"})
    try:
        wait_for(port, "/healthz", 200, READY_WITHIN)
        code, body, ctype = get(port, "/readyz")
    finally:
        exit_code, took, err = daemon.stop()
    assert code == 503
    assert ctype.startswith("application/problem+json")
    assert body["code"] == "not_ready"
    assert "database unreachable" in body["detail"]
    assert exit_code == 0
    assert took < STOP_WITHIN
    assert "retrying" in err


def test_unknown_path_and_method_answer_problem_json(dsn: str) -> None:
    port = free_port()
    daemon = Daemon(port, {"DATABASE_URL": dsn}, "--roles", "api")
    try:
        wait_for(port, "/readyz", 200, READY_WITHIN, daemon)
        code, body, ctype = get(port, "/no/such/path")
        assert (code, body["code"]) == (404, "not_found")
        assert ctype.startswith("application/problem+json")
        req = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", method="DELETE")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=3)
        assert info.value.code == 405
        assert json.loads(info.value.read())["code"] == "method_not_allowed"
    finally:
        daemon.stop()


def test_embedded_start_stop_reuse_and_recover_after_kill(data_root: Path) -> None:
    data_dir = data_root / "pg"
    port = free_port()
    env = {"FENCELINE_DATA_DIR": str(data_dir)}

    # 1. Cold start: ready within the bound, the first log lines say where the data is.
    daemon = Daemon(port, env)
    try:
        wait_for(port, "/readyz", 200, READY_WITHIN, daemon)
        pid = postmaster_pid(data_dir)
        assert pid is not None and alive(pid)
        url = subprocess.run([sys.executable, "-m", "fenceline", "db-url", "--data-dir",
                              str(data_dir)], capture_output=True, text=True, timeout=30)
        assert url.returncode == 0, url.stderr
        import psycopg

        with psycopg.connect(url.stdout.strip(), autocommit=True) as conn:
            conn.execute("create table public.survives (x int)")
    except BaseException:
        daemon.kill()
        raise
    code, took, err = daemon.stop(signal.SIGINT)
    assert code == 0, err[-2000:]
    assert took < STOP_WITHIN
    assert "embedded" in err.splitlines()[0].lower()
    time.sleep(0.2)
    assert not alive(pid), "the postgres child must stop with the daemon"

    # 2. Warm start reuses the data dir.
    daemon = Daemon(port, env)
    try:
        wait_for(port, "/readyz", 200, READY_WITHIN, daemon)
        url_text = subprocess.run([sys.executable, "-m", "fenceline", "db-url", "--data-dir",
                                   str(data_dir)], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        import psycopg

        with psycopg.connect(url_text, autocommit=True) as conn:
            assert conn.execute("select to_regclass('public.survives') is not null"
                                ).fetchone() == (True,)
    finally:
        # 3. kill -9 the daemon: its postgres is orphaned.
        daemon.kill()

    # 4. A new start recovers from the stale postmaster.
    daemon = Daemon(port, env)
    try:
        wait_for(port, "/readyz", 200, READY_WITHIN, daemon)
    except BaseException:
        daemon.kill()
        raise
    code, took, err = daemon.stop()
    assert code == 0, err[-2000:]
    assert took < STOP_WITHIN
    pid = postmaster_pid(data_dir)
    assert pid is None or not alive(pid)
