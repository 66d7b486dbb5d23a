"""API test harness: the real app on a real database, driven through Quart's test client.

``api`` is the app bound to this test's database. ``tenant`` builds one organization with a
project, a retry policy and a queue, and a logged-in user for every role plus an outsider who
owns another organization, so every test can ask "as whom?" without building the world.
Tenancy rows are inserted with SQL (the tests of those endpoints create them over HTTP); the
users log in through the API, so every token is a real session.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from fenceline.api.app import create_app
from fenceline.config import Settings
from fenceline.db.connection import TrioConnection
from fenceline.db.pool import Pool
from fenceline.readiness import Readiness

ROLES = ("owner", "admin", "member", "viewer")
PASSWORD = "correct horse battery"


@dataclass
class Answer:
    status: int
    body: Any
    headers: Any

    @property
    def code(self) -> str | None:
        return self.body.get("code") if isinstance(self.body, dict) else None

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.body!r})"


class Api:
    """The app, and requests as (status, decoded body)."""

    def __init__(self, app: Any, conn: TrioConnection[Any]) -> None:
        self.app = app
        self.client = app.test_client()
        self.conn = conn

    async def call(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                   headers: dict[str, str] | None = None, raw: bytes | None = None,
                   query: dict[str, Any] | None = None) -> Answer:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        data: bytes | None = raw
        if body is not None:
            data = json.dumps(body).encode()
            sent.setdefault("Content-Type", "application/json")
        response = await self.client.open(path if path.startswith("/") else f"/api/v1/{path}",
                                          method=method, data=data, headers=sent,
                                          query_string=query)
        text = await response.get_data(as_text=True)
        decoded = json.loads(text) if text else None
        return Answer(response.status_code, decoded, response.headers)

    async def get(self, path: str, **kw: Any) -> Answer:
        return await self.call("GET", path, **kw)

    async def post(self, path: str, body: Any = None, **kw: Any) -> Answer:
        return await self.call("POST", path, body, **kw)

    async def patch(self, path: str, body: Any = None, **kw: Any) -> Answer:
        return await self.call("PATCH", path, body, **kw)

    async def delete(self, path: str, **kw: Any) -> Answer:
        return await self.call("DELETE", path, **kw)

    async def user(self, name: str) -> tuple[uuid.UUID, str]:
        """Register and log in ``name``@example.com; (user id, session token)."""
        address = f"{name}@example.com"
        answer = await self.post("auth/register", {"email": address, "password": PASSWORD})
        assert answer.status == 202, answer
        answer = await self.post("auth/login", {"email": address, "password": PASSWORD})
        assert answer.status == 200, answer
        return uuid.UUID(answer.body["user_id"]), answer.body["token"]

    async def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        cur = await self.conn.execute(query, params)
        return await cur.fetchall() if cur.description else []


@pytest.fixture
async def api(pool: Pool, conn: TrioConnection[Any]) -> Api:
    app = create_app(Readiness(pool=pool, reason=None), Settings(password_profile="minimal"))
    return Api(app, conn)


@dataclass
class Tenant:
    org_id: uuid.UUID
    project_id: uuid.UUID
    policy_id: uuid.UUID
    queue_id: uuid.UUID
    tokens: dict[str, str] = field(default_factory=dict)   # role (and "outsider") -> token
    users: dict[str, uuid.UUID] = field(default_factory=dict)
    other_org_id: uuid.UUID | None = None
    other_project_id: uuid.UUID | None = None
    other_queue_id: uuid.UUID | None = None


async def make_org(api: Api, owner: uuid.UUID, name: str) -> tuple[uuid.UUID, ...]:
    """An organization owned by ``owner`` with a project, a policy and a queue."""
    [(org,)] = await api.sql("insert into fl.organizations (name) values (%s) returning id", name)
    [(project,)] = await api.sql(
        "insert into fl.projects (org_id, name) values (%s, 'main') returning id", org)
    [(policy,)] = await api.sql(
        "insert into fl.retry_policies (project_id, name, jitter) values (%s, 'default', false)"
        " returning id", project)
    [(queue,)] = await api.sql(
        "insert into fl.queues (project_id, name, retry_policy_id) values (%s, 'work', %s)"
        " returning id", project, policy)
    await api.sql("insert into fl.org_members (org_id, user_id, role) values (%s, %s, 'owner')",
                  org, owner)
    return org, project, policy, queue


@pytest.fixture
async def tenant(api: Api) -> Tenant:
    users: dict[str, uuid.UUID] = {}
    tokens: dict[str, str] = {}
    for who in (*ROLES, "outsider"):
        users[who], tokens[who] = await api.user(who)
    org, project, policy, queue = await make_org(api, users["owner"], "acme")
    for role in ROLES[1:]:
        await api.sql("insert into fl.org_members (org_id, user_id, role) values (%s, %s, %s)",
                      org, users[role], role)
    other_org, other_project, _, other_queue = await make_org(api, users["outsider"], "globex")
    return Tenant(org, project, policy, queue, tokens, users, other_org, other_project,
                  other_queue)
