"""API keys: created by people, shown once, stored hashed, scoped to one project, revocable."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import pytest

from tests.api.conftest import Api, Tenant
from tests.api.test_orgs import audit, make_key


def keys_path(tenant: Tenant) -> str:
    return f"projects/{tenant.project_id}/api-keys"


async def new_key(api: Api, tenant: Tenant, role: str = "member", **extra: Any) -> Any:
    answer = await api.post(keys_path(tenant), {"name": f"ci-{role}", "role": role, **extra},
                            token=tenant.tokens["admin"])
    assert answer.status == 201, answer
    return answer.body


async def test_create_shows_the_token_once_and_stores_its_hash(api: Api,
                                                               tenant: Tenant) -> None:
    key = await new_key(api, tenant, "member")
    token = key["token"]
    assert token.startswith("flk_") and key["prefix"] == token[:12]
    assert (key["role"], key["name"], key["project_id"], key["created_by"], key["revoked_at"],
            key["expires_at"]) == ("member", "ci-member", str(tenant.project_id),
                                   str(tenant.users["admin"]), None, None)
    assert await api.sql("select token_hash, prefix from fl.api_keys where id = %s",
                         uuid.UUID(key["id"])) == [(hashlib.sha256(token.encode()).digest(),
                                                    token[:12])]
    [(org, project, actor, actor_key, entity, entity_id, detail)] = await audit(
        api, "api_key.create")
    assert (org, project, actor, actor_key, entity, entity_id) == (
        tenant.org_id, tenant.project_id, tenant.users["admin"], None, "api_key", key["id"])
    assert detail == {"name": "ci-member", "role": "member", "prefix": token[:12],
                      "expires_at": None}
    listed = await api.get(keys_path(tenant), token=tenant.tokens["admin"])
    assert listed.status == 200
    [item] = listed.body["items"]
    assert "token" not in item and item == {k: v for k, v in key.items() if k != "token"}
    assert token[12:] not in str(listed.body)


async def test_list_is_newest_first_and_paged(api: Api, tenant: Tenant) -> None:
    made = [(await new_key(api, tenant, role))["id"] for role in ("viewer", "member", "admin")]
    first = await api.get(keys_path(tenant), token=tenant.tokens["admin"], query={"limit": 2})
    assert [k["id"] for k in first.body["items"]] == made[::-1][:2]
    rest = await api.get(keys_path(tenant), token=tenant.tokens["admin"],
                         query={"limit": 2, "cursor": first.body["next_cursor"]})
    assert [k["id"] for k in rest.body["items"]] == made[:1]
    assert rest.body["next_cursor"] is None
    bad = await api.get(keys_path(tenant), token=tenant.tokens["admin"],
                        query={"cursor": first.body["next_cursor"][:-3]})
    assert bad.status == 400 and bad.code == "invalid_cursor"


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "k"}, "role"), ({"role": "viewer"}, "name"),
    ({"name": "k", "role": "owner"}, "role"), ({"name": "k", "role": "god"}, "role"),
    ({"name": "", "role": "viewer"}, "name"), ({"name": "k", "role": None}, "role"),
    ({"name": "k", "role": "viewer", "expires_at": "2000-01-01T00:00:00Z"}, "expires_at"),
    ({"name": "k", "role": "viewer", "expires_at": "tomorrow"}, "expires_at"),
    ({"name": "k", "role": "viewer", "expires_at": "2999-01-01T00:00:00"}, "expires_at"),
    ({"name": "k", "role": "viewer", "token": "flk_mine"}, "token"),
])
async def test_bad_bodies_change_nothing(api: Api, tenant: Tenant, body: dict[str, Any],
                                         field: str) -> None:
    answer = await api.post(keys_path(tenant), body, token=tenant.tokens["admin"])
    assert answer.status == 400 and answer.body["field"] == field, answer
    assert await api.sql("select count(*) from fl.api_keys") == [(0,)]
    assert await api.sql("select count(*) from fl.audit_log") == [(0,)]


async def test_a_key_acts_in_its_project_only(api: Api, tenant: Tenant) -> None:
    key = (await new_key(api, tenant, "admin"))["token"]
    assert (await api.get(f"queues/{tenant.queue_id}", token=key)).status == 200
    assert (await api.get(f"projects/{tenant.project_id}/queues", token=key)).status == 200
    # Another project of the same organization is invisible to it.
    second = await api.post(f"orgs/{tenant.org_id}/projects", {"name": "second"},
                            token=tenant.tokens["admin"])
    [(policy,)] = await api.sql(
        "insert into fl.retry_policies (project_id, name) values (%s, 'p') returning id",
        uuid.UUID(second.body["id"]))
    [(queue,)] = await api.sql("insert into fl.queues (project_id, name, retry_policy_id)"
                               " values (%s, 'q', %s) returning id",
                               uuid.UUID(second.body["id"]), policy)
    assert (await api.get(f"queues/{queue}", token=key)).status == 404
    assert (await api.get(f"projects/{second.body['id']}", token=key)).status == 404
    assert (await api.get(f"queues/{tenant.other_queue_id}", token=key)).status == 404
    # Organization-level endpoints and key management are for people.
    for method, path in (("GET", "orgs"), ("GET", f"orgs/{tenant.org_id}"),
                         ("GET", f"orgs/{tenant.org_id}/members"),
                         ("GET", f"orgs/{tenant.org_id}/audit"),
                         ("GET", keys_path(tenant)), ("GET", "me")):
        answer = await api.call(method, path, token=key)
        assert answer.status == 403 and answer.code == "forbidden", (path, answer)
    made = await api.post(keys_path(tenant), {"name": "child", "role": "viewer"}, token=key)
    assert made.status == 403
    assert await api.sql("select count(*) from fl.api_keys") == [(1,)]


async def test_revoked_and_expired_keys_are_refused(api: Api, tenant: Tenant) -> None:
    key = await new_key(api, tenant, "viewer")
    path = f"queues/{tenant.queue_id}"
    assert (await api.get(path, token=key["token"])).status == 200
    revoked = await api.delete(f"api-keys/{key['id']}", token=tenant.tokens["admin"])
    assert revoked.status == 204
    refused = await api.get(path, token=key["token"])
    assert refused.status == 401 and refused.code == "unauthenticated"
    [row] = await audit(api, "api_key.revoke")
    assert row[5:] == (key["id"], {"changed": True})
    again = await api.delete(f"api-keys/{key['id']}", token=tenant.tokens["admin"])
    assert again.status == 204
    assert [r[6] for r in await audit(api, "api_key.revoke")] == [{"changed": True},
                                                                  {"changed": False}]
    [(revoked_at,)] = await api.sql("select revoked_at from fl.api_keys where id = %s",
                                    uuid.UUID(key["id"]))
    assert revoked_at is not None
    listed = await api.get(keys_path(tenant), token=tenant.tokens["admin"])
    assert listed.body["items"][0]["revoked_at"] is not None
    expiring = await new_key(api, tenant, "viewer", expires_at="2999-01-01T00:00:00Z")
    assert (await api.get(path, token=expiring["token"])).status == 200
    await api.sql("update fl.api_keys set expires_at = fl.now() - interval '1 second'"
                  " where id = %s", uuid.UUID(expiring["id"]))
    assert (await api.get(path, token=expiring["token"])).status == 401


async def test_roles_tenants_and_malformed_ids(api: Api, tenant: Tenant) -> None:
    key = await new_key(api, tenant, "viewer")
    [(foreign,)] = await api.sql(
        "insert into fl.api_keys (project_id, name, role, token_hash, prefix)"
        " values (%s, 'theirs', 'viewer', %s, 'flk_x') returning id",
        tenant.other_project_id, b"\x01" * 32)
    tokens = tenant.tokens
    body = {"name": "k", "role": "viewer"}
    cases: list[tuple[str, str, Any, str | None, int]] = [
        ("POST", keys_path(tenant), body, tokens["member"], 403),
        ("POST", keys_path(tenant), body, tokens["outsider"], 404),
        ("POST", keys_path(tenant), body, None, 401),
        ("POST", f"projects/{tenant.other_project_id}/api-keys", body, tokens["owner"], 404),
        ("POST", "projects/nope/api-keys", body, tokens["owner"], 400),
        ("GET", keys_path(tenant), None, tokens["member"], 403),
        ("GET", keys_path(tenant), None, tokens["outsider"], 404),
        ("GET", keys_path(tenant), None, None, 401),
        ("DELETE", f"api-keys/{key['id']}", None, tokens["member"], 403),
        ("DELETE", f"api-keys/{key['id']}", None, tokens["outsider"], 404),
        ("DELETE", f"api-keys/{foreign}", None, tokens["owner"], 404),
        ("DELETE", f"api-keys/{uuid.uuid4()}", None, tokens["owner"], 404),
        ("DELETE", "api-keys/5", None, tokens["owner"], 400),
        ("DELETE", f"api-keys/{key['id']}", None, None, 401),
        ("DELETE", f"api-keys/{key['id']}", None, key["token"], 403),
    ]
    for method, path, body_, token, status in cases:
        answer = await api.call(method, path, body_, token=token)
        assert answer.status == status, (method, path, answer)
    assert await api.sql("select count(*) from fl.api_keys where revoked_at is not null") == [(0,)]
    assert await api.sql("select count(*) from fl.api_keys") == [(2,)]
    assert await audit(api, "api_key.revoke") == []
    # make_key (SQL) and the endpoint agree on the token format.
    assert (await api.get(f"queues/{tenant.queue_id}",
                          token=await make_key(api, tenant.project_id))).status == 200
