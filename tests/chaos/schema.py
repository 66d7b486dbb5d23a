"""The chaos suite's own tables, beside the engine's, in the chaos database.

``chaos.runs``     one row per handler run that started: (job, fence), the worker's pid.
``chaos.effects``  one row per side effect a handler tried to commit at the end of its run:
                   accepted (its fence was current) or rejected (stale).
``chaos.job_log``  every (fence, status) a job has had, written by a trigger on fl.jobs in
                   the transaction that changed it. It is the independent history the checks
                   hold the handlers' side effects against.
``chaos.lease_log`` every lease that ended, with the expiry it had and when it was deleted:
                   how late the reaper was.

Ordering. ``chaos.seq`` numbers job_log rows and effects alike. A handler takes its number
while it holds ``FOR SHARE`` on the job row, and the trigger takes its number while the
engine holds the row lock for the update; the two locks conflict, so the numbers follow the
order in which the writes really happened. "The last job_log row numbered below an
effect" is therefore the job's state when the effect committed.

No unique keys: a fence that ran twice must show up in the checks as two rows, not as an
error inside a handler.
"""

from __future__ import annotations

SCHEMA = """
create schema chaos;

create sequence chaos.seq;

create table chaos.runs (
    job_id      bigint not null,
    fence       bigint not null,
    attempt     integer not null,
    type        text not null,
    pid         integer not null,
    started_at  timestamptz not null default clock_timestamp()
);

create index runs_job on chaos.runs (job_id, fence);

create table chaos.effects (
    job_id       bigint not null,
    fence        bigint not null,
    pid          integer not null,
    accepted     boolean not null,
    seen_fence   bigint,            -- what the handler found under its lock
    seen_status  fl.job_status,
    seq          bigint not null default nextval('chaos.seq'),
    at           timestamptz not null default clock_timestamp()
);

create index effects_job on chaos.effects (job_id, fence);

create table chaos.job_log (
    job_id  bigint not null,
    fence   bigint not null,
    status  fl.job_status not null,
    seq     bigint not null default nextval('chaos.seq'),
    at      timestamptz not null default clock_timestamp()
);

create index job_log_job on chaos.job_log (job_id, seq);

create function chaos.log_job() returns trigger
language plpgsql as $$
begin
    insert into chaos.job_log (job_id, fence, status) values (new.id, new.fence, new.status);
    return null;
end;
$$;

create table chaos.lease_log (
    job_id      bigint not null,
    fence       bigint not null,
    expires_at  timestamptz not null,
    deleted_at  timestamptz not null default clock_timestamp()
);

create function chaos.log_lease() returns trigger
language plpgsql as $$
begin
    insert into chaos.lease_log (job_id, fence, expires_at)
    values (old.job_id, old.fence, old.expires_at);
    return null;
end;
$$;

create trigger chaos_lease_gone after delete on fl.leases
    for each row execute function chaos.log_lease();

create trigger chaos_log_insert after insert on fl.jobs
    for each row execute function chaos.log_job();

create trigger chaos_log_update after update of status, fence on fl.jobs
    for each row
    when (old.status is distinct from new.status or old.fence is distinct from new.fence)
    execute function chaos.log_job();
"""
