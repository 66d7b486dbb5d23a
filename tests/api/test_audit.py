"""Reading the audit trail: a project's, an organization's (org-level rows included)."""

from __future__ import annotations

import uuid
from typing import Any

from tests.api.conftest import Api, Tenant
from tests.api.test_orgs import make_key


async def some_changes(api: Api, tenant: Tenant) -> list[str]:
    """A few mutations in acme, at org and project level; the actions, oldest first."""
    admin = tenant.tokens["admin"]
    await api.patch(f"orgs/{tenant.org_id}", {"name": "Acme"}, token=admin)
    await api.patch(f"queues/{tenant.queue_id}", {"max_depth": 5}, token=admin)
    await api.post(f"queues/{tenant.queue_id}/pause", token=tenant.tokens["member"])
    await api.post(f"projects/{tenant.project_id}/retry-policies", {"name": "p"}, token=admin)
    # And one in globex, which acme must never see.
    await api.patch(f"queues/{tenant.other_queue_id}", {"max_depth": 5},
                    token=tenant.tokens["outsider"])
    return ["org.update", "queue.update", "queue.pause", "policy.create"]


async def test_project_trail_newest_first_and_paged(api: Api, tenant: Tenant) -> None:
    await some_changes(api, tenant)
    path = f"projects/{tenant.project_id}/audit"
    first = await api.get(path, token=tenant.tokens["admin"], query={"limit": 2})
    assert first.status == 200, first
    assert [e["action"] for e in first.body["items"]] == ["policy.create", "queue.pause"]
    rest = await api.get(path, token=tenant.tokens["admin"],
                         query={"limit": 2, "cursor": first.body["next_cursor"]})
    assert [e["action"] for e in rest.body["items"]] == ["queue.update"]
    assert rest.body["next_cursor"] is None
    entry = rest.body["items"][0]
    assert set(entry) == {"id", "action", "entity", "entity_id", "actor_user", "actor_key",
                          "project_id", "detail", "request_id", "created_at"}
    assert (entry["entity"], entry["entity_id"], entry["actor_user"], entry["actor_key"],
            entry["project_id"], entry["detail"]) == (
        "queue", str(tenant.queue_id), str(tenant.users["admin"]), None,
        str(tenant.project_id), {"max_depth": 5})
    assert entry["request_id"]


async def test_org_trail_has_org_rows_and_every_project(api: Api, tenant: Tenant) -> None:
    actions = await some_changes(api, tenant)
    second = await api.post(f"orgs/{tenant.org_id}/projects", {"name": "second"},
                            token=tenant.tokens["admin"])
    await api.delete(f"projects/{second.body['id']}", token=tenant.tokens["admin"])
    answer = await api.get(f"orgs/{tenant.org_id}/audit", token=tenant.tokens["admin"])
    assert answer.status == 200
    assert [e["action"] for e in answer.body["items"]] == [
        "project.delete", "project.create", *actions[::-1]]
    org_row = answer.body["items"][-1]
    assert org_row["project_id"] is None and org_row["entity_id"] == str(tenant.org_id)
    # The deleted project's rows are still there, under its id.
    assert {e["project_id"] for e in answer.body["items"][:2]} == {second.body["id"]}


async def test_request_id_is_recorded(api: Api, tenant: Tenant) -> None:
    await api.call("PATCH", f"queues/{tenant.queue_id}", {"max_depth": 9},
                   token=tenant.tokens["admin"], headers={"X-Request-Id": "req-42"})
    assert await api.sql("select request_id from fl.audit_log") == [("req-42",)]


