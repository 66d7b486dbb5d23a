-- 0003: jobs, the attempt ledger, leases, the state machine and its guard, the outbox.
--
-- Shape rules (docs/SCHEMA.md has the reasons at length):
--   * jobs carries only what the claim and the reports need; every index on jobs costs a
--     b-tree insert per claim and per completion (status sits in partial-index predicates, so
--     no status change is a HOT update). There are three: the primary key, the claimable
--     index and the delayed index.
--   * A claim goes straight to 'running' (there is no 'claimed' state and no separate start).
--   * The lease lives in fl.leases, keyed by job, so heartbeats never rewrite a job row, and a
--     second lease for one job cannot exist.
--   * The ledger (fl.attempts) has one row per claim, keyed (job_id, fence): every claim raises
--     the fence, so the fence names the attempt.

create type fl.job_status as enum
    ('scheduled', 'queued', 'running', 'retry_wait', 'completed', 'dead_letter', 'cancelled');

create type fl.attempt_outcome as enum
    ('success', 'retryable_error', 'permanent_error', 'timeout', 'lost',
     'snoozed', 'released', 'cancelled');

-- Workers register themselves; a lease must name a registered worker.
create table fl.workers (
    id            uuid primary key default fl.uuidv7(),
    hostname      text not null check (length(hostname) between 1 and 255),
    pid           integer not null check (pid > 0),
    handlers      text[],                       -- job types it runs; NULL = any type
    concurrency   integer not null check (concurrency between 1 and 100000),
    state         text not null default 'active'
                  check (state in ('active', 'draining', 'stopped', 'dead')),
    started_at    timestamptz not null default fl.now(),
    last_seen_at  timestamptz not null default fl.now(),
    meta          jsonb
);

create index workers_live on fl.workers (last_seen_at) where state in ('active', 'draining');

create table fl.worker_queues (
    worker_id  uuid not null references fl.workers (id) on delete cascade,
    queue_id   uuid not null references fl.queues (id) on delete cascade,
    primary key (worker_id, queue_id)
);

create index worker_queues_queue on fl.worker_queues (queue_id, worker_id);

create table fl.jobs (
    id                    bigint generated always as identity primary key,
    project_id            uuid not null,
    queue_id              uuid not null,
    type                  text not null,
    payload               jsonb not null default '{}',
    status                fl.job_status not null default 'queued',
    priority              integer not null default 0,
    run_at                timestamptz not null,
    -- Ownership counter: raised by every change of hands (claim, snooze, reap, cancel of a
    -- held job, release, replay). Never goes down (trigger below).
    fence                 bigint not null default 0,
    -- Attempts charged in this replay generation, the running one included. A claim charges
    -- one; release and snooze give it back; a lost attempt keeps it.
    attempts              integer not null default 0,
    lost_count            integer not null default 0,
    timeout_count         integer not null default 0,
    snooze_count          integer not null default 0,
    replay_generation     integer not null default 0,
    timeout_ms            integer not null,
    retry_policy_id       uuid not null,
    deadline_at           timestamptz,            -- while running: claim time + timeout_ms
    cancel_requested_at   timestamptz,            -- cancel of a running job, until it stops
    created_at            timestamptz not null default fl.now(),
    claimed_at            timestamptz,            -- last claim
    finished_at           timestamptz,            -- set exactly while terminal
    -- Room for issue 4 (batches, dependencies); the promote index already honours pending_deps.
    batch_id              uuid,
    pending_deps          integer not null default 0,
    foreign key (project_id, queue_id) references fl.queues (project_id, id) on delete cascade,
    foreign key (project_id, retry_policy_id)
        references fl.retry_policies (project_id, id) deferrable initially deferred,
    constraint jobs_type_sane check (length(type) between 1 and 200),
    constraint jobs_payload_size check (pg_column_size(payload) <= 262144),
    constraint jobs_timeout_positive check (timeout_ms > 0),
    constraint jobs_counters check (fence >= 0 and attempts >= 0 and lost_count >= 0
                                    and timeout_count >= 0 and snooze_count >= 0
                                    and replay_generation >= 0 and pending_deps >= 0),
    constraint jobs_terminal_has_finished check (
        (status in ('completed', 'dead_letter', 'cancelled')) = (finished_at is not null)),
    constraint jobs_running_has_deadline check (
        (status = 'running' and deadline_at is not null and claimed_at is not null)
        or (status <> 'running' and deadline_at is null)),
    constraint jobs_cancel_request_only_running check (
        cancel_requested_at is null or status = 'running'),
    constraint jobs_deps_only_scheduled check (pending_deps = 0 or status = 'scheduled')
) with (fillfactor = 85);

-- The claim reads this index in its ORDER BY order, one type at a time, so a backlog of types
-- the worker does not handle is never walked (reference W17). Partial: it is the size of the
-- backlog, not of the table.
create index jobs_claimable on fl.jobs (queue_id, type, priority desc, run_at, id)
    where status = 'queued';

-- Jobs waiting for a time (delayed, snoozed, backing off). The claim promotes the due ones of
-- its queue before it claims, and fl.promote sweeps every queue.
create index jobs_delayed on fl.jobs (queue_id, run_at)
    where status in ('scheduled', 'retry_wait') and pending_deps = 0;

