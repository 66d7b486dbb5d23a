-- 0006: submission with dependencies, batches and idempotency keys (issue 4).
--
-- fl.submit (0004) stays the lean single-job path for SQL clients. This file adds:
--   * fl.job_dependencies: edges child -> parent. Edges are only ever inserted for a job being
--     created in the same statement, pointing at jobs that already exist or at jobs earlier in
--     the same batch, so every edge points from a job to one created before it: the graph is a
--     DAG by construction and no cycle check is needed (reference W4).
--   * fl.idempotency_keys: (queue, key) -> the job or batch it created, with the request's
--     fingerprint, for 24 hours.
--   * fl.submit_job (one job) and fl.submit_batch (up to 1000), both through fl._submit_jobs.
--   * fl.jobs.has_dependents and the trigger jobs_settle_dependents: when a job with children
--     completes, its waiting children count it off (and become queued at 0 if due); when it is
--     dead-lettered or cancelled, every descendant still waiting is cancelled. Jobs without
--     children never fire it (the WHEN clause reads the new row only).
--
-- Outcomes (the column `outcome`, nothing written unless 'ok'):
--   ok                    created (one row per job, in input order)
--   existing              the key was used before with the same fingerprint: the original
--                         job(s), nothing new
--   idempotency_conflict  the key was used before for a different request
--   queue_full            the depth cap (queued + delayed jobs, any run_at, reference W14)
--   parent_failed         a parent is dead_letter or cancelled (reference W2); `detail` says which
-- Bad input raises class FL (0004's codes, plus FL011: depends_on names a job that does not
-- exist or is in another project, one message for both, reference W3).

alter table fl.jobs add column has_dependents boolean not null default false;

comment on column fl.jobs.has_dependents is
    'Some job depends on this one: set when a child is submitted; arms jobs_settle_dependents.';

create table fl.job_dependencies (
    child_id   bigint not null,
    parent_id  bigint not null,
    primary key (child_id, parent_id),
    constraint job_dependencies_not_self check (child_id <> parent_id)
);

create index job_dependencies_parent on fl.job_dependencies (parent_id, child_id);

comment on table fl.job_dependencies is
    'child waits for parent. No FK to jobs (as fl.attempts): jobs_deleted_edges removes the '
    'edges of deleted jobs. Edges point from a new job to older ones only: a DAG by construction.';

-- Batch progress and the batch scope of the API read jobs by batch_id. Partial: jobs outside
-- a batch never enter it (their updates only evaluate the predicate).
create index jobs_batch on fl.jobs (batch_id) where batch_id is not null;

create table fl.idempotency_keys (
    queue_id     uuid not null references fl.queues (id) on delete cascade,
    key          text not null check (length(key) between 1 and 200),
    fingerprint  bytea not null,
    job_id       bigint,                -- a single submission
    batch_id     uuid,                  -- a batch submission
    job_ids      bigint[] not null,     -- every job created, in input order
    created_at   timestamptz not null,
    expires_at   timestamptz not null,
    primary key (queue_id, key)
);

create index idempotency_keys_expires on fl.idempotency_keys (expires_at);

