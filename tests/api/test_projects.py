"""Projects: create, list, read, rename, delete (also after work has run, reference W5)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.api.conftest import Api, Tenant
from tests.api.test_orgs import audit, make_key, remaining, run_some_work

COUNT = "select count(*) from fl.projects"


async def test_create_list_read(api: Api, tenant: Tenant) -> None:
    answer = await api.post(f"orgs/{tenant.org_id}/projects", {"name": " billing "},
                            token=tenant.tokens["admin"])
    assert answer.status == 201, answer
    new = uuid.UUID(answer.body["id"])
    assert answer.body["name"] == "billing" and answer.body["org_id"] == str(tenant.org_id)
    # The creation is in the new project's own trail, and the organization's.
    assert await audit(api, "project.create") == [
        (tenant.org_id, new, tenant.users["admin"], None, "project", str(new),
         {"name": "billing"})]
    read = await api.get(f"projects/{new}", token=tenant.tokens["viewer"])
    assert read.status == 200 and read.body == answer.body
    await api.post(f"orgs/{tenant.org_id}/projects", {"name": "alpha"},
                   token=tenant.tokens["owner"])
    first = await api.get(f"orgs/{tenant.org_id}/projects", token=tenant.tokens["viewer"],
                          query={"limit": 2})
    assert [p["name"] for p in first.body["items"]] == ["alpha", "billing"]
    rest = await api.get(f"orgs/{tenant.org_id}/projects", token=tenant.tokens["viewer"],
                         query={"limit": 2, "cursor": first.body["next_cursor"]})
    assert [p["name"] for p in rest.body["items"]] == ["main"]
    assert rest.body["next_cursor"] is None


async def test_duplicate_name_is_409_and_changes_nothing(api: Api, tenant: Tenant) -> None:
    answer = await api.post(f"orgs/{tenant.org_id}/projects", {"name": "main"},
                            token=tenant.tokens["admin"])
    assert answer.status == 409 and answer.code == "name_taken"
    assert await api.sql(COUNT) == [(2,)]
    assert await audit(api, "project.create") == []
    # The same name in another organization is fine (globex has a "main" too).
    other = await api.post(f"orgs/{tenant.org_id}/projects", {"name": "second"},
                           token=tenant.tokens["admin"])
    renamed = await api.patch(f"projects/{other.body['id']}", {"name": "main"},
                              token=tenant.tokens["admin"])
    assert renamed.status == 409 and renamed.code == "name_taken"
    assert await api.sql("select name from fl.projects where id = %s",
                         uuid.UUID(other.body["id"])) == [("second",)]
    assert await audit(api, "project.update") == []


@pytest.mark.parametrize(("body", "field"), [
    ({}, "name"), ({"name": ""}, "name"), ({"name": " "}, "name"), ({"name": "x" * 201}, "name"),
    ({"name": 1}, "name"), ({"name": None}, "name"), ({"name": "x", "org_id": "y"}, "org_id"),
])
async def test_bad_bodies_change_nothing(api: Api, tenant: Tenant, body: Any,
                                         field: str) -> None:
    create = await api.post(f"orgs/{tenant.org_id}/projects", body, token=tenant.tokens["admin"])
    patch = await api.patch(f"projects/{tenant.project_id}", body, token=tenant.tokens["admin"])
    for answer in (create, patch):
        assert answer.status == 400 and answer.body["field"] == field, answer
    assert await api.sql(COUNT) == [(2,)]
    assert await api.sql("select name from fl.projects where id = %s",
                         tenant.project_id) == [("main",)]
    assert await api.sql("select count(*) from fl.audit_log") == [(0,)]


async def test_roles_tenants_and_malformed_ids(api: Api, tenant: Tenant) -> None:
    tokens = tenant.tokens
    org, project = tenant.org_id, tenant.project_id
    cases: list[tuple[str, str, Any, str | None, int]] = [
        ("POST", f"orgs/{org}/projects", {"name": "n"}, tokens["member"], 403),
        ("POST", f"orgs/{org}/projects", {"name": "n"}, tokens["outsider"], 404),
        ("POST", f"orgs/{tenant.other_org_id}/projects", {"name": "n"}, tokens["owner"], 404),
        ("POST", f"orgs/{org}/projects", {"name": "n"}, None, 401),
        ("POST", "orgs/zzz/projects", {"name": "n"}, tokens["owner"], 400),
        ("GET", f"orgs/{org}/projects", None, tokens["outsider"], 404),
        ("GET", f"orgs/{org}/projects", None, None, 401),
        ("GET", f"projects/{project}", None, tokens["outsider"], 404),
        ("GET", f"projects/{tenant.other_project_id}", None, tokens["owner"], 404),
        ("GET", f"projects/{uuid.uuid4()}", None, tokens["owner"], 404),
        ("GET", "projects/1", None, tokens["owner"], 400),
        ("GET", f"projects/{project}", None, None, 401),
        ("PATCH", f"projects/{project}", {"name": "n"}, tokens["member"], 403),
        ("PATCH", f"projects/{project}", {"name": "n"}, tokens["outsider"], 404),
        ("PATCH", f"projects/{tenant.other_project_id}", {"name": "n"}, tokens["owner"], 404),
        ("PATCH", f"projects/{project}", {"name": "n"}, None, 401),
        ("DELETE", f"projects/{project}", None, tokens["member"], 403),
        ("DELETE", f"projects/{project}", None, tokens["viewer"], 403),
        ("DELETE", f"projects/{project}", None, tokens["outsider"], 404),
        ("DELETE", f"projects/{tenant.other_project_id}", None, tokens["owner"], 404),
        ("DELETE", "projects/x", None, tokens["owner"], 400),
        ("DELETE", f"projects/{project}", None, None, 401),
    ]
    for method, path, body, token, status in cases:
        answer = await api.call(method, path, body, token=token)
        assert answer.status == status, (method, path, answer)
    assert await api.sql(COUNT) == [(2,)]
    assert await api.sql("select count(*) from fl.audit_log") == [(0,)]


async def test_keys_read_and_rename_their_project_but_do_not_delete_it(api: Api,
                                                                       tenant: Tenant) -> None:
    key = await make_key(api, tenant.project_id, "admin")
    assert (await api.get(f"projects/{tenant.project_id}", token=key)).status == 200
    assert (await api.get(f"orgs/{tenant.org_id}/projects", token=key)).status == 403
    renamed = await api.patch(f"projects/{tenant.project_id}", {"name": "renamed"}, token=key)
    assert renamed.status == 200
    [row] = await audit(api, "project.update")
    assert row[2] is None and row[3] is not None   # actor is the key
    assert (await api.delete(f"projects/{tenant.project_id}", token=key)).status == 403
    assert (await api.post(f"orgs/{tenant.org_id}/projects", {"name": "k"},
                           token=key)).status == 403
    assert await api.sql(COUNT) == [(2,)]


async def test_delete_after_work_ran_removes_everything(api: Api, tenant: Tenant) -> None:
    """Reference W5: project deletion failed once work had run."""
    await run_some_work(api, tenant.queue_id)
    await make_key(api, tenant.project_id)
    jobs = [r[0] for r in await api.sql("select id from fl.jobs where project_id = %s",
                                        tenant.project_id)]
    await api.patch(f"projects/{tenant.project_id}", {"name": "doomed"},
                    token=tenant.tokens["admin"])
    answer = await api.delete(f"projects/{tenant.project_id}", token=tenant.tokens["admin"])
    assert answer.status == 204, answer
    left = await remaining(api, tenant.project_id, tenant.queue_id, jobs)
    assert left == dict.fromkeys(left, 0)
    assert await api.sql("select count(*) from fl.organizations where id = %s",
                         tenant.org_id) == [(1,)]
    # The project's audit rows outlive it, the deletion included.
    assert await audit(api, "project.delete") == [
        (tenant.org_id, tenant.project_id, tenant.users["admin"], None, "project",
         str(tenant.project_id), {"name": "doomed"})]
    assert await api.sql("select action from fl.audit_log where project_id = %s order by id",
                         tenant.project_id) == [("project.update",), ("project.delete",)]
    assert (await api.get(f"projects/{tenant.project_id}",
                          token=tenant.tokens["admin"])).status == 404
