"""The roles matrix: every endpoint, called as anonymous, as a member of another organization,
and as viewer, member, admin and owner, answers exactly the status its role implies.

Each call gets a fresh example (its own job, project, member...), so an allowed call by one
role never changes what the next role sees. A denied call must change nothing; the audit log
is compared before and after every denied call. A new endpoint without an example here fails
``test_every_endpoint_is_in_the_matrix``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from fenceline.api.app import RESOURCES
from fenceline.api.authz import at_least
from fenceline.api.endpoint import Endpoint
from tests.api.conftest import PASSWORD, ROLES, Api, Tenant

PRINCIPALS = ("anonymous", "outsider", *reversed(ROLES))   # viewer first, owner last


@dataclass
class Example:
    path: str
    body: Any = None
    query: dict[str, Any] | None = None
    ok: int | None = None          # default: the endpoint's first declared success status
    needs: str | None = None       # when this example needs more than the declared role


Factory = Callable[[Api, Tenant], Awaitable[Example]]
EXAMPLES: dict[str, Factory] = {}


def example(key: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        EXAMPLES[key] = factory
        return factory
    return add


def _n() -> str:
    return uuid.uuid4().hex[:10]


# -- building blocks, straight in SQL ----------------------------------------------------


async def new_user(api: Api) -> tuple[uuid.UUID, str]:
    address = f"u{_n()}@example.com"
    [(uid,)] = await api.sql("insert into fl.users (email, password_hash) values (%s, 'x')"
                             " returning id", address)
    return uid, address


async def new_member(api: Api, t: Tenant, role: str = "viewer") -> uuid.UUID:
    uid, _ = await new_user(api)
    await api.sql("insert into fl.org_members (org_id, user_id, role) values (%s, %s, %s)",
                  t.org_id, uid, role)
    return uid


async def new_org(api: Api, t: Tenant) -> uuid.UUID:
    """A second organization of the tenant's people, with the same roles."""
    [(org,)] = await api.sql("insert into fl.organizations (name) values ('spare') returning id")
    for role in ROLES:
        await api.sql("insert into fl.org_members (org_id, user_id, role) values (%s, %s, %s)",
                      org, t.users[role], role)
    return org


async def new_project(api: Api, t: Tenant) -> uuid.UUID:
    [(p,)] = await api.sql("insert into fl.projects (org_id, name) values (%s, %s) returning id",
                           t.org_id, _n())
    return p


async def new_policy(api: Api, t: Tenant) -> uuid.UUID:
    [(p,)] = await api.sql("insert into fl.retry_policies (project_id, name, max_attempts)"
                           " values (%s, %s, 1) returning id", t.project_id, _n())
    return p


async def new_queue(api: Api, t: Tenant) -> uuid.UUID:
    [(q,)] = await api.sql("insert into fl.queues (project_id, name, retry_policy_id)"
                           " values (%s, %s, %s) returning id",
                           t.project_id, _n(), await new_policy(api, t))
    return q


async def new_job(api: Api, queue: uuid.UUID, **kw: Any) -> int:
    delay = kw.get("delay_s")
    [(outcome, job)] = await api.sql(
        "select outcome, job_id from fl.submit(%s, 't', '{}'::jsonb, p_delay_s => %s)",
        queue, delay)
    assert outcome == "ok"
    return int(job)


async def dead_job(api: Api, t: Tenant) -> int:
    queue = await new_queue(api, t)    # its policy allows one attempt
    job = await new_job(api, queue)
    [(worker,)] = await api.sql("select fl.register_worker(%s, null, 'h', 1, 1)", [queue])
    [(_, _, fence, *_)] = await api.sql(
        "select * from fl.claim(%s, %s, null, 1, '30 seconds'::interval)", queue, worker)
    [(outcome, *_)] = await api.sql("select * from fl.fail(%s, %s, %s, 'permanent', 'x')",
                                    worker, job, fence)
    assert outcome == "dead", outcome
    return job


# -- one example per endpoint ------------------------------------------------------------