-- Deleting jobs (archiver, a queue's cascade) removes their edges, both directions.
create function fl.jobs_deleted_edges() returns trigger
language plpgsql as $$
begin
    delete from fl.job_dependencies d using gone g where d.child_id = g.id;
    delete from fl.job_dependencies d using gone g where d.parent_id = g.id;
    return null;
end;
$$;

create trigger jobs_deleted_edges after delete on fl.jobs
    referencing old table as gone
    for each statement execute function fl.jobs_deleted_edges();

-- ---------------------------------------------------------------------------------------
-- A parent finished: settle its children
-- ---------------------------------------------------------------------------------------

-- completed: each waiting child counts it off (pending_deps - 1); a child at 0 becomes queued
--   if its run_at has come (one jobs.promoted row), else it waits for the promoter.
-- dead_letter or cancelled: every descendant still waiting on parents can now never run; all
--   of them (recursive, UNION so even a cycle would end) are cancelled in one statement,
--   fence + 1, each with a job.cancelled {from, reason: parent_failed, ancestor} event.
-- Children are locked in id order. Two parents of one child completing at once: the second
-- waits for the first's row lock on the child, re-reads it, and takes it from 1 to 0: the
-- child is queued exactly once. Replaying a dead parent later does not revive cancelled
-- children (cancelled is terminal); their cancellation events say why.
--
-- Nested loops over index scans only: every access is by key (edges by parent, jobs by id),
-- but the planner guesses a recursive walk's size badly and chose, per level, a sequential
-- scan of jobs, then a hash of every scheduled job, then a merge join over the whole edge
-- index (measured cancelling the head of a 1000-job chain: 2.6 s, 0.4 s, 0.5 s; with these
-- settings 30-40 ms, the same as a fan-out of 999 children).
create function fl.jobs_settle_dependents() returns trigger
language plpgsql
set enable_seqscan = off
set enable_hashjoin = off
set enable_mergejoin = off
as $$
declare
    v_now timestamptz := fl.now();
    v_ids bigint[];
    v_queues uuid[];
begin
    -- The cascade below cancels every waiting descendant at once; the nested firings it
    -- causes (depth 2, a cancelled descendant that has children) have nothing left to do.
    if new.status = 'cancelled' and pg_trigger_depth() > 1 then
        return null;
    end if;

    if new.status = 'completed' then
        v_ids := array(
            select c.id
              from fl.job_dependencies d
              join fl.jobs c on c.id = d.child_id
             where d.parent_id = new.id and c.status = 'scheduled' and c.pending_deps > 0
             order by c.id
               for no key update of c);
        if cardinality(v_ids) = 0 then
            return null;
        end if;
        with u as (
            update fl.jobs c
               set pending_deps = c.pending_deps - 1,
                   status = (case when c.pending_deps = 1 and c.run_at <= v_now then 'queued'
                                  else 'scheduled' end)::fl.job_status
             where c.id = any(v_ids)
            returning c.id, c.status, c.queue_id, c.project_id
        ), ev as (
            insert into fl.events (project_id, queue_id, topic, payload, created_at)
            select u.project_id, u.queue_id, 'jobs.promoted',
                   jsonb_build_object('jobs', jsonb_agg(u.id order by u.id), 'parent', new.id),
                   v_now
              from u
             where u.status = 'queued'
             group by u.project_id, u.queue_id
        )
        select array_agg(distinct u.queue_id) into v_queues from u where u.status = 'queued';
        perform fl._notify_queues(v_queues);
        return null;
    end if;

    -- dead_letter or cancelled. The walk follows edges only (index-only scans of
    -- job_dependencies_parent): every descendant of a job that never completed is waiting or
    -- already cancelled, so nothing is missed by not checking states on the way, and joining
    -- jobs at each level made the planner hash all scheduled jobs per level.
    v_ids := array(
        with recursive d(id) as (
            select e.child_id from fl.job_dependencies e where e.parent_id = new.id
            union
            select e.child_id from d join fl.job_dependencies e on e.parent_id = d.id
        )
        select j.id from d join fl.jobs j on j.id = d.id
         where j.status = 'scheduled' and j.pending_deps > 0
         order by j.id
           for update of j);
    if cardinality(v_ids) = 0 then
        return null;
    end if;
    with u as (
        update fl.jobs j
           set status = 'cancelled', fence = j.fence + 1, finished_at = v_now, pending_deps = 0
         where j.id = any(v_ids)
        returning j.id, j.queue_id, j.project_id, j.fence
    ), ev as (
        insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
        select u.project_id, u.queue_id, u.id, 'job.cancelled',
               jsonb_build_object('from', 'scheduled', 'reason', 'parent_failed',
                                  'ancestor', new.id, 'fence', u.fence),
               v_now
          from u
    )
    select array_agg(distinct u.queue_id) into v_queues from u;
    perform fl._notify_queues(v_queues);
    return null;
end;
$$;

create trigger jobs_settle_dependents after update of status on fl.jobs
    for each row
    when (new.has_dependents and new.status in ('completed', 'dead_letter', 'cancelled'))
    execute function fl.jobs_settle_dependents();

-- ---------------------------------------------------------------------------------------
-- Submission
-- ---------------------------------------------------------------------------------------

-- The key's earlier answer: 'existing' rows (the jobs it created, in input order, as they are
-- now; a job archived since has NULL details) or one 'idempotency_conflict' row.
create function fl._idempotent_answer(p_row fl.idempotency_keys, p_fingerprint bytea)
returns table (outcome text, ord integer, job_id bigint, batch_id uuid, status fl.job_status,
               priority integer, run_at timestamptz, created_at timestamptz, detail text)