-- vacuum_index_cleanup = on: with a large history VACUUM's "auto" mode skips index cleanup,
-- leaving dead entries at the head of jobs_claimable for every claim to read past (bench:
-- 43 blocks per claim after VACUUM, 128 after 10,000 more claims, 47 after INDEX_CLEANUP ON).
alter table fl.jobs set (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 200,
                         autovacuum_analyze_scale_factor = 0.02, vacuum_index_cleanup = on);

-- The legal edges. The trigger below enforces exactly these (fl.legal_transition); the end of
-- this file checks that the function and the table agree, and tests/engine checks that the
-- functions perform every edge and no other.
create table fl.job_transitions (
    from_status  fl.job_status not null,
    to_status    fl.job_status not null,
    performed_by text not null,
    primary key (from_status, to_status)
);

insert into fl.job_transitions (from_status, to_status, performed_by) values
    ('scheduled',   'queued',      'fl.promote / fl.claim promoting due jobs; fl.retry'),
    ('scheduled',   'cancelled',   'fl.cancel'),
    ('queued',      'running',     'fl.claim (fence + 1, attempt charged, lease, ledger row)'),
    ('queued',      'cancelled',   'fl.cancel'),
    ('running',     'completed',   'fl.complete'),
    ('running',     'retry_wait',  'fl.fail with attempts left; fl.reap (lost, timeout)'),
    ('running',     'dead_letter', 'fl.fail permanent or exhausted; fl.reap exhausted; fl.snooze out of snoozes'),
    ('running',     'cancelled',   'the holder''s report or fl.reap after fl.cancel asked it to stop'),
    ('running',     'queued',      'fl.release (drain: fence + 1, attempt given back)'),
    ('running',     'scheduled',   'fl.snooze (fence + 1, attempt given back)'),
    ('retry_wait',  'queued',      'fl.promote / fl.claim promoting due jobs; fl.retry'),
    ('retry_wait',  'cancelled',   'fl.cancel'),
    ('dead_letter', 'queued',      'fl.replay / fl.replay_dead (attempts reset, generation + 1)');

create function fl.legal_transition(p_from fl.job_status, p_to fl.job_status) returns boolean
language sql immutable parallel safe as $$
    select case p_from
        when 'scheduled'   then p_to in ('queued', 'cancelled')
        when 'queued'      then p_to in ('running', 'cancelled')
        when 'running'     then p_to in ('completed', 'retry_wait', 'dead_letter', 'cancelled',
                                         'queued', 'scheduled')
        when 'retry_wait'  then p_to in ('queued', 'cancelled')
        when 'dead_letter' then p_to = 'queued'
        else false
    end
$$;

-- Rejects any status change that is not an edge and any fence that goes down: SQLSTATE FL100
-- and FL101. Only fires when status or fence changes.
create function fl.jobs_guard() returns trigger
language plpgsql as $$
begin
    if new.fence < old.fence then
        raise exception 'fence of job % would go down from % to %', old.id, old.fence, new.fence
            using errcode = 'FL101';
    end if;
    if new.status is distinct from old.status then
        if not fl.legal_transition(old.status, new.status) then
            raise exception 'illegal status change of job % from % to %',
                old.id, old.status, new.status
                using errcode = 'FL100';
        end if;
    end if;
    return new;
end;
$$;

create trigger jobs_guard before update of status, fence on fl.jobs
    for each row when (old.status is distinct from new.status or old.fence is distinct from new.fence)
    execute function fl.jobs_guard();

-- A job is born waiting, with nothing charged: SQLSTATE FL102 otherwise.
create function fl.jobs_birth() returns trigger
language plpgsql as $$
begin
    if new.status not in ('queued', 'scheduled') or new.fence <> 0 or new.attempts <> 0
       or new.lost_count <> 0 or new.timeout_count <> 0 or new.snooze_count <> 0
       or new.replay_generation <> 0 or new.deadline_at is not null
       or new.claimed_at is not null or new.finished_at is not null then
        raise exception 'a job must be inserted queued or scheduled, with fresh counters'
            using errcode = 'FL102';
    end if;
    return new;
end;
$$;

create trigger jobs_birth before insert on fl.jobs
    for each row execute function fl.jobs_birth();

-- The ledger: one row per claim. Closing a row only touches unindexed columns, so with
-- fillfactor 50 it is a HOT update. No foreign key to jobs: the claim writes the row in the
-- statement that updates the job, and an FK check would take a KEY SHARE lock on the job row
-- just updated (one more WAL record per job); deleting jobs deletes their ledger through the
-- jobs_deleted trigger below.
create table fl.attempts (
    job_id             bigint not null,
    fence              bigint not null,
    replay_generation  integer not null,
    attempt            integer not null,       -- jobs.attempts after this claim charged it
    queue_id           uuid not null,
    worker_id          uuid not null,          -- no FK: history outlives worker rows
    started_at         timestamptz not null,
    deadline_at        timestamptz not null,
    finished_at        timestamptz,
    outcome            fl.attempt_outcome,
    error_class        text,
    error_message      text,
    result             jsonb,
    primary key (job_id, fence),
    constraint attempts_outcome_with_finish check ((outcome is null) = (finished_at is null))
) with (fillfactor = 50);

