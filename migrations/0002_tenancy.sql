-- 0002: tenancy and queue configuration the engine needs.
--
-- Organizations and projects exist so queues, policies and jobs have owners to point at;
-- users and memberships arrive with the API (issue 4). Everything lives in schema fl so an
-- application that calls fl.submit() inside its own database never collides with its own
-- tables (an app may well have a table called "jobs").
--
-- Queue configuration (written rarely, by people) and queue runtime state (written by claims
-- and reports: token bucket, breaker) are separate tables, so an admin's UPDATE never waits
-- behind a claimer's row lock and the configuration row stays cold and small.

-- UUID version 7: 48-bit unix-ms prefix over random bits. PostgreSQL 18 has uuidv7(), 15 does
-- not, so we carry our own. Ids of the tenancy entities grow at the right edge of their b-trees.
create function fl.uuidv7() returns uuid
language plpgsql volatile parallel safe as $$
declare
    b bytea := uuid_send(gen_random_uuid());
    ms bigint := floor(extract(epoch from clock_timestamp()) * 1000)::bigint;
begin
    b := overlay(b placing substring(int8send(ms) from 3 for 6) from 1 for 6);
    b := set_byte(b, 6, (get_byte(b, 6) & 15) | 112);   -- version 7; variant bits stay 10 (v4)
    return encode(b, 'hex')::uuid;
end;
$$;

comment on function fl.uuidv7() is 'UUID version 7 (time-ordered), for PostgreSQL 15-18 alike.';

create type fl.backoff_kind as enum ('fixed', 'linear', 'exponential');
create type fl.breaker_state as enum ('closed', 'open', 'half_open');

create table fl.organizations (
    id          uuid primary key default fl.uuidv7(),
    name        text not null check (length(name) between 1 and 200),
    created_at  timestamptz not null default fl.now()
);

create table fl.projects (
    id          uuid primary key default fl.uuidv7(),
    org_id      uuid not null references fl.organizations (id) on delete cascade,
    name        text not null check (length(name) between 1 and 200),
    created_at  timestamptz not null default fl.now(),
    unique (org_id, name)
);

-- A policy decides what happens after a failed attempt. Three ceilings, checked separately:
-- every charged attempt counts against max_attempts; lost attempts (worker vanished, lease
-- expired) also count against max_lost; timeouts also against max_timeouts. A snooze gives its
-- attempt back but counts against max_snoozes, so a job cannot snooze for ever.
create table fl.retry_policies (
    id             uuid primary key default fl.uuidv7(),
    project_id     uuid not null references fl.projects (id) on delete cascade,
    name           text not null check (length(name) between 1 and 200),
    kind           fl.backoff_kind not null default 'exponential',
    base_delay_ms  bigint not null default 1000,
    max_delay_ms   bigint not null default 3600000,
    jitter         boolean not null default true,
    max_attempts   integer not null default 5,
    max_lost       integer not null default 3,
    max_timeouts   integer not null default 3,
    max_snoozes    integer not null default 100,
    created_at     timestamptz not null default fl.now(),
    unique (project_id, name),
    unique (project_id, id),   -- target of composite FKs: a job's policy is in its project
    constraint retry_policies_delays check (base_delay_ms >= 0 and max_delay_ms >= base_delay_ms
                                            and max_delay_ms <= 31536000000),
    constraint retry_policies_ceilings check (max_attempts between 1 and 1000
                                              and max_lost between 1 and 1000
                                              and max_timeouts between 1 and 1000
                                              and max_snoozes between 0 and 100000)
);