@example("POST /auth/register")
async def _register(api: Api, t: Tenant) -> Example:
    return Example("auth/register", {"email": f"r{_n()}@example.com", "password": PASSWORD})


@example("POST /auth/login")
async def _login(api: Api, t: Tenant) -> Example:
    return Example("auth/login", {"email": "viewer@example.com", "password": PASSWORD})


@example("POST /auth/logout")
async def _logout(api: Api, t: Tenant) -> Example:
    return Example("auth/logout")


@example("GET /me")
async def _me(api: Api, t: Tenant) -> Example:
    return Example("me")


@example("POST /queues/{queue_id}/jobs")
async def _submit(api: Api, t: Tenant) -> Example:
    return Example(f"queues/{t.queue_id}/jobs", {"type": "noop"}, ok=201)


@example("POST /queues/{queue_id}/jobs/batch")
async def _batch(api: Api, t: Tenant) -> Example:
    return Example(f"queues/{t.queue_id}/jobs/batch", {"jobs": [{"type": "noop"}]}, ok=201)


@example("GET /batches/{batch_id}")
async def _batch_progress(api: Api, t: Tenant) -> Example:
    made = await api.post(f"queues/{t.queue_id}/jobs/batch", {"jobs": [{"type": "noop"}]},
                          token=t.tokens["owner"])
    return Example(f"batches/{made.body['batch_id']}")


@example("POST /orgs")
async def _org_create(api: Api, t: Tenant) -> Example:
    return Example("orgs", {"name": "new"})


@example("GET /orgs")
async def _org_list(api: Api, t: Tenant) -> Example:
    return Example("orgs")


@example("GET /orgs/{org_id}")
async def _org_read(api: Api, t: Tenant) -> Example:
    return Example(f"orgs/{t.org_id}")


@example("PATCH /orgs/{org_id}")
async def _org_update(api: Api, t: Tenant) -> Example:
    return Example(f"orgs/{t.org_id}", {"name": _n()})


@example("DELETE /orgs/{org_id}")
async def _org_delete(api: Api, t: Tenant) -> Example:
    return Example(f"orgs/{await new_org(api, t)}")


@example("GET /orgs/{org_id}/members")
async def _members(api: Api, t: Tenant) -> Example:
    return Example(f"orgs/{t.org_id}/members")


@example("POST /orgs/{org_id}/members")
async def _member_add(api: Api, t: Tenant) -> Example:
    _, address = await new_user(api)
    return Example(f"orgs/{t.org_id}/members", {"email": address, "role": "viewer"})


@example("PATCH /orgs/{org_id}/members/{user_id}")
async def _member_role(api: Api, t: Tenant) -> Example:
    return Example(f"orgs/{t.org_id}/members/{await new_member(api, t)}", {"role": "member"})


@example("DELETE /orgs/{org_id}/members/{user_id}")
async def _member_remove(api: Api, t: Tenant) -> Example:
    # Removing someone else needs admin; anyone may remove themself (tests/api/test_members).
    return Example(f"orgs/{t.org_id}/members/{await new_member(api, t)}", needs="admin")


@example("POST /orgs/{org_id}/projects")
async def _project_create(api: Api, t: Tenant) -> Example:
    return Example(f"orgs/{t.org_id}/projects", {"name": _n()})


@example("GET /orgs/{org_id}/projects")
async def _project_list(api: Api, t: Tenant) -> Example:
    return Example(f"orgs/{t.org_id}/projects")


@example("GET /projects/{project_id}")
async def _project_read(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}")


@example("PATCH /projects/{project_id}")
async def _project_update(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}", {"name": _n()})


