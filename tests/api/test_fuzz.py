"""Property-based fuzz of the whole API from its own OpenAPI document (schemathesis).

A real ``fenceline run --roles=api`` serves a migrated database with one organization whose
owner's token every request carries, so generated requests reach past authentication.
Schemathesis sends valid and invalid inputs for every operation and checks: no 5xx, every
answer matches the documented schema, status code and content type, and invalid input is
rejected. The run is bounded (examples per operation, fixed seed) so CI stays fast and
repeatable; raise FUZZ_EXAMPLES locally for a deeper run.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.platform.test_run import Daemon, free_port, wait_for

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))
SEED = int(os.environ.get("FUZZ_SEED", "20261130"))
CHECKS = ("not_a_server_error,response_schema_conformance,status_code_conformance,"
          "content_type_conformance,negative_data_rejection")


def _post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/{path}", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        raw = resp.read()
        return json.loads(raw) if raw else {}


def _seed(dsn: str, port: int) -> str:
    """An owner with an organization, project, policy and queue; the owner's token."""
    _post(port, "auth/register", {"email": "fuzz@example.com", "password": "fuzz password"})
    token = _post(port, "auth/login", {"email": "fuzz@example.com",
                                       "password": "fuzz password"})["token"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        org = conn.execute("insert into fl.organizations (name) values ('fuzz') returning id"
                           ).fetchone()[0]  # type: ignore[index]
        conn.execute("insert into fl.org_members (org_id, user_id, role)"
                     " select %s, id, 'owner' from fl.users", (org,))
        project = conn.execute("insert into fl.projects (org_id, name) values (%s, 'p')"
                               " returning id", (org,)).fetchone()[0]  # type: ignore[index]
        policy = conn.execute("insert into fl.retry_policies (project_id, name)"
                              " values (%s, 'r') returning id", (project,)
                              ).fetchone()[0]  # type: ignore[index]
        conn.execute("insert into fl.queues (project_id, name, retry_policy_id)"
                     " values (%s, 'q', %s)", (project, policy))
    return str(token)


def test_schemathesis_finds_no_server_error_and_no_schema_break(dsn: str,
                                                               tmp_path: Path) -> None:
    port = free_port()
    daemon = Daemon(port, {"DATABASE_URL": dsn, "FENCELINE_PASSWORD_PROFILE": "minimal",
                           "LOG_LEVEL": "warning"}, "--roles=api")
    try:
        wait_for(port, "/readyz", 200, 30, daemon)
        token = _seed(dsn, port)
        run = subprocess.run(
            [str(Path(sys.executable).with_name("schemathesis")), "run",
             f"http://127.0.0.1:{port}/api/v1/openapi.json",
             "--checks", CHECKS, "--max-examples", str(EXAMPLES), "--seed", str(SEED),
             "--phases", "examples,coverage,fuzzing", "--generation-database", "none",
             "--workers", "1", "--no-color", "--request-timeout", "10",
             "--exclude-path", "/api/v1/auth/logout",   # would revoke the fuzzer's own token
             "-H", f"Authorization: Bearer {token}"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)
        errors = [line for line in daemon.log_tail().splitlines() if '"ERROR"' in line]
    finally:
        daemon.stop()
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-3000:]
    assert not errors, errors


def test_an_unread_body_does_not_stall_a_keep_alive_connection(dsn: str) -> None:
    """A 405 or a bad path id answered before the body is read must not hang the next request
    on the same connection (schemathesis found this; see the before_request hook in app.py)."""
    port = free_port()
    daemon = Daemon(port, {"DATABASE_URL": dsn, "LOG_LEVEL": "warning"}, "--roles=api")
    try:
        wait_for(port, "/readyz", 200, 30, daemon)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        statuses = []
        for method, path in [("PUT", "/api/v1/me"), ("GET", "/healthz"),
                             ("PATCH", "/api/v1/projects/null"), ("GET", "/healthz"),
                             ("OPTIONS", "/api/v1/auth/login"), ("GET", "/healthz")]:
            conn.request(method, path, body=b'{"x": 1}',
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            statuses.append(response.status)
        conn.close()
    finally:
        daemon.stop()
    assert statuses == [405, 200, 400, 200, 200, 200]