-- Queue configuration. NULL in a limit column means "no limit".
create table fl.queues (
    id                  uuid primary key default fl.uuidv7(),
    project_id          uuid not null references fl.projects (id) on delete cascade,
    name                text not null check (length(name) between 1 and 200),
    retry_policy_id     uuid not null,
    paused              boolean not null default false,
    default_priority    integer not null default 0,
    default_timeout_ms  integer not null default 300000 check (default_timeout_ms > 0),
    -- Concurrency cap: the number of jobs running (= holding a lease) at once, enforced by
    -- fl.claim under a per-queue transaction advisory lock. NULL = unlimited.
    max_concurrency     integer check (max_concurrency > 0),
    -- Advisory depth cap on submit: jobs waiting (queued, scheduled, retry_wait). NULL = none.
    max_depth           integer check (max_depth > 0),
    -- Token bucket at the claim gate: rl_rate jobs per second, bucket of rl_burst jobs.
    rl_rate             double precision,
    rl_burst            double precision,
    -- Circuit breaker. It trips when, within one window that opens at the first failure,
    -- failures >= breaker_min_volume and failures / outcomes >= breaker_failure_ratio.
    breaker_enabled        boolean not null default true,
    breaker_failure_ratio  double precision not null default 0.5,
    breaker_min_volume     integer not null default 20,
    breaker_window_ms      integer not null default 60000,
    breaker_cooldown_ms    integer not null default 30000,
    -- Priority aging, computed by fl.claim at claim time (nothing is rewritten): a queued
    -- job's effective priority is priority + least(aging_max_boost, floor(ms since run_at /
    -- aging_step_ms)). NULL step = aging off (the claim keeps its plain priority order).
    aging_step_ms       integer,
    aging_max_boost     integer not null default 10,
    created_at          timestamptz not null default fl.now(),
    unique (project_id, name),
    unique (project_id, id),   -- target of the composite FK from jobs
    foreign key (project_id, retry_policy_id)
        references fl.retry_policies (project_id, id) deferrable initially deferred,
    -- W17 of the reference: a rate without a bucket of at least one token admits nothing, ever.
    constraint queues_rate_limit check (
        (rl_rate is null and rl_burst is null)
        or (rl_rate > 0 and rl_rate <= 1000000 and rl_burst >= 1 and rl_burst <= 1000000)),
    constraint queues_breaker check (
        breaker_failure_ratio > 0 and breaker_failure_ratio <= 1
        and breaker_min_volume >= 1
        and breaker_window_ms > 0 and breaker_cooldown_ms > 0),
    -- A step of at most a day; a boost of at most 1000 levels.
    constraint queues_aging check (
        (aging_step_ms is null or aging_step_ms between 1 and 86400000)
        and aging_max_boost between 1 and 1000)
);

comment on column fl.queues.aging_step_ms is
    'Priority aging: one level of boost per this many ms a queued job has waited since its '
    'run_at (when it became due; a retry starts again at its new run_at). NULL = aging off.';
comment on column fl.queues.aging_max_boost is
    'Priority aging: the most levels a job can gain by waiting (effective priority = '
    'priority + least(aging_max_boost, floor(ms waited / aging_step_ms))).';

-- A policy in use cannot be deleted on its own, but deleting its project (which cascades to
-- the policy, the queues and their jobs in an order of PostgreSQL's choosing) must work: the
-- policy FKs of queues and jobs are checked at commit, when the whole cascade is done
-- (reference W5: project deletion failed once work had run).
create index queues_policy on fl.queues (retry_policy_id);

-- Runtime state of a queue, one row per queue, written by the claim gate and the reports.
-- fillfactor 50 keeps these frequent small updates HOT.
create table fl.queue_state (
    queue_id            uuid primary key references fl.queues (id) on delete cascade,
    rl_tokens           double precision not null default 0,
    rl_refilled_at      timestamptz not null default fl.now(),
    breaker_state       fl.breaker_state not null default 'closed',
    breaker_changed_at  timestamptz not null default fl.now(),
    breaker_open_until  timestamptz,
    -- The half-open probe: the one job admitted while half open and the fence it was claimed
    -- at. NULL = no probe in flight. Every way a job can stop running frees or settles it.
    probe_job_id        bigint,
    probe_fence         bigint,
    -- The failure window (closed state only): opened by the first failure, counts outcomes.
    win_started_at      timestamptz,
    win_failures        integer not null default 0,
    win_successes       integer not null default 0,
    constraint queue_state_open_has_until check (breaker_state <> 'open' or breaker_open_until is not null),
    constraint queue_state_probe_only_half_open check (probe_job_id is null or breaker_state = 'half_open'),
    constraint queue_state_probe_whole check ((probe_job_id is null) = (probe_fence is null))
) with (fillfactor = 50);

-- Every queue gets its state row, with a full bucket.
create function fl.queue_state_init() returns trigger
language plpgsql as $$
begin
    insert into fl.queue_state (queue_id, rl_tokens, rl_refilled_at)
    values (new.id, coalesce(new.rl_burst, 0), fl.now());
    return null;
end;
$$;

create trigger queues_state_init after insert on fl.queues
    for each row execute function fl.queue_state_init();

-- Turning the limit on starts with a full bucket; resizing clamps the tokens held (a bigger
-- bucket does not fill itself); turning it off empties it.
create function fl.queue_state_rate_changed() returns trigger
language plpgsql as $$
begin
    update fl.queue_state
       set rl_tokens = case when old.rl_rate is null then coalesce(new.rl_burst, 0)
                            else least(rl_tokens, coalesce(new.rl_burst, 0)) end,
           rl_refilled_at = case when old.rl_rate is null then fl.now() else rl_refilled_at end
     where queue_id = new.id;
    return null;
end;
$$;

create trigger queues_rate_changed after update of rl_rate, rl_burst on fl.queues
    for each row when (old.rl_burst is distinct from new.rl_burst
                       or old.rl_rate is distinct from new.rl_rate)
    execute function fl.queue_state_rate_changed();

alter table fl.queue_state set (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 200);