@example("DELETE /projects/{project_id}")
async def _project_delete(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{await new_project(api, t)}")


@example("POST /projects/{project_id}/retry-policies")
async def _policy_create(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}/retry-policies", {"name": _n()})


@example("GET /projects/{project_id}/retry-policies")
async def _policy_list(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}/retry-policies")


@example("GET /retry-policies/{policy_id}")
async def _policy_read(api: Api, t: Tenant) -> Example:
    return Example(f"retry-policies/{t.policy_id}")


@example("PATCH /retry-policies/{policy_id}")
async def _policy_update(api: Api, t: Tenant) -> Example:
    return Example(f"retry-policies/{t.policy_id}", {"max_attempts": 7})


@example("DELETE /retry-policies/{policy_id}")
async def _policy_delete(api: Api, t: Tenant) -> Example:
    return Example(f"retry-policies/{await new_policy(api, t)}")


@example("POST /projects/{project_id}/queues")
async def _queue_create(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}/queues",
                   {"name": _n(), "retry_policy_id": str(t.policy_id)})


@example("GET /projects/{project_id}/queues")
async def _queue_list(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}/queues")


@example("GET /queues/{queue_id}")
async def _queue_read(api: Api, t: Tenant) -> Example:
    return Example(f"queues/{t.queue_id}")


@example("PATCH /queues/{queue_id}")
async def _queue_update(api: Api, t: Tenant) -> Example:
    return Example(f"queues/{t.queue_id}", {"max_concurrency": 5})


@example("DELETE /queues/{queue_id}")
async def _queue_delete(api: Api, t: Tenant) -> Example:
    return Example(f"queues/{await new_queue(api, t)}")


@example("POST /queues/{queue_id}/pause")
async def _queue_pause(api: Api, t: Tenant) -> Example:
    return Example(f"queues/{t.queue_id}/pause")


@example("POST /queues/{queue_id}/resume")
async def _queue_resume(api: Api, t: Tenant) -> Example:
    return Example(f"queues/{t.queue_id}/resume")


@example("POST /projects/{project_id}/api-keys")
async def _key_create(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}/api-keys", {"name": "ci", "role": "member"})


@example("GET /projects/{project_id}/api-keys")
async def _key_list(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}/api-keys")


@example("DELETE /api-keys/{key_id}")
async def _key_revoke(api: Api, t: Tenant) -> Example:
    made = await api.post(f"projects/{t.project_id}/api-keys", {"name": "k", "role": "viewer"},
                          token=t.tokens["owner"])
    return Example(f"api-keys/{made.body['id']}")


@example("GET /projects/{project_id}/audit")
async def _audit_project(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}/audit")


@example("GET /orgs/{org_id}/audit")
async def _audit_org(api: Api, t: Tenant) -> Example:
    return Example(f"orgs/{t.org_id}/audit")


@example("GET /jobs")
async def _jobs(api: Api, t: Tenant) -> Example:
    return Example("jobs", query={"project": str(t.project_id)})


@example("GET /jobs/{job_id}")
async def _job_read(api: Api, t: Tenant) -> Example:
    return Example(f"jobs/{await new_job(api, t.queue_id)}")


@example("POST /jobs/{job_id}/cancel")
async def _job_cancel(api: Api, t: Tenant) -> Example:
    return Example(f"jobs/{await new_job(api, t.queue_id)}/cancel")


@example("POST /jobs/{job_id}/retry")
async def _job_retry(api: Api, t: Tenant) -> Example:
    return Example(f"jobs/{await new_job(api, t.queue_id, delay_s=3600)}/retry")


@example("GET /dead-letters")
async def _dead_letters(api: Api, t: Tenant) -> Example:
    return Example("dead-letters", query={"project": str(t.project_id)})


@example("GET /dead-letters/{job_id}")
async def _dead_letter(api: Api, t: Tenant) -> Example:
    return Example(f"dead-letters/{await dead_job(api, t)}")


@example("POST /jobs/{job_id}/replay")
async def _replay(api: Api, t: Tenant) -> Example:
    return Example(f"jobs/{await dead_job(api, t)}/replay")


@example("POST /queues/{queue_id}/dead-letters/replay")
async def _replay_bulk(api: Api, t: Tenant) -> Example:
    return Example(f"queues/{await new_queue(api, t)}/dead-letters/replay", {})


@example("GET /workers")
async def _workers(api: Api, t: Tenant) -> Example:
    return Example("workers", query={"project": str(t.project_id)})