async def test_who_may_read(api: Api, tenant: Tenant) -> None:
    await some_changes(api, tenant)
    tokens = tenant.tokens
    project = f"projects/{tenant.project_id}/audit"
    org = f"orgs/{tenant.org_id}/audit"
    cases: list[tuple[str, str | None, int]] = [
        (project, tokens["owner"], 200), (project, tokens["admin"], 200),
        (project, tokens["member"], 403), (project, tokens["viewer"], 403),
        (project, tokens["outsider"], 404), (project, None, 401),
        (f"projects/{tenant.other_project_id}/audit", tokens["owner"], 404),
        (f"projects/{uuid.uuid4()}/audit", tokens["owner"], 404),
        ("projects/1/audit", tokens["owner"], 400),
        (org, tokens["admin"], 200), (org, tokens["member"], 403),
        (org, tokens["outsider"], 404), (org, None, 401),
        (f"orgs/{tenant.other_org_id}/audit", tokens["owner"], 404),
        ("orgs/x/audit", tokens["owner"], 400),
    ]
    for path, token, status in cases:
        answer = await api.get(path, token=token)
        assert answer.status == status, (path, answer)
    admin_key = await make_key(api, tenant.project_id, "admin")
    member_key = await make_key(api, tenant.project_id, "member")
    assert (await api.get(project, token=admin_key)).status == 200
    assert (await api.get(project, token=member_key)).status == 403
    assert (await api.get(org, token=admin_key)).status == 403
    bad: list[dict[str, Any]] = [{"limit": 0}, {"limit": 101}, {"cursor": "WyJ4Il0"},
                                 {"cursor": "W10"}, {"after": 3}]
    for query in bad:
        answer = await api.get(project, token=tokens["admin"], query=query)
        assert answer.status == 400, (query, answer)


async def test_every_mutation_writes_exactly_one_row(api: Api, tenant: Tenant) -> None:
    """One pass over every audited endpoint of the tenancy API: one row each, right action."""
    admin, owner = tenant.tokens["admin"], tenant.tokens["owner"]
    late, _ = await api.user("late")
    steps: list[tuple[str, str, Any, str, str]] = [
        ("POST", "orgs", {"name": "new"}, owner, "org.create"),
        ("PATCH", f"orgs/{tenant.org_id}", {"name": "n"}, admin, "org.update"),
        ("POST", f"orgs/{tenant.org_id}/members", {"email": "late@example.com",
                                                   "role": "viewer"}, admin, "org.add_member"),
        ("PATCH", f"orgs/{tenant.org_id}/members/{late}", {"role": "member"}, admin,
         "org.change_role"),
        ("DELETE", f"orgs/{tenant.org_id}/members/{late}", None, admin, "org.remove_member"),
        ("POST", f"orgs/{tenant.org_id}/projects", {"name": "p2"}, admin, "project.create"),
        ("PATCH", f"projects/{tenant.project_id}", {"name": "p1"}, admin, "project.update"),
        ("POST", f"projects/{tenant.project_id}/retry-policies", {"name": "r"}, admin,
         "policy.create"),
        ("PATCH", f"retry-policies/{tenant.policy_id}", {"max_attempts": 2}, admin,
         "policy.update"),
        ("POST", f"projects/{tenant.project_id}/queues",
         {"name": "q2", "retry_policy_id": str(tenant.policy_id)}, admin, "queue.create"),
        ("PATCH", f"queues/{tenant.queue_id}", {"max_depth": 3}, admin, "queue.update"),
        ("POST", f"queues/{tenant.queue_id}/pause", None, tenant.tokens["member"],
         "queue.pause"),
        ("POST", f"queues/{tenant.queue_id}/resume", None, tenant.tokens["member"],
         "queue.resume"),
        ("POST", f"projects/{tenant.project_id}/api-keys", {"name": "k", "role": "viewer"},
         admin, "api_key.create"),
    ]
    for method, path, body, token, action in steps:
        before = await api.sql("select coalesce(max(id), 0) from fl.audit_log")
        answer = await api.call(method, path, body, token=token)
        assert answer.status in (200, 201, 204), (path, answer)
        rows = await api.sql("select action from fl.audit_log where id > %s", before[0][0])
        assert rows == [(action,)], (path, rows)
        if action == "queue.create":
            new_queue = answer.body["id"]
        if action == "api_key.create":
            new_key = answer.body["id"]
        if action == "policy.create":
            new_policy = answer.body["id"]
    for path, action in ((f"api-keys/{new_key}", "api_key.revoke"),
                         (f"queues/{new_queue}", "queue.delete"),
                         (f"retry-policies/{new_policy}", "policy.delete"),
                         (f"projects/{tenant.project_id}", "project.delete")):
        before = await api.sql("select coalesce(max(id), 0) from fl.audit_log")
        assert (await api.delete(path, token=admin)).status == 204, path
        rows = await api.sql("select action from fl.audit_log where id > %s", before[0][0])
        assert rows == [(action,)], (path, rows)
