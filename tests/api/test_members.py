"""Members: list, add, change role, remove; owners are kept (reference W6), even under races."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import trio

from tests.api.conftest import Answer, Api, Tenant
from tests.api.test_orgs import audit, make_key


async def roles(api: Api, org: uuid.UUID) -> dict[uuid.UUID, str]:
    rows = await api.sql("select user_id, role::text from fl.org_members where org_id = %s", org)
    return dict(rows)


def members_path(tenant: Tenant, user: uuid.UUID | str | None = None) -> str:
    base = f"orgs/{tenant.org_id}/members"
    return base if user is None else f"{base}/{user}"


async def test_list_members_by_email_paged(api: Api, tenant: Tenant) -> None:
    first = await api.get(members_path(tenant), token=tenant.tokens["viewer"],
                          query={"limit": 3})
    assert first.status == 200, first
    assert [m["email"] for m in first.body["items"]] == [
        "admin@example.com", "member@example.com", "owner@example.com"]
    assert first.body["items"][2] == {
        "user_id": str(tenant.users["owner"]), "email": "owner@example.com", "name": None,
        "role": "owner", "created_at": first.body["items"][2]["created_at"]}
    rest = await api.get(members_path(tenant), token=tenant.tokens["viewer"],
                         query={"limit": 3, "cursor": first.body["next_cursor"]})
    assert [m["email"] for m in rest.body["items"]] == ["viewer@example.com"]
    assert rest.body["next_cursor"] is None
    assert (await api.get(members_path(tenant), token=tenant.tokens["outsider"])).status == 404
    assert (await api.get(members_path(tenant))).status == 401
    bad = await api.get(members_path(tenant), token=tenant.tokens["viewer"],
                        query={"cursor": "W10"})
    assert bad.status == 400 and bad.code == "invalid_cursor"


async def test_admin_adds_a_member(api: Api, tenant: Tenant) -> None:
    new, new_token = await api.user("newbie")
    answer = await api.post(members_path(tenant), {"email": "NEWBIE@example.com ",
                                                   "role": "member"},
                            token=tenant.tokens["admin"])
    assert answer.status == 201, answer
    assert answer.body["user_id"] == str(new) and answer.body["role"] == "member"
    assert (await roles(api, tenant.org_id))[new] == "member"
    assert await audit(api, "org.add_member") == [
        (tenant.org_id, None, tenant.users["admin"], None, "org", str(tenant.org_id),
         {"user_id": str(new), "role": "member"})]
    assert (await api.get(f"orgs/{tenant.org_id}", token=new_token)).status == 200


@pytest.mark.parametrize(("who", "body", "status", "code"), [
    ("admin", {"email": "late@example.com", "role": "owner"}, 403, "forbidden"),
    ("member", {"email": "late@example.com", "role": "viewer"}, 403, "forbidden"),
    ("viewer", {"email": "late@example.com", "role": "viewer"}, 403, "forbidden"),
    ("outsider", {"email": "late@example.com", "role": "viewer"}, 404, "not_found"),
    ("admin", {"email": "nobody@example.com", "role": "viewer"}, 404, "user_not_found"),
    ("admin", {"email": "member@example.com", "role": "viewer"}, 409, "already_member"),
    ("admin", {"email": "late@example.com", "role": "boss"}, 400, "invalid_input"),
    ("admin", {"email": "late@example.com"}, 400, "invalid_input"),
    ("admin", {"email": "not an email", "role": "viewer"}, 400, "invalid_input"),
    ("admin", {"email": "late@example.com", "role": "viewer", "note": "hi"}, 400,
     "invalid_input"),
    ("admin", {"email": ["late@example.com"], "role": "viewer"}, 400, "invalid_input"),
])
async def test_refused_additions_change_nothing(api: Api, tenant: Tenant, who: str,
                                                body: dict[str, Any], status: int,
                                                code: str) -> None:
    await api.user("late")
    before = await roles(api, tenant.org_id)
    answer = await api.post(members_path(tenant), body, token=tenant.tokens[who])
    assert (answer.status, answer.code) == (status, code), answer
    assert await roles(api, tenant.org_id) == before
    assert await audit(api, "org.add_member") == []


async def test_only_an_owner_adds_an_owner(api: Api, tenant: Tenant) -> None:
    late, _ = await api.user("late")
    answer = await api.post(members_path(tenant), {"email": "late@example.com", "role": "owner"},
                            token=tenant.tokens["owner"])
    assert answer.status == 201
    assert (await roles(api, tenant.org_id))[late] == "owner"


async def test_member_endpoints_refuse_keys_and_strangers(api: Api, tenant: Tenant) -> None:
    key = await make_key(api, tenant.project_id)
    assert (await api.get(members_path(tenant), token=key)).status == 403
    assert (await api.post(members_path(tenant), {"email": "owner@example.com",
                                                  "role": "viewer"}, token=key)).status == 403
    for call in (api.patch(members_path(tenant, tenant.users["viewer"]), {"role": "admin"}),
                 api.delete(members_path(tenant, tenant.users["viewer"]))):
        assert (await call).status == 401
    # Outsider's org, addressed by acme's owner: 404; malformed user id: 400.
    other = f"orgs/{tenant.other_org_id}/members/{tenant.users['outsider']}"
    assert (await api.patch(other, {"role": "viewer"},
                            token=tenant.tokens["owner"])).status == 404
    assert (await api.delete(other, token=tenant.tokens["owner"])).status == 404
    bad = await api.patch(members_path(tenant, "nope"), {"role": "viewer"},
                          token=tenant.tokens["owner"])
    assert bad.status == 400 and bad.body["field"] == "user_id"
    # A user who is not a member of acme: 404, nothing changes.
    stranger = await api.patch(members_path(tenant, tenant.users["outsider"]),
                               {"role": "viewer"}, token=tenant.tokens["owner"])
    assert stranger.status == 404 and stranger.code == "not_found"
    assert tenant.users["outsider"] not in await roles(api, tenant.org_id)


async def test_change_role_rules(api: Api, tenant: Tenant) -> None:
    viewer, owner = tenant.users["viewer"], tenant.users["owner"]
    answer = await api.patch(members_path(tenant, viewer), {"role": "member"},
                             token=tenant.tokens["admin"])
    assert answer.status == 200 and answer.body["role"] == "member"
    assert await audit(api, "org.change_role") == [
        (tenant.org_id, None, tenant.users["admin"], None, "org", str(tenant.org_id),
         {"user_id": str(viewer), "from": "viewer", "to": "member"})]
    refused: list[tuple[str, uuid.UUID, str, int, str]] = [
        ("admin", viewer, "owner", 403, "forbidden"),        # admin cannot grant owner
        ("admin", owner, "admin", 403, "forbidden"),         # nor demote an owner
        ("member", viewer, "viewer", 403, "forbidden"),
        ("owner", owner, "admin", 409, "last_owner"),        # the last owner stays
        ("owner", viewer, "root", 400, "invalid_input"),
    ]
    for who, target, role, status, code in refused:
        before = await roles(api, tenant.org_id)
        got = await api.patch(members_path(tenant, target), {"role": role},
                              token=tenant.tokens[who])
        assert (got.status, got.code) == (status, code), (who, role, got)
        assert await roles(api, tenant.org_id) == before
    assert len(await audit(api, "org.change_role")) == 1
    # An owner can make another owner, and then step down.
    assert (await api.patch(members_path(tenant, viewer), {"role": "owner"},
                            token=tenant.tokens["owner"])).status == 200
    assert (await api.patch(members_path(tenant, owner), {"role": "admin"},
                            token=tenant.tokens["owner"])).status == 200
    assert await roles(api, tenant.org_id) == {
        owner: "admin", viewer: "owner", tenant.users["admin"]: "admin",
        tenant.users["member"]: "member"}
    assert len(await audit(api, "org.change_role")) == 3


async def test_remove_rules(api: Api, tenant: Tenant) -> None:
    users, tokens = tenant.users, tenant.tokens
    refused = [("member", users["viewer"], 403, "forbidden"),
               ("admin", users["owner"], 403, "forbidden"),
               ("owner", users["owner"], 409, "last_owner"),
               ("outsider", users["viewer"], 404, "not_found")]
    for who, target, status, code in refused:
        got = await api.delete(members_path(tenant, target), token=tokens[who])
        assert (got.status, got.code) == (status, code), (who, got)
    assert len(await roles(api, tenant.org_id)) == 4
    assert await audit(api, "org.remove_member") == []
    # Anyone may leave; an admin removes others.
    assert (await api.delete(members_path(tenant, users["viewer"]),
                             token=tokens["viewer"])).status == 204
    assert (await api.delete(members_path(tenant, users["member"]),
                             token=tokens["admin"])).status == 204
    assert set(await roles(api, tenant.org_id)) == {users["owner"], users["admin"]}
    rows = await audit(api, "org.remove_member")
    assert sorted((r[2], r[6]["user_id"]) for r in rows) == sorted(
        [(users["viewer"], str(users["viewer"])), (users["admin"], str(users["member"]))])
    # Access ends with the membership.
    gone = await api.get(f"orgs/{tenant.org_id}", token=tokens["viewer"])
    assert gone.status == 404
    again = await api.delete(members_path(tenant, users["member"]), token=tokens["admin"])
    assert again.status == 404


async def _hold_member_rows_then_run(api: Api, tenant: Tenant,
                                     requests: list[tuple[str, uuid.UUID]]) -> list[Answer]:
    """Run PATCH role=admin requests while the test holds the org's member rows, so that
    every request has passed its authorisation and waits on the same lock; then let go."""
    answers: list[Answer] = []

    async def demote(who: str, target: uuid.UUID) -> None:
        answers.append(await api.patch(members_path(tenant, target), {"role": "admin"},
                                       token=tenant.tokens[who]))

    await api.conn.execute("begin")
    try:
        await api.conn.execute("select 1 from fl.org_members where org_id = %s for update",
                               (tenant.org_id,))
        async with trio.open_nursery() as nursery:
            for who, target in requests:
                nursery.start_soon(demote, who, target)
            for _ in range(500):
                # pg_stat_activity is read once per transaction unless told to look again.
                await api.sql("select pg_stat_clear_snapshot()")
                [(waiting,)] = await api.sql(
                    "select count(*) from pg_stat_activity where datname = current_database()"
                    " and wait_event_type = 'Lock'")
                if waiting == len(requests):
                    break
                await trio.sleep(0.01)
            else:
                raise AssertionError("the requests never waited on the member rows")
            await api.conn.execute("commit")
    finally:
        await api.conn.execute("rollback")   # a no-op after the commit
    return answers


async def test_two_owners_stepping_down_at_once_leave_one(api: Api, tenant: Tenant) -> None:
    await api.sql("update fl.org_members set role = 'owner' where org_id = %s and user_id = %s",
                  tenant.org_id, tenant.users["admin"])
    answers = await _hold_member_rows_then_run(
        api, tenant, [("owner", tenant.users["owner"]), ("admin", tenant.users["admin"])])
    assert sorted((a.status, a.code) for a in answers) == [(200, None), (409, "last_owner")]
    owners = [u for u, r in (await roles(api, tenant.org_id)).items() if r == "owner"]
    assert len(owners) == 1
    assert len(await audit(api, "org.change_role")) == 1


async def test_two_owners_demoting_each_other_at_once_leave_one(api: Api,
                                                                tenant: Tenant) -> None:
    await api.sql("update fl.org_members set role = 'owner' where org_id = %s and user_id = %s",
                  tenant.org_id, tenant.users["admin"])
    answers = await _hold_member_rows_then_run(
        api, tenant, [("owner", tenant.users["admin"]), ("admin", tenant.users["owner"])])
    # The second to get the lock is no longer an owner: it may not demote one.
    assert sorted((a.status, a.code) for a in answers) == [(200, None), (403, "forbidden")]
    owners = [u for u, r in (await roles(api, tenant.org_id)).items() if r == "owner"]
    assert len(owners) == 1