language plpgsql stable as $$
#variable_conflict use_column
begin
    if p_row.fingerprint <> p_fingerprint then
        return query select 'idempotency_conflict'::text, null::integer, null::bigint,
                            null::uuid, null::fl.job_status, null::integer,
                            null::timestamptz, null::timestamptz,
                            'the Idempotency-Key was used for a different request'::text;
        return;
    end if;
    return query
    select 'existing'::text, x.ord::integer, x.id, p_row.batch_id, j.status, j.priority,
           j.run_at, j.created_at, null::text
      from unnest(p_row.job_ids) with ordinality as x(id, ord)
      left join fl.jobs j on j.id = x.id
     order by x.ord;
end;
$$;

-- The one implementation behind fl.submit_job and fl.submit_batch. p_specs is a JSON array of
-- job specs (objects): type (required), payload, priority, run_at, delay_ms, timeout_ms,
-- retry_policy_id, depends_on (job ids), depends_on_batch (0-based indexes of earlier
-- entries of this batch). Any other field is refused (FL005): nothing is silently dropped
-- (reference W15). p_batch: give the jobs a shared batch_id and write one jobs.submitted
-- row; otherwise (one spec) a job.submitted row.
--
-- Order (it decides which answer wins): input checks (FL, nothing written) -> idempotency
-- lookup (an earlier success is returned even if the queue is now full, reference W14) ->
-- depth cap (any run_at counts, W14) -> parents (FL011 unknown or foreign; parent_failed) ->
-- claim the key (a concurrent first use waits here and then returns the winner's jobs) ->
-- insert jobs, edges, events, notify once.
create function fl._submit_jobs(
    p_queue        uuid,
    p_specs        jsonb,
    p_batch        boolean,
    p_key          text,
    p_fingerprint  bytea)
returns table (outcome text, ord integer, job_id bigint, batch_id uuid, status fl.job_status,
               priority integer, run_at timestamptz, created_at timestamptz, detail text)
language plpgsql as $$
#variable_conflict use_column
declare
    v_now timestamptz := fl.now();
    q record;
    n integer;
    i integer;
    e jsonb;
    k text;
    v_where text;
    v_types text[] := '{}';
    v_payloads jsonb[] := '{}';
    v_priorities integer[] := '{}';
    v_run_ats timestamptz[] := '{}';
    v_timeouts integer[] := '{}';
    v_policies uuid[] := '{}';
    v_delay double precision;
    v_run_at timestamptz;
    v_num numeric;
    v_policy uuid;
    v_found bigint[];
    v_edge_child integer[] := '{}';    -- 1-based index of the child in this call
    v_edge_parent bigint[] := '{}';    -- an existing job id ...
    v_edge_local integer[] := '{}';    -- ... or the 1-based index of an earlier entry
    v_parent_ids bigint[];
    v_parent record;
    v_ids bigint[];
    v_batch uuid;
    v_key fl.idempotency_keys;
    v_claimed boolean;
    v_pending integer[];
    v_statuses fl.job_status[];
begin
    -- -- input -----------------------------------------------------------------------------
    if p_specs is null or jsonb_typeof(p_specs) <> 'array' then
        perform fl._bad_input('FL005', 'jobs must be a JSON array of job specs');
    end if;
    n := jsonb_array_length(p_specs);
    if n not between 1 and 1000 then
        perform fl._bad_input('FL005', format('a batch holds 1 to 1000 jobs, got %s', n));
    end if;
    if p_key is not null and (length(p_key) not between 1 and 200 or p_fingerprint is null) then
        perform fl._bad_input('FL005',
            'an idempotency key is 1 to 200 characters and needs a fingerprint');
    end if;

    select qq.project_id, qq.retry_policy_id, qq.default_priority, qq.default_timeout_ms,
           qq.max_depth
      into q from fl.queues qq where qq.id = p_queue;
    if not found then
        perform fl._bad_input('FL001', format('queue %s does not exist', coalesce(p_queue::text, 'null')));
    end if;

    for i in 1 .. n loop
        e := p_specs -> (i - 1);
        v_where := case when p_batch then format('jobs[%s].', i - 1) else '' end;
        if jsonb_typeof(e) is distinct from 'object' then
            perform fl._bad_input('FL005', format('%sa job spec must be an object', v_where));
        end if;
        for k in select jsonb_object_keys(e) loop
            if k not in ('type', 'payload', 'priority', 'run_at', 'delay_ms', 'timeout_ms',
                         'retry_policy_id', 'depends_on', 'depends_on_batch') then
                perform fl._bad_input('FL005', format('%s%s is not a known field', v_where, k));
            end if;
        end loop;
        if jsonb_typeof(e -> 'type') is distinct from 'string'
           or length(e ->> 'type') not between 1 and 200 then
            perform fl._bad_input('FL009', format('%stype must be 1 to 200 characters', v_where));
        end if;
        if jsonb_typeof(e -> 'payload') = 'null' then
            perform fl._bad_input('FL005', format('%spayload must not be null (use {} for none)', v_where));
        end if;
        if pg_column_size(coalesce(e -> 'payload', '{}')) > 262144 then
            perform fl._bad_input('FL002', format('%spayload is %s bytes, the limit is 262144',
                                                  v_where, pg_column_size(e -> 'payload')));
        end if;
        foreach k in array array['priority', 'timeout_ms', 'delay_ms'] loop
            if coalesce(jsonb_typeof(e -> k), 'null') not in ('null', 'number') then
                perform fl._bad_input('FL005', format('%s%s must be an integer', v_where, k));
            end if;
            if jsonb_typeof(e -> k) = 'number' then
                v_num := (e ->> k)::numeric;
                if (v_num <> trunc(v_num)
                    or v_num < (case k when 'priority' then -2147483648 when 'timeout_ms' then 1
                                       else 0 end)
                    or v_num > (case k when 'delay_ms' then 315360000000 else 2147483647 end)) then
                    perform fl._bad_input('FL005', format('%s%s must be an integer in range%s',
                        v_where, k, case k when 'timeout_ms' then ' (1 to 2147483647)'
                                           when 'delay_ms' then ' (0 to 315360000000)'
                                           else ' (-2147483648 to 2147483647)' end));
                end if;
            end if;
        end loop;
        v_run_at := null;
        if jsonb_typeof(e -> 'run_at') = 'string' then
            begin
                v_run_at := (e ->> 'run_at')::timestamptz;
            exception when others then
                perform fl._bad_input('FL003', format('%srun_at is not a timestamp', v_where));
            end;
            if not isfinite(v_run_at) then
                perform fl._bad_input('FL003', format('%srun_at must be a finite time', v_where));
            end if;
        elsif coalesce(jsonb_typeof(e -> 'run_at'), 'null') <> 'null' then
            perform fl._bad_input('FL003', format('%srun_at is not a timestamp', v_where));
        end if;
        v_delay := (e ->> 'delay_ms')::double precision / 1000.0;
        if v_run_at is not null and v_delay is not null then
            perform fl._bad_input('FL005', format('%sgive run_at or delay_ms, not both', v_where));
        end if;
        if coalesce(jsonb_typeof(e -> 'retry_policy_id'), 'null') not in ('null', 'string')
           or (e ->> 'retry_policy_id') !~* '^[0-9a-f]{8}-?([0-9a-f]{4}-?){3}[0-9a-f]{12}$' then
            perform fl._bad_input('FL005', format('%sretry_policy_id must be a UUID', v_where));
        end if;

        -- depends_on: existing job ids; depends_on_batch: earlier entries of this call.
        foreach k in array array['depends_on', 'depends_on_batch'] loop
            if coalesce(jsonb_typeof(e -> k), 'null') not in ('null', 'array') then
                perform fl._bad_input('FL005', format('%s%s must be an array', v_where, k));
            end if;
            if (jsonb_typeof(e -> k) = 'array' and exists (
                   select 1 from jsonb_array_elements(e -> k) x
                    where (case when jsonb_typeof(x) <> 'number' or x::text !~ '^[0-9]{1,19}$'
                                then true
                                when k = 'depends_on'
                                then x::text::numeric not between 1 and 9223372036854775807
                                else x::text::numeric >= i - 1 end))) then
                perform fl._bad_input('FL005', case k
                    when 'depends_on' then format('%sdepends_on must be an array of job ids', v_where)
                    else format('%sdepends_on_batch may only list indexes of earlier entries of the batch (below %s)',
                                v_where, i - 1) end);
            end if;
        end loop;
        if jsonb_array_length(coalesce(e -> 'depends_on', '[]'))
           + jsonb_array_length(coalesce(e -> 'depends_on_batch', '[]')) > 1000 then
            perform fl._bad_input('FL005', format('%sa job may depend on at most 1000 jobs', v_where));
        end if;
        if (select count(*) <> count(distinct x::text)
              from jsonb_array_elements(coalesce(e -> 'depends_on', '[]')) x)
           or (select count(*) <> count(distinct x::text)
                 from jsonb_array_elements(coalesce(e -> 'depends_on_batch', '[]')) x) then
            perform fl._bad_input('FL005', format('%sdepends_on must not repeat a job', v_where));
        end if;

        v_types := v_types || (e ->> 'type');
        v_payloads := v_payloads || coalesce(e -> 'payload', '{}');
        v_priorities := v_priorities || coalesce((e ->> 'priority')::integer, q.default_priority);
        v_run_ats := v_run_ats || coalesce(v_run_at, v_now + make_interval(secs => coalesce(v_delay, 0)));
        v_timeouts := v_timeouts || coalesce((e ->> 'timeout_ms')::integer, q.default_timeout_ms);
        v_policies := v_policies || coalesce((e ->> 'retry_policy_id')::uuid, q.retry_policy_id);
        v_edge_child := v_edge_child
            || array(select i from jsonb_array_elements(coalesce(e -> 'depends_on', '[]')) x)
            || array(select i from jsonb_array_elements(coalesce(e -> 'depends_on_batch', '[]')) x);
        v_edge_parent := v_edge_parent
            || array(select x::text::bigint from jsonb_array_elements(coalesce(e -> 'depends_on', '[]')) x)
            || array(select null::bigint from jsonb_array_elements(coalesce(e -> 'depends_on_batch', '[]')) x);
        v_edge_local := v_edge_local
            || array(select null::integer from jsonb_array_elements(coalesce(e -> 'depends_on', '[]')) x)
            || array(select x::text::integer + 1
                       from jsonb_array_elements(coalesce(e -> 'depends_on_batch', '[]')) x);
    end loop;

    select x into v_policy from unnest(v_policies) x
     where not exists (select 1 from fl.retry_policies rp
                        where rp.id = x and rp.project_id = q.project_id)
     limit 1;
    if found then
        perform fl._bad_input('FL007', format('retry policy %s does not exist in the queue''s project',
                                              v_policy));
    end if;

    -- -- idempotency lookup: an earlier success wins over everything below -----------------
    if p_key is not null then
        delete from fl.idempotency_keys ik
         where ik.queue_id = p_queue and ik.key = p_key and ik.expires_at <= v_now;
        select * into v_key from fl.idempotency_keys ik
         where ik.queue_id = p_queue and ik.key = p_key;
        if found then
            return query select * from fl._idempotent_answer(v_key, p_fingerprint);
            return;
        end if;
    end if;

    -- -- depth cap: queued + delayed jobs, whatever run_at the new ones carry ---------------
    if q.max_depth is not null
       and fl._queue_depth(p_queue, q.max_depth) + n > q.max_depth then
        return query select 'queue_full'::text, null::integer, null::bigint, null::uuid,
                            null::fl.job_status, null::integer, null::timestamptz,
                            null::timestamptz,
                            format('the queue holds its maximum of %s waiting jobs', q.max_depth);
        return;
    end if;

    -- -- parents: exist in this project; lock them (id order) so none finishes unseen ------
    v_parent_ids := array(select distinct x from unnest(v_edge_parent) x where x is not null
                          order by x);
    if cardinality(v_parent_ids) > 0 then
        -- Locked in id order (the sort runs below the lock), FOR NO KEY UPDATE: a parent's
        -- completion or death waits for this submission, then its trigger sees the new edges.
        v_found := array(select jj.id from fl.jobs jj
                          where jj.id = any(v_parent_ids) and jj.project_id = q.project_id
                          order by jj.id
                            for no key update);
        if cardinality(v_found) < cardinality(v_parent_ids) then
            perform fl._bad_input('FL011', format(
                'depends_on names job %s, which does not exist',
                (select min(x) from unnest(v_parent_ids) x where not (x = any(v_found)))));
        end if;
        select x.id, j.status into v_parent
          from unnest(v_parent_ids) x(id) join fl.jobs j on j.id = x.id
         where j.status in ('dead_letter', 'cancelled')
         order by x.id limit 1;
        if found then
            return query select 'parent_failed'::text, null::integer, null::bigint, null::uuid,
                                null::fl.job_status, null::integer, null::timestamptz,
                                null::timestamptz,
                                format('parent job %s is %s: this job could never run',
                                       v_parent.id, v_parent.status);
            return;
        end if;
    end if;

    -- -- ids first, so edges and the key can name them ------------------------------------
    v_ids := array(select s.x from (select nextval('fl.jobs_id_seq') as x
                                      from generate_series(1, n)) s order by s.x);
    v_batch := case when p_batch then gen_random_uuid() end;

    -- -- claim the key; a concurrent first use waits here, then answers with the winner ---
    if p_key is not null then
        insert into fl.idempotency_keys (queue_id, key, fingerprint, job_id, batch_id, job_ids,
                                         created_at, expires_at)
        values (p_queue, p_key, p_fingerprint, case when p_batch then null else v_ids[1] end,
                v_batch, v_ids, v_now, v_now + interval '24 hours')
        on conflict do nothing;
        get diagnostics i = row_count;
        v_claimed := i = 1;
        if not v_claimed then
            select * into v_key from fl.idempotency_keys ik
             where ik.queue_id = p_queue and ik.key = p_key;
            return query select * from fl._idempotent_answer(v_key, p_fingerprint);
            return;
        end if;
    end if;

    -- -- pending parents per job: existing ones not completed, plus every batch parent -----
    v_pending := array(
        select coalesce(c.n, 0)::integer
          from generate_series(1, n) s(i)
          left join (select ed.child, count(*) as n
                       from unnest(v_edge_child, v_edge_parent, v_edge_local)
                            as ed(child, parent, loc)
                       left join fl.jobs pj on pj.id = ed.parent
                      where ed.loc is not null or pj.status <> 'completed'
                      group by ed.child) c on c.child = s.i
         order by s.i);
    v_statuses := array(
        select (case when v_pending[s.i] > 0 or v_run_ats[s.i] > v_now then 'scheduled'
                     else 'queued' end)::fl.job_status
          from generate_series(1, n) s(i) order by s.i);

    insert into fl.jobs (id, project_id, queue_id, type, payload, status, priority, run_at,
                         timeout_ms, retry_policy_id, created_at, batch_id, pending_deps,
                         has_dependents)
    overriding system value
    select v_ids[s.i], q.project_id, p_queue, v_types[s.i], v_payloads[s.i], v_statuses[s.i],
           v_priorities[s.i], v_run_ats[s.i], v_timeouts[s.i], v_policies[s.i], v_now, v_batch,
           v_pending[s.i], coalesce(s.i = any(v_edge_local), false)
      from generate_series(1, n) s(i)
     order by s.i;

    if cardinality(v_edge_child) > 0 then
        insert into fl.job_dependencies (child_id, parent_id)
        select v_ids[ed.child], coalesce(ed.parent, v_ids[ed.loc])
          from unnest(v_edge_child, v_edge_parent, v_edge_local) as ed(child, parent, loc);
        update fl.jobs j set has_dependents = true
         where j.id = any(v_parent_ids) and not j.has_dependents;
    end if;

    if p_batch then
        insert into fl.events (project_id, queue_id, topic, payload, created_at)
        values (q.project_id, p_queue, 'jobs.submitted',
                jsonb_build_object('batch_id', v_batch, 'jobs',
                    (select jsonb_agg(jsonb_build_array(v_ids[s.i], v_types[s.i], v_statuses[s.i],
                                                        v_run_ats[s.i]) order by s.i)
                       from generate_series(1, n) s(i))),
                v_now);
    else
        insert into fl.events (project_id, queue_id, job_id, topic, payload, created_at)
        values (q.project_id, p_queue, v_ids[1], 'job.submitted',
                jsonb_build_object('type', v_types[1], 'status', v_statuses[1],
                                   'run_at', v_run_ats[1])
                || case when cardinality(v_edge_child) > 0
                        then jsonb_build_object('depends_on', to_jsonb(v_parent_ids))
                        else '{}' end,
                v_now);
    end if;
    perform pg_notify('fl_queue', p_queue::text);

    return query
    select 'ok'::text, s.i, v_ids[s.i], v_batch, v_statuses[s.i], v_priorities[s.i],
           v_run_ats[s.i], v_now, null::text
      from generate_series(1, n) s(i)
     order by s.i;
end;
$$;

-- One job, with optional parents and idempotency key. p_delay_ms: run after this many ms
-- (or p_run_at; not both). The fingerprint is the caller's digest of its request (the API
-- hashes the request as sent, so a changed queue default does not turn a retry into a
-- conflict); required with a key.
create function fl.submit_job(
    p_queue            uuid,
    p_type             text,
    p_payload          jsonb default '{}',
    p_priority         integer default null,
    p_run_at           timestamptz default null,
    p_delay_ms         bigint default null,
    p_timeout_ms       integer default null,
    p_retry_policy     uuid default null,
    p_depends_on       bigint[] default null,
    p_idempotency_key  text default null,
    p_fingerprint      bytea default null)