alter table fl.attempts set (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 500);

-- Log lines of one attempt (handler job.log(...)), appended by fl.append_logs.
create table fl.attempt_logs (
    id        bigint generated always as identity,
    job_id    bigint not null,
    fence     bigint not null,
    ts        timestamptz not null,
    level     text not null check (level in ('debug', 'info', 'warn', 'error')),
    message   text not null check (length(message) <= 16384),
    meta      jsonb,
    primary key (job_id, fence, id),
    foreign key (job_id, fence) references fl.attempts (job_id, fence) on delete cascade
);

-- The lease: who holds a running job, until when. Exists exactly while the job is running
-- (same fence). Keyed (queue_id, job_id): a job has one queue, so still at most one lease per
-- job, and the one index serves every reader: the cap counts a queue's leases, the reaper
-- reads a queue's leases for expired ones, reports find theirs by (queue, job). expires_at is
-- in no index, so a heartbeat is a HOT update. No FK to jobs, for the reason given on
-- fl.attempts; the worker must be registered.
create table fl.leases (
    queue_id      uuid not null,
    job_id        bigint not null,
    worker_id     uuid not null references fl.workers (id),
    fence         bigint not null,
    expires_at    timestamptz not null,
    heartbeat_at  timestamptz not null,
    progress      jsonb,
    primary key (queue_id, job_id)
) with (fillfactor = 70);

alter table fl.leases set (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 200);

-- Deleting jobs (the archiver, a queue's cascade) takes their ledger and lease with them.
-- Statement-level, so it costs nothing on the claim and report paths.
create function fl.jobs_deleted() returns trigger
language plpgsql as $$
begin
    delete from fl.leases l using gone g where l.queue_id = g.queue_id and l.job_id = g.id;
    delete from fl.attempts a using gone g where a.job_id = g.id;
    return null;
end;
$$;

create trigger jobs_deleted after delete on fl.jobs
    referencing old table as gone
    for each statement execute function fl.jobs_deleted();

-- One row per death (per replay generation), with the whole attempt history at that moment.
-- A job that is replayed and dies again gets a new row (reference W18).
create table fl.dead_letters (
    id                 bigint generated always as identity primary key,
    job_id             bigint not null references fl.jobs (id) on delete cascade,
    replay_generation  integer not null,
    project_id         uuid not null,
    queue_id           uuid not null,
    reason             text not null check (reason in ('permanent_error', 'attempts_exhausted',
                                                       'lost_exhausted', 'timeout_exhausted',
                                                       'snoozes_exhausted')),
    error_class        text,
    error_message      text,
    attempt_history    jsonb not null,
    dead_at            timestamptz not null,
    replayed_at        timestamptz,
    unique (job_id, replay_generation)
);

create index dead_letters_pending on fl.dead_letters (queue_id, dead_at, id) where replayed_at is null;

-- Every worker write that found the job no longer its own, recorded by the function that
-- refused it (reference W12: the probe undercounted).
create table fl.fence_violations (
    id             bigint generated always as identity primary key,
    job_id         bigint not null,            -- no FK: the record outlives the job
    worker_id      uuid,
    attempted      text not null check (attempted in ('complete', 'fail', 'snooze', 'heartbeat',
                                                      'release')),
    held_fence     bigint not null,
    actual_fence   bigint,
    actual_status  fl.job_status,
    noticed_at     timestamptz not null
);

create index fence_violations_job on fl.fence_violations (job_id);
create index fence_violations_noticed on fl.fence_violations (noticed_at);

-- The outbox. Written in the same transaction as the state change it describes. Hot paths
-- (claim, complete, release, reap, promote, bulk replay) write one row per call and queue with
-- the jobs in payload.jobs; single-job functions write one row per job with job_id set.
-- txid is the writing transaction: a reader that follows (txid, id) and stops below
-- pg_snapshot_xmin(pg_current_snapshot()) never skips a late commit (docs/SCHEMA.md).
create table fl.events (
    id          bigint generated always as identity primary key,
    txid        xid8 not null default pg_current_xact_id(),
    created_at  timestamptz not null default fl.now(),
    project_id  uuid not null,
    queue_id    uuid,
    job_id      bigint,
    topic       text not null,
    payload     jsonb not null default '{}'
);

create index events_stream on fl.events (project_id, txid, id);

-- The edge table and the guard function must agree, both ways.
do $$
declare
    bad text;
begin
    select string_agg(f::text || '->' || t::text, ', ') into bad
      from unnest(enum_range(null::fl.job_status)) f
     cross join unnest(enum_range(null::fl.job_status)) t
     where fl.legal_transition(f, t)
           <> exists (select 1 from fl.job_transitions x where x.from_status = f and x.to_status = t);
    if bad is not null then
        raise exception 'fl.job_transitions and fl.legal_transition disagree on: %', bad;
    end if;
end;
$$;