@example("GET /projects/{project_id}/events")
async def _events(api: Api, t: Tenant) -> Example:
    return Example(f"projects/{t.project_id}/events")


# -- the matrix --------------------------------------------------------------------------


def _endpoints() -> dict[str, Endpoint]:
    return {f"{ep.method} {ep.path}": ep for r in RESOURCES for ep in r.endpoints}


def expected(ep: Endpoint, ex: Example, principal: str) -> int:
    ok = ex.ok or min(ep.responses)
    if ep.role is None:
        return ok
    if principal == "anonymous":
        return 401
    if ep.role == "user":
        return ok
    if principal == "outsider":
        return 404
    return ok if at_least(principal, ex.needs or ep.role) else 403


def test_every_endpoint_is_in_the_matrix() -> None:
    assert sorted(_endpoints()) == sorted(EXAMPLES)


@pytest.mark.parametrize("key", sorted(EXAMPLES))
async def test_roles_matrix(api: Api, tenant: Tenant, key: str) -> None:
    ep = _endpoints()[key]
    seen: dict[str, int] = {}
    want: dict[str, int] = {}
    for principal in PRINCIPALS:
        ex = await EXAMPLES[key](api, tenant)
        token = None if principal == "anonymous" else tenant.tokens[principal]
        before = await api.sql("select count(*) from fl.audit_log")
        answer = await api.call(ep.method, ex.path, ex.body, token=token, query=ex.query)
        seen[principal] = answer.status
        want[principal] = expected(ep, ex, principal)
        if answer.status >= 400:
            assert answer.headers["Content-Type"] == "application/problem+json", answer
            assert await api.sql("select count(*) from fl.audit_log") == before, (
                f"{principal}: a refused call wrote an audit row")
        elif ep.audit is not None:
            [(action,)] = await api.sql("select action from fl.audit_log order by id desc limit 1")
            assert action == ep.audit
    assert seen == want


@pytest.mark.parametrize("key", sorted(EXAMPLES))
async def test_dead_tokens_and_oversize_bodies_change_nothing(api: Api, tenant: Tenant,
                                                              key: str) -> None:
    """Every endpoint: a revoked session, an expired session, a revoked API key and a body
    over the 4 MiB cap are refused (401, 401, 401, 413), and nothing is written."""
    ep = _endpoints()[key]
    _, revoked = await api.user(f"revoked{_n()}")
    _, expired = await api.user(f"expired{_n()}")
    made = await api.post(f"projects/{tenant.project_id}/api-keys",
                          {"name": "dead", "role": "admin"}, token=tenant.tokens["owner"])
    dead_key = made.body["token"]
    await api.sql("update fl.sessions set revoked_at = fl.now() where user_id = "
                  "(select id from fl.users where email like 'revoked%%')")
    await api.sql("update fl.sessions set expires_at = fl.now() - interval '1 second'"
                  " where user_id = (select id from fl.users where email like 'expired%%')")
    await api.sql("update fl.api_keys set revoked_at = fl.now() where id = %s",
                  uuid.UUID(made.body["id"]))
    ex = await EXAMPLES[key](api, tenant)
    before = await api.sql("select (select count(*) from fl.audit_log),"
                           " (select count(*) from fl.jobs), (select count(*) from fl.users)")
    if ep.role is not None:
        for token in (revoked, expired, dead_key):
            answer = await api.call(ep.method, ex.path, ex.body, token=token, query=ex.query)
            assert (answer.status, answer.code) == (401, "unauthenticated"), (token[:4], answer)
    oversize = b'{"pad": "' + b"x" * (4 * 1024 * 1024) + b'"}'
    answer = await api.call(ep.method, ex.path, raw=oversize, query=ex.query,
                            token=tenant.tokens["owner"],
                            headers={"Content-Type": "application/json"})
    assert (answer.status, answer.code) == (413, "payload_too_large"), answer
    assert await api.sql("select (select count(*) from fl.audit_log),"
                         " (select count(*) from fl.jobs),"
                         " (select count(*) from fl.users)") == before