returns table (outcome text, job_id bigint, status fl.job_status, priority integer,
               run_at timestamptz, created_at timestamptz, detail text)
language plpgsql as $$
#variable_conflict use_column
begin
    if p_payload is null then
        perform fl._bad_input('FL005', 'payload must not be null (use {} for none)');
    end if;
    if p_depends_on is not null and array_position(p_depends_on, null) is not null then
        perform fl._bad_input('FL005', 'depends_on must not contain null');
    end if;
    return query
    select r.outcome, r.job_id, r.status, r.priority, r.run_at, r.created_at, r.detail
      from fl._submit_jobs(
               p_queue,
               jsonb_build_array(jsonb_strip_nulls(jsonb_build_object(
                   'type', to_jsonb(p_type), 'priority', p_priority,
                   'run_at', p_run_at, 'delay_ms', p_delay_ms, 'timeout_ms', p_timeout_ms,
                   'retry_policy_id', p_retry_policy, 'depends_on', to_jsonb(p_depends_on)))
                   || jsonb_build_object('payload', p_payload)),
               false, p_idempotency_key, p_fingerprint) r;
end;
$$;

-- Up to 1000 jobs in one statement under one batch_id; p_jobs is the JSON array of specs
-- described on fl._submit_jobs (depends_on_batch names earlier entries by index). One row
-- per job in input order with outcome ok or existing, or one row with the refusal.
create function fl.submit_batch(
    p_queue            uuid,
    p_jobs             jsonb,
    p_idempotency_key  text default null,
    p_fingerprint      bytea default null)
