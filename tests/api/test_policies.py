"""Retry policies: ranges from the schema, the cross-field rule, deletion only when unused."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.api.conftest import Api, Tenant
from tests.api.test_orgs import audit, make_key

COUNT = "select count(*) from fl.retry_policies"
FULL = {"name": "careful", "kind": "linear", "base_delay_ms": 500, "max_delay_ms": 60_000,
        "jitter": False, "max_attempts": 10, "max_lost": 2, "max_timeouts": 4,
        "max_snoozes": 0}


def create_path(tenant: Tenant) -> str:
    return f"projects/{tenant.project_id}/retry-policies"


async def test_create_with_every_field_and_with_defaults(api: Api, tenant: Tenant) -> None:
    answer = await api.post(create_path(tenant), FULL, token=tenant.tokens["admin"])
    assert answer.status == 201, answer
    assert {k: answer.body[k] for k in FULL} == FULL
    assert answer.body["project_id"] == str(tenant.project_id)
    [(org, project, actor, key, entity, entity_id, detail)] = await audit(api, "policy.create")
    assert (org, project, actor, key, entity) == (tenant.org_id, tenant.project_id,
                                                  tenant.users["admin"], None, "policy")
    assert entity_id == answer.body["id"] and detail == FULL
    plain = await api.post(create_path(tenant), {"name": "plain"}, token=tenant.tokens["owner"])
    assert plain.status == 201
    assert {k: plain.body[k] for k in FULL if k != "name"} == {
        "kind": "exponential", "base_delay_ms": 1000, "max_delay_ms": 3_600_000, "jitter": True,
        "max_attempts": 5, "max_lost": 3, "max_timeouts": 3, "max_snoozes": 100}
    read = await api.get(f"retry-policies/{answer.body['id']}", token=tenant.tokens["viewer"])
    assert read.status == 200 and read.body == answer.body
    listed = await api.get(create_path(tenant), token=tenant.tokens["viewer"], query={"limit": 2})
    assert [p["name"] for p in listed.body["items"]] == ["careful", "default"]
    more = await api.get(create_path(tenant), token=tenant.tokens["viewer"],
                         query={"limit": 2, "cursor": listed.body["next_cursor"]})
    assert [p["name"] for p in more.body["items"]] == ["plain"]
    assert more.body["next_cursor"] is None


@pytest.mark.parametrize(("change", "field"), [
    ({"name": ""}, "name"), ({"name": "  "}, "name"), ({"name": None}, "name"),
    ({"kind": "random"}, "kind"), ({"kind": None}, "kind"),
    ({"base_delay_ms": -1}, "base_delay_ms"), ({"base_delay_ms": 1.5}, "base_delay_ms"),
    ({"base_delay_ms": "1000"}, "base_delay_ms"),
    ({"max_delay_ms": 31_536_000_001}, "max_delay_ms"),
    ({"max_delay_ms": 2**63}, "max_delay_ms"),
    ({"base_delay_ms": 5000, "max_delay_ms": 4000}, "max_delay_ms"),   # cross-field
    ({"jitter": "yes"}, "jitter"),
    ({"max_attempts": 0}, "max_attempts"), ({"max_attempts": 1001}, "max_attempts"),
    ({"max_lost": 0}, "max_lost"), ({"max_timeouts": 1001}, "max_timeouts"),
    ({"max_snoozes": -1}, "max_snoozes"), ({"max_snoozes": 100_001}, "max_snoozes"),
    ({"max_lost_attempts": 3}, "max_lost_attempts"),
])
async def test_bad_values_name_the_field_and_change_nothing(api: Api, tenant: Tenant,
                                                            change: dict[str, Any],
                                                            field: str) -> None:
    before = await api.sql("select * from fl.retry_policies order by id")
    created = await api.post(create_path(tenant), {"name": "p", **change},
                             token=tenant.tokens["admin"])
    patched = await api.patch(f"retry-policies/{tenant.policy_id}", change,
                              token=tenant.tokens["admin"])
    for answer in (created, patched):
        assert answer.status == 400 and answer.code == "invalid_input", answer
        assert answer.body["field"] == field
    assert await api.sql("select * from fl.retry_policies order by id") == before
    assert await api.sql("select count(*) from fl.audit_log") == [(0,)]


async def test_patch_merges_and_checks_delays_against_stored_values(api: Api,
                                                                     tenant: Tenant) -> None:
    path = f"retry-policies/{tenant.policy_id}"
    # Stored: base 1000, max 3,600,000. A max below the stored base is refused.
    low = await api.patch(path, {"max_delay_ms": 999}, token=tenant.tokens["admin"])
    assert low.status == 400 and low.body["field"] == "max_delay_ms"
    high = await api.patch(path, {"base_delay_ms": 3_600_001}, token=tenant.tokens["admin"])
    assert high.status == 400 and high.body["field"] == "max_delay_ms"
    ok = await api.patch(path, {"max_attempts": 9, "kind": "fixed"}, token=tenant.tokens["admin"])
    assert ok.status == 200, ok
    assert (ok.body["max_attempts"], ok.body["kind"], ok.body["base_delay_ms"],
            ok.body["jitter"]) == (9, "fixed", 1000, False)
    [row] = await audit(api, "policy.update")
    assert row[6] == {"max_attempts": 9, "kind": "fixed"}
    same = await api.patch(path, {}, token=tenant.tokens["admin"])
    assert same.status == 200 and same.body == ok.body
    await api.post(create_path(tenant), {"name": "other"}, token=tenant.tokens["admin"])
    taken = await api.patch(path, {"name": "other"}, token=tenant.tokens["admin"])
    assert taken.status == 409 and taken.code == "name_taken"
    dup = await api.post(create_path(tenant), {"name": "default"}, token=tenant.tokens["admin"])
    assert dup.status == 409 and dup.code == "name_taken"
    assert await api.sql(COUNT) == [(3,)]   # acme's two and globex's one


async def test_delete_only_when_unused(api: Api, tenant: Tenant) -> None:
    admin = tenant.tokens["admin"]
    in_use = await api.delete(f"retry-policies/{tenant.policy_id}", token=admin)
    assert in_use.status == 409 and in_use.code == "policy_in_use"
    assert "work" in in_use.body["detail"]
    # A policy only a job uses (given at submit) is in use too.
    spare = await api.post(create_path(tenant), {"name": "spare"}, token=admin)
    spare_id = uuid.UUID(spare.body["id"])
    await api.sql("select * from fl.submit(%s, 't', p_retry_policy => %s)", tenant.queue_id,
                  spare_id)
    by_job = await api.delete(f"retry-policies/{spare_id}", token=admin)
    assert by_job.status == 409 and by_job.code == "policy_in_use", by_job
    assert await api.sql(COUNT) == [(3,)]
    assert await audit(api, "policy.delete") == []
    await api.sql("delete from fl.jobs")
    gone = await api.delete(f"retry-policies/{spare_id}", token=admin)
    assert gone.status == 204
    assert await api.sql(COUNT) == [(2,)]
    assert [r[5:] for r in await audit(api, "policy.delete")] == [(str(spare_id),
                                                                   {"name": "spare"})]
    assert (await api.get(f"retry-policies/{spare_id}", token=admin)).status == 404


async def test_roles_tenants_and_malformed_ids(api: Api, tenant: Tenant) -> None:
    tokens, policy = tenant.tokens, tenant.policy_id
    [(other_policy,)] = await api.sql(
        "select id from fl.retry_policies where project_id = %s", tenant.other_project_id)
    cases: list[tuple[str, str, Any, str | None, int]] = [
        ("POST", create_path(tenant), {"name": "n"}, tokens["member"], 403),
        ("POST", create_path(tenant), {"name": "n"}, tokens["outsider"], 404),
        ("POST", create_path(tenant), {"name": "n"}, None, 401),
        ("POST", f"projects/{tenant.other_project_id}/retry-policies", {"name": "n"},
         tokens["owner"], 404),
        ("POST", "projects/nope/retry-policies", {"name": "n"}, tokens["owner"], 400),
        ("GET", create_path(tenant), None, tokens["outsider"], 404),
        ("GET", f"retry-policies/{policy}", None, tokens["outsider"], 404),
        ("GET", f"retry-policies/{other_policy}", None, tokens["owner"], 404),
        ("GET", f"retry-policies/{uuid.uuid4()}", None, tokens["owner"], 404),
        ("GET", "retry-policies/12", None, tokens["owner"], 400),
        ("GET", f"retry-policies/{policy}", None, None, 401),
        ("PATCH", f"retry-policies/{policy}", {"max_attempts": 2}, tokens["member"], 403),
        ("PATCH", f"retry-policies/{policy}", {"max_attempts": 2}, tokens["outsider"], 404),
        ("PATCH", f"retry-policies/{other_policy}", {"max_attempts": 2}, tokens["owner"], 404),
        ("PATCH", f"retry-policies/{policy}", {"max_attempts": 2}, None, 401),
        ("DELETE", f"retry-policies/{policy}", None, tokens["member"], 403),
        ("DELETE", f"retry-policies/{policy}", None, tokens["outsider"], 404),
        ("DELETE", f"retry-policies/{other_policy}", None, tokens["owner"], 404),
        ("DELETE", f"retry-policies/{policy}", None, None, 401),
    ]
    before = await api.sql("select * from fl.retry_policies order by id")
    for method, path, body, token, status in cases:
        answer = await api.call(method, path, body, token=token)
        assert answer.status == status, (method, path, answer)
    assert await api.sql("select * from fl.retry_policies order by id") == before
    assert await api.sql("select count(*) from fl.audit_log") == [(0,)]
    # An admin key of the project manages its policies.
    key = await make_key(api, tenant.project_id, "admin")
    made = await api.post(create_path(tenant), {"name": "by-key"}, token=key)
    assert made.status == 201
    [row] = await audit(api, "policy.create")
    assert row[2] is None and row[3] is not None