returns table (outcome text, job_id bigint, batch_id uuid, status fl.job_status,
               run_at timestamptz, detail text)
language sql as $$
    select r.outcome, r.job_id, r.batch_id, r.status, r.run_at, r.detail
      from fl._submit_jobs(p_queue, p_jobs, true, p_idempotency_key, p_fingerprint) r
     order by r.ord
$$;

-- Expired keys (older than 24 h), at most p_limit per call: for the archiver. A key found
-- expired by a submission is deleted there and treated as new anyway.
create function fl.prune_idempotency_keys(p_limit integer default 10000) returns integer
language plpgsql as $$
declare
    n integer;
begin
    if p_limit is null or p_limit not between 1 and 1000000 then
        perform fl._bad_input('FL005', 'limit must be between 1 and 1000000');
    end if;
    delete from fl.idempotency_keys ik
     where ctid = any(array(select k.ctid from fl.idempotency_keys k
                             where k.expires_at <= fl.now() limit p_limit));
    get diagnostics n = row_count;
    return n;
end;
$$;

-- Batch progress: jobs per status (hot jobs only; archived jobs no longer count).
create function fl.batch_progress(p_batch uuid)
returns table (total bigint, done bigint, status_counts jsonb)
language sql stable as $$
    select coalesce(sum(c.n), 0)::bigint,
           coalesce(sum(c.n) filter (where c.status in ('completed', 'dead_letter', 'cancelled')),
                    0)::bigint,
           coalesce(jsonb_object_agg(c.status, c.n), '{}')
      from (select j.status, count(*) as n from fl.jobs j where j.batch_id = p_batch
             group by j.status) c
$$;
